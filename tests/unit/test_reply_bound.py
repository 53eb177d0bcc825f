"""The member's bound on a sparse reducer's reply applies the senders' error-feedback allowance once.

Issue 51, finding 4: ``output_bound`` multiplied the senders' limits, which already hold the codec's norm
tolerance (17.6 under top-k at 64/4096 with error feedback), by that tolerance again, so a hostile reducer could
send 620.8x the claim under top-k (4 members) against 2.0x under fp32. These tests run the project's own
tolerance (``averager.codec_tolerance``), limits (``GroupPlan.sender_limits``), bound, reducer
(``RobustPartReducer``), reply codec and member check (``AverageCheck``).
"""

from __future__ import annotations

import asyncio
import math
import pickle

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionInfo, NoCompression

from p2p_diloco.core.bounds import NormTolerance, output_bound, plain_tolerance, reply_tolerance
from p2p_diloco.swarm.averager import codec_tolerance
from p2p_diloco.swarm.group import GroupPlan, MemberInfo
from p2p_diloco.swarm.hivemind_codecs import CodecCompression
from p2p_diloco.swarm.reducer import RobustPartReducer
from p2p_diloco.swarm.verify import AverageCheck

N_MEMBERS = 4
TODAYS_MULTIPLE = 620.8
"""What finding 4 measured: the reply norm, in units of one member's (pre-scaled) claim, that passed the
check under top-k with 4 equal members."""


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.double()))


def _plan(weights: list[float], norms: list[float], stale: float = 0.0) -> GroupPlan:
    infos = [
        MemberInfo.for_round("run", "f" * 16, 3, w, stale, 1 if stale else 0, w > 0, stale > 0,
                             norm=c if w > 0 else 0.0, stale_norm=c if stale else 0.0)
        for w, c in zip(weights, norms, strict=True)
    ]
    return GroupPlan(peer_ids=tuple(f"p{i}" for i in range(len(weights))), members=tuple(infos),
                     bandwidths=(None,) * len(weights), modes=(), refused=(), with_stale=stale > 0,
                     fresh_weight_total=math.fsum(weights), skip_reason=None)


def _bound(compression: object, weights: list[float], norms: list[float]) -> float:
    tolerance = codec_tolerance(compression)  # what the averager hands its round process
    assert tolerance is not None
    limits = _plan(weights, norms).sender_limits(20.0, tolerance)
    return output_bound([limit[0] for limit in limits], weights, tolerance)


def test_the_tolerances_of_a_sparse_codec_with_error_feedback() -> None:
    tolerance = codec_tolerance(CodecCompression("topk", error_feedback=True))
    assert isinstance(tolerance, NormTolerance)
    assert float(tolerance) == pytest.approx(1.001 * 1.1 * 2.0 * 8.0)  # senders: 2 / sqrt(64 / 4096)
    assert plain_tolerance(tolerance) == reply_tolerance(tolerance) == pytest.approx(1.001 * 1.1)
    assert pickle.loads(pickle.dumps(tolerance)).reply == tolerance.reply  # survives a spawned process
    assert codec_tolerance(NoCompression()) == pytest.approx(1.001)  # dense: one factor for all
    with pytest.raises(ValueError):
        NormTolerance(1.0, 2.0, 1.0)
    # the late work goes without error feedback: its limits use the plain factor
    plan = _plan([1.0] * 4, [1.0] * 4, stale=1.0)
    fresh_scale, stale_scale = plan.local_scales("p0")
    fresh, late = plan.sender_limits(20.0, tolerance)[0]
    assert fresh == pytest.approx(float(tolerance) * fresh_scale)
    assert late == pytest.approx(tolerance.plain * stale_scale)


def test_a_hostile_sparse_reducer_is_refused_far_below_the_multiple_found_today() -> None:
    """The finding's group: 4 members of equal weight and claim. Today's multiple passed the check; now a reply
    is refused above ``1.1 * 17.6 * sqrt(4)`` claims, while fp32's bound stays at ``1.001**2 * sqrt(4)``."""
    weights, norms = [1.0] * N_MEMBERS, [1.0] * N_MEMBERS
    fp32 = _bound(NoCompression(), weights, norms)
    topk = _bound(CodecCompression("topk", error_feedback=True), weights, norms)
    assert fp32 == pytest.approx(2.004, rel=1e-3)
    assert topk == pytest.approx(2.0 * 1.1011 * 17.6176, rel=1e-3)  # 38.8 claims: the allowance once
    assert topk / fp32 < 20.0  # was 310 (the allowance squared)

    # the member's own check, on a reply that owns every value of one reducer's span
    tensor = torch.zeros(4096)
    container = TensorPartContainer([tensor], [0.0, 1.0, 0.0, 0.0], part_size_bytes=4096, return_deltas=False)
    parts = [part for part, _ in container._input_parts_by_peer[1]]
    check = AverageCheck(container, [f"p{i}" for i in range(N_MEMBERS)], 0, (topk, topk), fresh_tensors=1)
    hostile = 0.95 * TODAYS_MULTIPLE  # inside today's bound
    per_part = hostile / math.sqrt(len(parts))
    verdicts = [check.check(1, i, torch.full_like(p, per_part / math.sqrt(p.numel()))) for i, p in enumerate(parts)]
    assert verdicts[0] is not None and "above" in verdicts[0]
    assert "p1" in check.failed


async def _reduce(senders: list[CodecCompression], grads: list[torch.Tensor], plan: GroupPlan,
                  limits: list[tuple[float, float]], infos: list[CompressionInfo],
                  shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Reducer ``p1``'s averaged parts: every sender's scaled pseudo-gradient through its own codec (top-k with
    error feedback, decoded as the reducer decodes it), then the project's reducer."""
    ids = list(plan.peer_ids)
    reducer = RobustPartReducer([torch.Size(shape) for shape in shapes], torch.float32, ids, plan.fresh_weights(),
                                method="mean", norm_factor=20.0, limits=limits, regions=[0] * len(shapes))

    async def send(s: int) -> list[torch.Tensor]:
        scaled = grads[s] * plan.local_scales(ids[s])[0]
        pieces = torch.split(scaled, [math.prod(shape) for shape in shapes])
        return [
            await reducer.accumulate_part(s, i, senders[s].extract(senders[s].compress(piece, info)))
            for i, (piece, info) in enumerate(zip(pieces, infos, strict=True))
        ]

    return (await asyncio.gather(*(send(s) for s in range(len(ids)))))[0]


def _honest_rounds(seed: int, size: int, chunk: int, k: int, persistent: bool, rounds: int,
                   codec: str = "topk") -> float:
    """Rounds of 4 honest top-k senders with error feedback (and credit of what replies drop) through the
    project's reducer, reply codec and member check; the largest reply norm seen over the bound."""
    gen = torch.Generator().manual_seed(seed)
    weights = [float(w) for w in torch.randint(1, 4, (N_MEMBERS,), generator=gen)]
    senders = [CodecCompression(codec, error_feedback=True, chunk_size=chunk, k=k) for _ in range(N_MEMBERS)]
    tolerance = codec_tolerance(senders[0])
    ids = [f"p{i}" for i in range(N_MEMBERS)]
    # every sender pushes nearly the same direction (aligned: the largest aggregate), of even magnitudes (the
    # error-feedback steady state sends the most mass then)
    base = torch.sign(torch.randn(size, generator=gen)) * (1.0 + 0.2 * torch.rand(size, generator=gen))
    worst = 0.0
    for _ in range(rounds):
        if not persistent:
            base = torch.sign(torch.randn(size, generator=gen)) * (1.0 + 0.2 * torch.rand(size, generator=gen))
        grads = [base * (1.0 + k_) + 0.1 * torch.randn(size, generator=gen) for k_ in range(N_MEMBERS)]
        plan = _plan(weights, [_norm(g) for g in grads])
        limits = plan.sender_limits(20.0, tolerance)
        bound = output_bound([limit[0] for limit in limits], plan.fresh_weights(), tolerance)
        container = TensorPartContainer([torch.zeros(size)], [0.0, 1.0, 0.0, 0.0], part_size_bytes=4 * chunk * 2,
                                        return_deltas=False)
        shapes = [part.shape for part, _ in container._input_parts_by_peer[1]]
        infos = [info for _, info in container._input_parts_by_peer[1]]
        check = AverageCheck(container, ids, 0, (bound, bound), fresh_tensors=1)
        outputs = asyncio.run(_reduce(senders, grads, plan, limits, infos, [tuple(sh) for sh in shapes]))
        # (a sender whose residual outgrew the allowance is clipped at the reducer: by design, core.bounds)
        replies = [senders[1].extract(senders[1].compress_average(out, info))
                   for out, info in zip(outputs, infos, strict=True)]
        for i, reply in enumerate(replies):
            assert check.check(1, i, reply) is None, check.failed
        for sender in senders:
            for i, reply in enumerate(replies):
                sender.credit_reply(0, i, reply)
        worst = max(worst, math.sqrt(sum(_norm(r) ** 2 for r in replies)) / bound)
    return worst


@pytest.mark.parametrize(("seed", "size", "chunk", "k", "persistent", "rounds"), [
    (0, 1024, 128, 4, True, 48),  # past the error-feedback steady state (about chunk / k rounds)
    (1, 1536, 256, 16, True, 24),
    (2, 1200, 256, 8, False, 16),
])
def test_honest_sparse_replies_with_error_feedback_are_never_refused(
    seed: int, size: int, chunk: int, k: int, persistent: bool, rounds: int
) -> None:
    worst = _honest_rounds(seed, size, chunk, k, persistent, rounds=rounds)
    assert 0.0 < worst <= 1.0


@pytest.mark.parametrize("codec", ["2bit", "4bit", "int8", "topk-sign"])
def test_honest_replies_of_other_codecs_with_error_feedback_are_never_refused(codec: str) -> None:
    """The reply factor is each codec's plain gain: dense codecs' replies are their aggregate's round trip."""
    assert 0.0 < _honest_rounds(7, 1024, 128, 8, True, rounds=6, codec=codec) <= 1.0
