"""Bounds on what an honest reducer can send back (core.bounds), the reducer's clipping to announced norms
(swarm.reducer) and the member's check of reducers' outputs (swarm.verify), without a network."""

from __future__ import annotations

import asyncio
import itertools
import math

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization
from hypothesis import given
from hypothesis import strategies as st

from p2p_diloco.core.bounds import (
    CODEC_NORM_GAIN,
    clip_claims,
    clip_to_budget,
    norm_tolerance,
    output_bound,
    rescale_bound,
)
from p2p_diloco.core.codecs import get_codec
from p2p_diloco.core.robust import AGGREGATIONS, rescale_factor
from p2p_diloco.swarm.hivemind_codecs import CodecCompression, wire_norm_tolerance
from p2p_diloco.swarm.reducer import RobustPartReducer
from p2p_diloco.swarm.verify import AverageCheck


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.double()))


@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 7.0]), min_size=1, max_size=6))
def test_rescale_bound_is_the_largest_rescale_of_any_accepted_set(weights: list[float]) -> None:
    n = len(weights)
    seen = [
        rescale_factor(weights, list(subset))
        for size in range(1, n + 1)
        for subset in itertools.combinations(range(n), size)
    ]
    largest = max((s for s in seen if s is not None), default=1.0)
    assert rescale_bound(weights) == pytest.approx(max(largest, 1.0))


def test_clip_claims_clips_only_claims_far_above_the_lower_median_per_weight() -> None:
    claims, weights = [1.0, 2.2, 0.9, 500.0, 3.0], [1.0, 2.0, 1.0, 1.0, 0.0]
    clipped = clip_claims(claims, weights, 20.0)
    # per weight: 1.0, 1.1, 0.9, 500 -> lower median 1.0, cap 20 per unit of weight; no weight, no claim
    assert clipped == [1.0, 2.2, 0.9, 20.0, 0.0]
    assert clip_claims(claims, weights, 0.0) == [1.0, 2.2, 0.9, 500.0, 0.0]  # screen off
    assert clip_claims([5.0], [1.0], 20.0) == [5.0]


def test_clip_to_budget_spends_one_budget_across_parts() -> None:
    a, b = torch.full((4,), 1.5), torch.full((4,), 2.0)  # norms 3 and 4
    part, spent, clipped = clip_to_budget(a, 0.0, 5.0)
    assert part is a and spent == pytest.approx(9.0) and not clipped
    part, spent, clipped = clip_to_budget(b, spent, 5.0)
    assert not clipped and spent == pytest.approx(25.0)
    part, spent, clipped = clip_to_budget(b, spent, 5.0)  # nothing left
    assert clipped and _norm(part) == 0.0
    part, spent, clipped = clip_to_budget(b, 16.0, 5.0)  # room for a norm of 3
    assert clipped and _norm(part) == pytest.approx(3.0) and spent == pytest.approx(25.0)
    part, _, clipped = clip_to_budget(10 * b, 0.0, 5.0)
    assert clipped and _norm(part) == pytest.approx(5.0)


@pytest.mark.parametrize("codec", ["fp16", "int8", "4bit", "2bit"])
def test_codec_norm_gain_covers_real_round_trips(codec: str) -> None:
    gen = torch.Generator().manual_seed(0)
    # Gaussian, heavy-tailed, and values placed just above E3M0's rounding midpoints (its worst case)
    cases = [
        torch.randn(4096, generator=gen),
        torch.distributions.StudentT(3.0).sample((4096,)),
        torch.cat([torch.tensor([1.0]), torch.full((127,), 0.7501)]).repeat(8),
        torch.cat([torch.tensor([1.0]), torch.full((127,), 0.0040)]).repeat(8),
    ]
    for values in cases:
        gain = _norm(get_codec(codec).roundtrip(values)) / _norm(values)
        assert gain <= CODEC_NORM_GAIN[codec], (codec, gain)
    with pytest.raises(ValueError, match="unknown codec"):
        norm_tolerance("zip", False)
    assert norm_tolerance("4bit", True) > norm_tolerance("4bit", False) > norm_tolerance("none", False) > 1.0


def test_wire_compressions_map_to_their_tolerance_and_unknown_ones_turn_the_bounds_off() -> None:
    assert wire_norm_tolerance(NoCompression()) == norm_tolerance("none", False)
    assert wire_norm_tolerance(Float16Compression()) == norm_tolerance("fp16", False)
    codec = CodecCompression("4bit", error_feedback=True)
    assert wire_norm_tolerance(codec) == norm_tolerance("4bit", True)
    assert wire_norm_tolerance(Uniform8BitQuantization()) is None


@pytest.mark.parametrize("method", AGGREGATIONS)
@pytest.mark.parametrize("seed", range(6))
def test_honest_reducer_output_never_exceeds_the_bound(method: str, seed: int) -> None:
    """Reducers clip senders to their announced norms, so whatever the senders send (here: some understate
    their norm by 10x, one sends 1000x), an honest reducer's output stays within ``output_bound``."""
    gen = torch.Generator().manual_seed(seed)
    n = 3 + seed % 3
    weights = [float(w) for w in torch.randint(1, 5, (n,), generator=gen)]
    if seed % 2:
        weights[0] = 0.0  # a member with only late work: zeros in the fresh region
    total = math.fsum(weights)
    scales = [n * w / total for w in weights]
    raw = [torch.randn(3, 40, generator=gen) * (1 + 3 * k) for k in range(n)]
    claims = [_norm(x) if w > 0 else 0.0 for x, w in zip(raw, weights, strict=True)]
    claims[-1] /= 10.0  # understates
    raw[1] = raw[1] * 1000.0  # sends far more than it announced
    tolerance = norm_tolerance("none", False)
    limits = [(tolerance * s * c, 0.0) for s, c in zip(scales, clip_claims(claims, weights, 20.0), strict=True)]
    bound = output_bound([limit[0] for limit in limits], weights, tolerance)

    async def reduce_span() -> list[torch.Tensor]:
        reducer = RobustPartReducer(
            [torch.Size([40])] * 3, torch.float32, [f"p{k}" for k in range(n)], weights,
            method=method, norm_factor=20.0, limits=limits, regions=[0, 0, 0],
        )

        async def send(k: int) -> list[torch.Tensor]:
            return [await reducer.accumulate_part(k, i, (scales[k] * raw[k][i]).float()) for i in range(3)]

        outputs = await asyncio.gather(*(send(k) for k in range(n)))
        assert "p1" in reducer.clipped
        return outputs[0]

    out = asyncio.run(reduce_span())
    assert math.sqrt(sum(_norm(part) ** 2 for part in out)) <= bound


def _container(fractions: list[float]) -> TensorPartContainer:
    # fresh tensor of 600 values and its stale twin; 64-value parts (256 bytes of fp32)
    tensors = [torch.ones(600), torch.ones(600)]
    return TensorPartContainer(tensors, fractions, part_size_bytes=256, return_deltas=False)


def test_member_check_rejects_a_reducer_past_the_bound_and_keeps_our_own_values() -> None:
    container = _container([1.0, 1.0, 1.0])
    ids = ["me", "good", "evil"]
    check = AverageCheck(container, ids, 0, bounds=(16.0, 16.0), fresh_tensors=1)
    parts = {r: [p for p, _ in container._input_parts_by_peer[r]] for r in range(3)}
    # "good" reduces values 400-800 of the 1200: the end of the fresh tensor and the start of the stale one
    assert check.regions[1] == [0, 0, 0, 0, 1, 1, 1]
    for index, part in enumerate(parts[1]):
        assert check.check(1, index, part.clone()) is None  # about 200 ones per region: norm 14 < 16
    assert check.check(0, 0, parts[0][0] * 1e9) is None  # our own reducer is not checked
    assert "NaN" in check.check(2, 0, torch.full_like(parts[2][0], math.nan))
    assert "NaN" in check.check(2, 1, parts[2][1])  # a reducer that failed once is refused for the round
    assert set(check.failed) == {"evil"}
    assert "shape" in AverageCheck(container, ids, 0, (16.0, 16.0), 1).check(2, 0, torch.ones(3))
    big = AverageCheck(container, ids, 0, (16.0, 16.0), 1).check(2, 0, parts[2][0] * 100.0)
    assert big is not None and "above" in big

    # installed: refused parts become zeros and count as not averaged
    container = _container([1.0, 1.0, 1.0])
    AverageCheck(container, ids, 0, bounds=(16.0, 16.0), fresh_tensors=1).install()
    container.register_processed_part(1, 0, parts[1][0] + 1.0)
    container.register_processed_part(2, 0, parts[2][0] * 1e3)
    assert container.failed_size == parts[2][0].numel()
    assert torch.equal(container._output_parts_by_peer[1][0], parts[1][0] + 1.0)
    assert torch.equal(container._output_parts_by_peer[2][0], torch.zeros_like(parts[2][0]))
    tight = AverageCheck(container, ids, 0, bounds=(16.0, 1.0), fresh_tensors=1)
    assert all(tight.check(1, i, parts[1][i].clone()) is None for i in range(4))
    assert "stale" in tight.check(1, 4, parts[1][4].clone())
