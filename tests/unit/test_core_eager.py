"""Eager outer updates: the formula, the first round, failed rounds and the saved state."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from p2p_diloco.core.eager import EagerOuterStep
from p2p_diloco.core.outer import make_anchors, nesterov_outer_optimizer


def _scalar(value: float) -> list[torch.Tensor]:
    return [torch.tensor([value], dtype=torch.float32)]


def _tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]


def test_first_round_and_second_round_by_hand() -> None:
    eager = EagerOuterStep()
    # Round 1: Δ(0) = 0, Δ_m(0) = 0 → Δ̃ = Δ_m(1)/M = 4/4.
    assert eager.outer_delta(_scalar(4.0), None, group_size=4)[0].item() == 1.0
    assert eager.has_previous
    # Round 2: Δ(1) = 2 → Δ̃ = 2 + (8 − 4)/4 = 3.
    assert eager.outer_delta(_scalar(8.0), _scalar(2.0), group_size=4)[0].item() == 3.0
    # Round 3 corrects with the round-2 own term (8): 1 + (0 − 8)/4 = −1.
    assert eager.outer_delta(_scalar(0.0), _scalar(1.0), group_size=4)[0].item() == -1.0


def test_matches_own_fresh_plus_others_one_round_old() -> None:
    m = 4
    old = [_tensors(i) for i in range(m)]  # everyone's Δ(t-1); peer 0 is "us"
    own_fresh = _tensors(99)
    avg_old = [sum(p[k] for p in old) / m for k in range(2)]
    eager = EagerOuterStep()
    eager.outer_delta(old[0], None, group_size=m)
    got = eager.outer_delta(own_fresh, avg_old, group_size=m)
    want = [(own_fresh[k] + sum(p[k] for p in old[1:])) / m for k in range(2)]
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-6)


def test_failed_previous_average_uses_own_term_only_and_keeps_going() -> None:
    eager = EagerOuterStep()
    eager.outer_delta(_scalar(4.0), None, group_size=2)
    # Round 2's background average failed: only the own fresh term, scaled 1/M.
    assert eager.outer_delta(_scalar(6.0), None, group_size=2)[0].item() == 3.0
    # Round 3 corrects the (successful) round-2 average with the stored round-2 own term.
    assert eager.outer_delta(_scalar(10.0), _scalar(5.0), group_size=2)[0].item() == 5.0 + (10.0 - 6.0) / 2


def test_own_share_overrides_one_over_m() -> None:
    eager = EagerOuterStep()
    eager.outer_delta(_scalar(2.0), None, group_size=4, own_share=0.5)
    assert eager.outer_delta(_scalar(6.0), _scalar(1.0), group_size=4, own_share=0.5)[0].item() == 3.0


def test_stored_term_is_a_copy() -> None:
    eager = EagerOuterStep()
    fresh = _scalar(4.0)
    eager.outer_delta(fresh, None, group_size=2)
    fresh[0].fill_(100.0)  # caller reuses its buffer
    assert eager.state_tensors()["eager.prev_own.0"].item() == 4.0


def test_step_feeds_the_outer_optimizer() -> None:
    start = _tensors(0)
    eager_outer = nesterov_outer_optimizer(make_anchors(start))
    manual_outer = nesterov_outer_optimizer(make_anchors(start))
    eager, shadow = EagerOuterStep(), EagerOuterStep()
    for t in range(3):
        avg = None if t == 0 else _tensors(50 + t)
        delta = eager.step(eager_outer, _tensors(t + 1), avg, group_size=3)
        expected = shadow.outer_delta(_tensors(t + 1), avg, group_size=3)
        assert all(torch.equal(a, b) for a, b in zip(delta, expected, strict=True))
        manual_outer.step(expected)
    for a, b in zip(eager_outer.anchors, manual_outer.anchors, strict=True):
        assert torch.equal(a, b)


def test_errors() -> None:
    eager = EagerOuterStep()
    with pytest.raises(ValueError, match="no own pseudo-gradient"):
        eager.outer_delta(_scalar(1.0), _scalar(1.0), group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        eager.outer_delta(_scalar(1.0), None, group_size=0)
    with pytest.raises(ValueError, match="own_share"):
        eager.outer_delta(_scalar(1.0), None, group_size=2, own_share=1.5)
    eager.outer_delta(_scalar(1.0), None, group_size=2)
    with pytest.raises(ValueError, match="shape"):
        eager.outer_delta([torch.zeros(2)], None, group_size=2)
    with pytest.raises(ValueError, match="shape"):
        eager.outer_delta(_scalar(1.0), [torch.zeros(2)], group_size=2)


def test_state_roundtrip_through_safetensors(tmp_path) -> None:
    eager = EagerOuterStep()
    assert eager.state_tensors() == {}
    eager.outer_delta(_tensors(1), None, group_size=3)
    path = tmp_path / "eager.safetensors"
    save_file(eager.state_tensors(), str(path))

    restored = EagerOuterStep()
    restored.load_state_tensors(load_file(str(path)), like=_tensors(0))
    fresh, avg = _tensors(2), _tensors(3)
    for a, b in zip(
        eager.outer_delta(fresh, avg, group_size=3),
        restored.outer_delta(fresh, avg, group_size=3),
        strict=True,
    ):
        assert torch.equal(a, b)
    restored.load_state_tensors({})
    assert not restored.has_previous


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (
            {"eager.prev_own.0": torch.zeros(3, 4, dtype=torch.float16), "eager.prev_own.1": torch.zeros(5)},
            "dtype",
        ),
        ({"eager.prev_own.0": torch.full((3, 4), math.inf), "eager.prev_own.1": torch.zeros(5)}, "NaN"),
        ({"eager.prev_own.0": torch.zeros(3, 4), "eager.prev_own.2": torch.zeros(5)}, "indices"),
        ({"eager.prev_own.0": torch.zeros(3, 4)}, "expected 2 tensors"),
        ({"eager.prev_own.0": torch.zeros(4, 3), "eager.prev_own.1": torch.zeros(5)}, "shape"),
        ({"eager.prev_own.a": torch.zeros(3, 4)}, "unexpected"),
    ],
)
def test_load_state_validation(state: dict[str, torch.Tensor], match: str) -> None:
    eager = EagerOuterStep()
    with pytest.raises(ValueError, match=match):
        eager.load_state_tensors(state, like=_tensors(0))
    assert not eager.has_previous
