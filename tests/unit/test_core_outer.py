"""Pseudo-gradients, weighted means and the outer optimizer (incl. its saved state)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from p2p_diloco.core.outer import (
    OuterOptimizer,
    build_outer_optimizer,
    fedavg_outer_optimizer,
    make_anchors,
    nesterov_outer_optimizer,
)
from p2p_diloco.core.pseudograd import all_finite, pseudo_gradient, weighted_mean


def _scalar(value: float) -> list[torch.Tensor]:
    return [torch.tensor([value], dtype=torch.float32)]


def _random_params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]


# --- pseudo_gradient / weighted_mean -------------------------------------------------------


def test_pseudo_gradient_is_old_minus_new_in_fp32() -> None:
    anchor = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    current = [torch.tensor([0.5, 2.5], dtype=torch.bfloat16), torch.tensor([[1.0]], dtype=torch.bfloat16)]
    delta = pseudo_gradient(anchor, current)
    assert [d.dtype for d in delta] == [torch.float32, torch.float32]
    assert torch.equal(delta[0], torch.tensor([0.5, -0.5]))
    assert torch.equal(delta[1], torch.tensor([[2.0]]))


def test_pseudo_gradient_reuses_out_buffers() -> None:
    anchor, current = _random_params(0), _random_params(1)
    out = [torch.empty_like(a) for a in anchor]
    pointers = [o.data_ptr() for o in out]
    result = pseudo_gradient(anchor, current, out=out)
    assert result is out
    assert [o.data_ptr() for o in result] == pointers
    for r, a, c in zip(result, anchor, current, strict=True):
        assert torch.allclose(r, a - c)
    # A second round into the same buffers overwrites, never accumulates.
    pseudo_gradient(anchor, anchor, out=out)
    assert all(torch.count_nonzero(o) == 0 for o in out)


def test_pseudo_gradient_rejects_mismatches() -> None:
    anchor = [torch.zeros(3)]
    with pytest.raises(ValueError, match="shape"):
        pseudo_gradient(anchor, [torch.zeros(4)])
    with pytest.raises(ValueError, match="expected 1 tensors"):
        pseudo_gradient(anchor, [torch.zeros(3), torch.zeros(3)])
    with pytest.raises(ValueError, match="float32"):
        pseudo_gradient(anchor, [torch.zeros(3)], out=[torch.zeros(3, dtype=torch.float16)])


def test_weighted_mean_hand_numbers() -> None:
    deltas = [_scalar(1.0), _scalar(4.0)]
    assert torch.allclose(weighted_mean(deltas, [1.0, 1.0])[0], torch.tensor([2.5]))
    assert torch.allclose(weighted_mean(deltas, [3.0, 1.0])[0], torch.tensor([1.75]))


def test_weighted_mean_skips_zero_weight_entries_entirely() -> None:
    deltas = [_scalar(2.0), [torch.tensor([math.nan])]]
    assert torch.equal(weighted_mean(deltas, [1.0, 0.0])[0], torch.tensor([2.0]))


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ([1.0, -1.0], "negative"),
        ([1.0, math.nan], "not finite"),
        ([math.inf, 1.0], "not finite"),
        ([0.0, 0.0], "sum to zero"),
        ([1.0], "2 contributions but 1 weights"),
    ],
)
def test_weighted_mean_rejects_bad_weights(weights: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        weighted_mean([_scalar(1.0), _scalar(2.0)], weights)


def test_weighted_mean_rejects_shape_mismatch_and_empty() -> None:
    with pytest.raises(ValueError, match="shape"):
        weighted_mean([[torch.zeros(2)], [torch.zeros(3)]], [1.0, 1.0])
    with pytest.raises(ValueError, match="no contributions"):
        weighted_mean([], [])


def test_all_finite() -> None:
    assert all_finite([torch.zeros(3), torch.ones(2)])
    assert not all_finite([torch.zeros(3), torch.tensor([1.0, math.inf])])
    assert not all_finite([torch.tensor([math.nan])])


# --- outer optimizer -----------------------------------------------------------------------


def test_nesterov_two_steps_by_hand() -> None:
    # Step 1: m = 0.5; θ = 1 − 0.7·(0.5 + 0.9·0.5) = 0.335.
    # Step 2 with Δ = −0.2: m = 0.9·0.5 − 0.2 = 0.25; θ = 0.335 − 0.7·(−0.2 + 0.9·0.25) = 0.3175.
    anchors = _scalar(1.0)
    outer = nesterov_outer_optimizer(anchors)
    outer.step(_scalar(0.5))
    assert anchors[0].item() == pytest.approx(0.335, abs=1e-7)
    assert outer.momentum_buffers()[0].item() == pytest.approx(0.5)
    outer.step(_scalar(-0.2))
    assert outer.momentum_buffers()[0].item() == pytest.approx(0.25, abs=1e-7)
    assert anchors[0].item() == pytest.approx(0.3175, abs=1e-6)


def test_fedavg_equals_plain_average_of_models() -> None:
    start = _random_params(0)
    models = [_random_params(seed) for seed in (1, 2, 3)]
    weights = [1.0, 2.0, 5.0]
    anchors = make_anchors(start)
    outer = fedavg_outer_optimizer(anchors)
    outer.step(weighted_mean([pseudo_gradient(anchors, m) for m in models], weights))
    for index, anchor in enumerate(anchors):
        expected = sum(w * m[index] for w, m in zip(weights, models, strict=True)) / sum(weights)
        assert torch.allclose(anchor, expected, atol=1e-6)


def test_step_leaves_delta_untouched_and_clears_grad() -> None:
    anchors = make_anchors(_random_params(0))
    delta = _random_params(1)
    before = [d.clone() for d in delta]
    outer = nesterov_outer_optimizer(anchors)
    outer.step(delta)
    outer.step(delta)
    assert all(torch.equal(d, b) for d, b in zip(delta, before, strict=True))
    assert all(a.grad is None for a in anchors)


def test_apply_momentum_free_moves_params_and_keeps_momentum() -> None:
    anchors = _scalar(1.0)
    outer = nesterov_outer_optimizer(anchors, lr=0.5)
    outer.step(_scalar(1.0))
    momentum_before = outer.momentum_buffers()[0].clone()
    theta_before = anchors[0].clone()
    outer.apply_momentum_free(_scalar(2.0), scale=0.25)
    assert torch.equal(outer.momentum_buffers()[0], momentum_before)
    assert anchors[0].item() == pytest.approx(theta_before.item() - 0.5 * 0.25 * 2.0)


def test_make_anchors_and_copy_to() -> None:
    params = [torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))]
    anchors = make_anchors(params)
    assert anchors[0].dtype == torch.float32 and not anchors[0].requires_grad
    anchors[0].add_(1.0)
    assert not torch.equal(params[0].detach().float(), anchors[0])
    outer = fedavg_outer_optimizer(anchors)
    outer.copy_to(params)
    assert torch.equal(params[0].detach(), anchors[0].to(torch.bfloat16))


def test_outer_validation() -> None:
    with pytest.raises(ValueError, match="float32"):
        OuterOptimizer([torch.zeros(2, dtype=torch.float16)], lr=0.7)
    with pytest.raises(ValueError, match="lr"):
        OuterOptimizer([torch.zeros(2)], lr=0.0)
    with pytest.raises(ValueError, match="momentum"):
        OuterOptimizer([torch.zeros(2)], lr=0.7, momentum=1.0)
    outer = nesterov_outer_optimizer([torch.zeros(2)])
    with pytest.raises(ValueError, match="shape"):
        outer.step([torch.zeros(3)])
    with pytest.raises(ValueError, match="expected 1 tensors"):
        outer.apply_momentum_free([torch.zeros(2), torch.zeros(2)])
    with pytest.raises(ValueError, match="unknown outer optimizer"):
        build_outer_optimizer("adam", [torch.zeros(2)])
    with pytest.raises(ValueError, match="momentum"):
        build_outer_optimizer("fedavg", [torch.zeros(2)], momentum=0.9)


def test_build_outer_optimizer_defaults() -> None:
    nesterov = build_outer_optimizer("nesterov", [torch.zeros(2)])
    assert (nesterov.lr, nesterov.momentum) == (0.7, 0.9)
    fedavg = build_outer_optimizer("fedavg", [torch.zeros(2)])
    assert (fedavg.lr, fedavg.momentum) == (1.0, 0.0)
    nesterov.lr = 0.35
    assert nesterov.lr == 0.35


# --- saved state ---------------------------------------------------------------------------


def test_state_roundtrip_through_safetensors(tmp_path) -> None:
    start = _random_params(0)
    deltas = [_random_params(seed) for seed in (1, 2, 3)]
    original = nesterov_outer_optimizer(make_anchors(start))
    original.step(deltas[0])
    original.step(deltas[1])
    state = original.state_tensors()
    assert sorted(state) == ["outer.momentum.0", "outer.momentum.1"]
    path = tmp_path / "outer.safetensors"
    save_file(state, str(path))

    restored = nesterov_outer_optimizer([a.clone() for a in original.anchors])
    restored.load_state_tensors(load_file(str(path)))
    original.step(deltas[2])
    restored.step(deltas[2])
    for a, b in zip(original.anchors, restored.anchors, strict=True):
        assert torch.equal(a, b)


def test_state_is_a_snapshot_and_empty_before_first_step() -> None:
    outer = nesterov_outer_optimizer(_scalar(0.0))
    assert outer.state_tensors() == {}
    outer.step(_scalar(1.0))
    snapshot = outer.state_tensors()["outer.momentum.0"].clone()
    outer.step(_scalar(1.0))
    assert torch.equal(snapshot, torch.tensor([1.0]))
    # Loading a dict without momentum keys resets the momentum.
    outer.load_state_tensors({"model.weight": torch.zeros(1)})
    assert outer.momentum_buffers() == [None]


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (
            {"outer.momentum.0": torch.zeros(3, dtype=torch.float16), "outer.momentum.1": torch.zeros(2)},
            "dtype",
        ),
        ({"outer.momentum.0": torch.zeros(4), "outer.momentum.1": torch.zeros(2)}, "shape"),
        ({"outer.momentum.0": torch.tensor([0.0, math.nan, 0.0]), "outer.momentum.1": torch.zeros(2)}, "NaN"),
        ({"outer.momentum.0": torch.zeros(3)}, "lacks momentum"),
        ({"outer.momentum.0": torch.zeros(3), "outer.momentum.7": torch.zeros(2)}, "unexpected"),
        ({"outer.momentum.x": torch.zeros(3)}, "unexpected"),
    ],
)
def test_load_state_rejects_bad_entries_and_keeps_state(state: dict[str, torch.Tensor], match: str) -> None:
    outer = nesterov_outer_optimizer([torch.zeros(3), torch.zeros(2)])
    outer.step([torch.ones(3), torch.ones(2)])
    before = outer.state_tensors()
    with pytest.raises(ValueError, match=match):
        outer.load_state_tensors(state)
    after = outer.state_tensors()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_load_momentum_into_fedavg_is_an_error() -> None:
    outer = fedavg_outer_optimizer([torch.zeros(2)])
    with pytest.raises(ValueError, match="without momentum"):
        outer.load_state_tensors({"outer.momentum.0": torch.zeros(2)})


def test_loading_momentum_reuses_buffers_or_adopts_handed_over_tensors() -> None:
    anchors = [torch.zeros(3), torch.zeros(2)]
    outer = OuterOptimizer(anchors, lr=0.5, momentum=0.9)
    given = {"outer.momentum.0": torch.ones(3), "outer.momentum.1": torch.ones(2)}
    outer.load_state_tensors(given, validate_only=True)
    assert outer.momentum_buffers() == [None, None]  # validation changes nothing
    outer.load_state_tensors(given, take=True)
    assert outer.momentum_buffers()[0].data_ptr() == given["outer.momentum.0"].data_ptr()  # no copy
    kept = outer.momentum_buffers()[1]
    outer.load_state_tensors({"outer.momentum.0": torch.full((3,), 2.0), "outer.momentum.1": torch.full((2,), 2.0)})
    assert outer.momentum_buffers()[1] is kept and kept.tolist() == [2.0, 2.0]  # overwritten in place
