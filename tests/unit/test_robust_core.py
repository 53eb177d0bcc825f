"""Robust aggregation math (core.robust) and the validating reducer (swarm.reducer), without a network."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from p2p_diloco.core.robust import aggregate, centered_clip, norm_outliers, trimmed_mean
from p2p_diloco.swarm.group import MemberInfo, implausible_weights
from p2p_diloco.swarm.reducer import RobustPartReducer


def _honest(n: int, dim: int = 64, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(dim, generator=gen)
    return [base + 0.1 * torch.randn(dim, generator=gen) for _ in range(n)]


def test_every_method_is_the_mean_on_identical_inputs() -> None:
    vectors = [torch.full((5,), 2.5)] * 4
    for method in ("mean", "trimmed-mean", "centered-clip"):
        torch.testing.assert_close(aggregate(vectors, method), torch.full((5,), 2.5))


def test_robust_methods_bound_one_attacker_among_five_and_mean_does_not() -> None:
    honest = _honest(4)
    clean = torch.stack(honest).mean(0)
    attacker = -20.0 * honest[0]
    errors = {
        method: float(torch.linalg.vector_norm(aggregate([*honest, attacker], method) - clean))
        for method in ("mean", "trimmed-mean", "centered-clip")
    }
    scale = float(torch.linalg.vector_norm(clean))
    assert errors["mean"] > 2.0 * scale  # the attack dominates the plain mean
    assert errors["centered-clip"] < 0.2 * scale, errors
    assert errors["trimmed-mean"] < 0.2 * scale, errors


def test_centered_clip_equals_the_mean_when_nobody_is_far() -> None:
    vectors = _honest(5)
    result = centered_clip(vectors, tau=1e6)
    torch.testing.assert_close(result, torch.stack(vectors).mean(0), rtol=1e-6, atol=1e-6)


def test_trimmed_mean_rejects_impossible_trims() -> None:
    with pytest.raises(ValueError, match="cannot trim"):
        trimmed_mean(_honest(2), trim=1)
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(_honest(2), "median-of-means")


def test_norm_outliers_flag_only_the_huge_vector_and_need_three() -> None:
    vectors = _honest(4) + [1000.0 * _honest(1, seed=3)[0]]
    assert norm_outliers(vectors, 20.0) == [4]
    assert norm_outliers(vectors[3:], 20.0) == []  # two vectors: no way to tell who is off
    assert norm_outliers(vectors, 0.0) == []  # disabled


def test_implausible_weights_are_found_by_cap_and_by_ratio() -> None:
    def info(weight: float) -> MemberInfo:
        return MemberInfo.for_round("run", "abcdef0123456789", 0, weight, 0.0, 0, True, False, norm=weight, stale_norm=0.0)

    found = implausible_weights([info(100.0), info(120.0), info(5e9), info(1e6)], 1e8, 1000.0)
    assert set(found) == {2, 3}
    assert "max_round_weight" in found[2] and "median" in found[3]
    assert implausible_weights([info(100.0), info(300.0)], 1e8, 1000.0) == {}


def _reduce(parts: list[torch.Tensor], weights: list[float], **options: object) -> tuple[torch.Tensor, dict]:
    async def run() -> tuple[torch.Tensor, dict]:
        reducer = RobustPartReducer(
            [parts[0].shape if parts[0].dim() else torch.Size([4])],
            torch.float32,
            [f"peer{i}" for i in range(len(parts))],
            weights,
            **{"method": "mean", "norm_factor": 20.0, "own": 0, **options},  # type: ignore[arg-type]
        )
        results = await asyncio.gather(
            *(reducer.accumulate_part(i, 0, part) for i, part in enumerate(parts))
        )
        assert all(torch.equal(r, results[0]) for r in results)  # every sender gets the same values
        return results[0], reducer.rejected()

    return asyncio.run(run())


def test_reducer_rejects_nan_wrong_shape_and_dtype_and_renormalises_the_rest() -> None:
    # pre-scaled inputs of weights (1, 3, 2, 2, 2): member k sends n * w_k / W * x_k with n = 5, W = 10
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    weights = [1.0, 3.0, 2.0, 2.0, 2.0]
    parts = [torch.full((4,), 5 * w / 10 * v) for v, w in zip(values, weights, strict=True)]
    parts[2] = torch.full((4,), math.nan)
    parts[3] = torch.zeros(5)
    parts[4] = parts[4].double()
    result, rejected = _reduce(parts, weights)
    assert set(rejected) == {"peer2", "peer3", "peer4"}
    assert "NaN" in rejected["peer2"] and "shape" in rejected["peer3"] and "dtype" in rejected["peer4"]
    # the weighted mean of the accepted members only: (1 * 1 + 3 * 2) / (1 + 3)
    torch.testing.assert_close(result, torch.full((4,), 7.0 / 4.0))


def test_reducer_drops_banned_senders_and_norm_outliers(caplog: pytest.LogCaptureFixture) -> None:
    parts = [torch.full((64,), 1.0), torch.full((64,), 1.2), torch.full((64,), 0.8), torch.full((64,), 1e6)]
    with caplog.at_level("WARNING", logger="p2p_diloco.swarm.reducer"):
        result, rejected = _reduce(parts, [1.0] * 4, banned=frozenset({"peer1"}))
    assert rejected["peer1"] == "banned earlier in this run"
    assert "norm" in rejected["peer3"]
    torch.testing.assert_close(result, torch.full((64,), 0.9))
    # the screen's statistics are logged with the rejection, so a ban can be checked afterwards
    screen = [r.getMessage() for r in caplog.records if "norm screen" in r.getMessage()]
    assert len(screen) == 1 and "(64 values, fresh region): rejected ['peer3']" in screen[0] and "'peer3': '8e+06'" in screen[0], screen


def test_reducer_with_centered_clip_outvotes_a_sign_flip_attack() -> None:
    honest = [torch.full((4,), v) for v in (1.0, 1.1, 0.9, 1.05)]
    parts = [*honest, torch.full((4,), -20.0)]
    clipped, rejected = _reduce(parts, [1.0] * 5, method="centered-clip", norm_factor=0.0)
    plain, _ = _reduce(parts, [1.0] * 5, method="mean", norm_factor=0.0)
    assert rejected == {}
    assert float((clipped - 1.0).abs().max()) < 0.3
    assert float((plain - 1.0).abs().max()) > 4.0


def test_norm_screen_normalises_by_claimed_weight_and_ignores_empty_parts() -> None:
    from p2p_diloco.core.robust import norm_outliers

    base = torch.ones(16)
    # Pre-scaled parts grow with the square of the weight: a peer with 5x the work is not an outlier...
    honest = [base * 1.0, base * 1.1, base * 25.0]
    assert norm_outliers(honest, 20.0) == [2]  # (unweighted, it would be banned)
    assert norm_outliers(honest, 20.0, weights=[1.0, 1.0, 5.0]) == []
    # ...but a 100x scaled vector claiming ordinary weight is.
    assert norm_outliers([base, base, base * 100.0], 20.0, weights=[1.0, 1.0, 1.0]) == [2]
    # Members without late work send zeros in the late-work buffer: they are neither flagged nor counted.
    assert norm_outliers([torch.zeros(16), torch.zeros(16), base * 3.0], 20.0, weights=[1.0, 1.0, 1.0]) == []
    # Data claimed under zero weight is refused.
    assert norm_outliers([base, base, base], 20.0, weights=[1.0, 1.0, 0.0]) == [2]


def test_parts_are_split_and_assigned_as_hivemind_does() -> None:
    """The simulator's all-reduce (core.robust.GroupReduction) cuts and distributes parts like the swarm's."""
    from hivemind.averaging.partition import TensorPartContainer
    from hivemind.compression import Float16Compression, NoCompression

    from p2p_diloco.core.codecs import get_codec
    from p2p_diloco.core.robust import assign_parts, part_size_values, split_parts
    from p2p_diloco.swarm.hivemind_codecs import CodecCompression

    tensors = _honest(1, dim=2100)[0].reshape(300, 7), torch.ones(5), torch.ones(1000), torch.ones(64, 64)
    for compression, codec in ((NoCompression(), "none"), (Float16Compression(), "fp16"),
                               (CodecCompression("4bit"), "4bit")):
        for fractions in ([1.0] * 5, [0.5, 2.0, 1.0, 0.1]):
            container = TensorPartContainer(tensors, fractions, compression=compression, part_size_bytes=1024)
            parts = split_parts(tensors, part_size_values(1024, get_codec(codec).bits_per_value()))
            owners = assign_parts([p.numel() for p in parts], fractions)
            for member in range(len(fractions)):
                theirs = [p for p, _ in container._input_parts_by_peer[member]]
                ours = [p for p, owner in zip(parts, owners, strict=True) if owner == member]
                assert len(ours) == len(theirs) and all(map(torch.equal, ours, theirs)), (codec, fractions)


def test_group_reduction_is_the_weighted_mean_and_bans_a_caught_attacker_for_good() -> None:
    from p2p_diloco.core.robust import GroupReduction, assign_parts, split_parts

    def senders(seed: int, attack: float) -> list[list[torch.Tensor]]:
        out = [[v.reshape(8, 80), 2 * v[:100]] for v in _honest(5, dim=640, seed=seed)]  # parts of >= 64 values
        out[4] = [attack * t for t in out[4]]
        return out

    def weighted_mean(vectors: list[list[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
        return [sum(w * v[i] for w, v in zip(weights, vectors, strict=True)) / sum(weights) for i in range(2)]

    weights = [1.0, 3.0, 2.0, 2.0, 2.0]
    reduction = GroupReduction(5, method="mean", norm_factor=20.0, values_per_part=64)
    clean = senders(0, 1.0)
    for got, exact in zip(reduction.reduce(clean, weights), weighted_mean(clean, weights), strict=True):
        torch.testing.assert_close(got, exact)
    assert reduction.new_bans == [] and reduction.faults == []
    # Sender 4 scales its data by 1000: every other reducer catches it in its first part and bans it.
    reduction.reduce(senders(1, 1000.0), weights)
    bans = sorted((owner, sender) for owner, sender, _ in reduction.new_bans)
    assert bans == [(0, 4), (1, 4), (2, 4), (3, 4)]
    # Later it attacks below the screen (5x): the reducers that banned it still drop all its parts, its own
    # reducer (no averager bans itself) takes them.
    later = senders(2, 5.0)
    got = split_parts(reduction.reduce(later, weights), 64)
    honest = split_parts(weighted_mean(later[:4], weights[:4]), 64)
    owners = assign_parts([p.numel() for p in got], [1.0] * 5)
    assert reduction.new_bans == [] and 4 in owners
    for owner, ours, exact in zip(owners, got, honest, strict=True):
        if owner == 4:
            assert float((ours - exact).abs().max()) > 0.1
        else:
            torch.testing.assert_close(ours, exact)


def test_a_sender_judged_but_not_banned_is_left_out_of_the_reducers_later_parts() -> None:
    # A reducer without a part of its own (own=None) cannot ban, but a part of 64 values or more says enough to
    # leave the sender out of the rest of the round: past its first part, an attacker has spent the norm it
    # announced and its later parts arrive scaled down to about zero, which counted would dilute the mean.
    shape = torch.Size([64])

    async def run() -> tuple[list[torch.Tensor], dict, set[int]]:
        reducer = RobustPartReducer([shape, shape], torch.float32, ["a", "b", "c", "x"], [1.0] * 4,
                                    method="mean", norm_factor=20.0, own=None)
        sent = {0: [1.0, 1.0], 1: [2.0, 2.0], 2: [3.0, 3.0], 3: [1e6, 1e-9]}  # x: huge, then spent

        async def sender(i: int) -> list[torch.Tensor]:
            return [await reducer.accumulate_part(i, part, torch.full(shape, value))
                    for part, value in enumerate(sent[i])]

        results = await asyncio.gather(*(sender(i) for i in range(4)))
        assert all(all(map(torch.equal, r, results[0])) for r in results)
        return results[0], reducer.rejected(), reducer.dropped

    (first, second), rejected, dropped = asyncio.run(run())
    torch.testing.assert_close(first, torch.full(shape, 2.0))
    torch.testing.assert_close(second, torch.full(shape, 2.0))  # not (1 + 2 + 3 + 0) / 4
    assert rejected == {} and dropped == {3}  # left out, banned by nobody

    # The simulator reduces alike: a reducer whose own part is zero (nothing to measure by) leaves the x1000
    # sender out of all its parts, clipped ones included, and bans nobody.
    from p2p_diloco.core.robust import GroupReduction, assign_parts, split_parts

    data = [[v.reshape(8, 80)] for v in _honest(5, dim=640, seed=3)]
    data[0] = [torch.zeros(8, 80)]
    data[4] = [1000.0 * data[4][0]]
    reduction = GroupReduction(5, method="mean", norm_factor=20.0, values_per_part=64)
    got = split_parts(reduction.reduce(data, [1.0] * 5), 64)
    honest = split_parts([sum(d[0] for d in data[:4]) / 4], 64)
    owners = assign_parts([p.numel() for p in got], [1.0] * 5)
    assert owners.count(0) >= 2
    for owner, ours, exact in zip(owners, got, honest, strict=True):
        if owner in (1, 2, 3):  # their own parts anchor the screen: they ban sender 4
            torch.testing.assert_close(ours, exact)
        if owner == 0:  # no anchor: no ban, but out of every part of reducer 0
            torch.testing.assert_close(ours, exact)
    assert sorted((o, s) for o, s, _ in reduction.new_bans) == [(1, 4), (2, 4), (3, 4)]


def test_simulator_defaults_are_the_swarms() -> None:
    from p2p_diloco.simulate import SimConfig
    from p2p_diloco.swarm import SwarmConfig

    fields = SwarmConfig.__dataclass_fields__
    assert SimConfig.part_size_bytes == fields["part_size_bytes"].default
    assert SimConfig.norm_outlier_factor == fields["norm_outlier_factor"].default
    assert SimConfig.aggregation == fields["aggregation"].default


@pytest.mark.parametrize("robust", [False, True], ids=["hivemind", "robust"])
def test_a_sender_cancelled_mid_part_does_not_stall_the_others(robust: bool) -> None:
    # A sender's handler task is cancelled when its stream dies while it waits for the part it sent. Unshielded,
    # that cancelled the part's shared future and the reducer never finished the part for anyone.
    from hivemind.averaging.partition import TensorPartReducer

    from p2p_diloco.swarm.runner import accumulate

    async def run() -> list[torch.Tensor]:
        shapes = [torch.Size([4]), torch.Size([4])]
        if robust:
            reducer = RobustPartReducer(shapes, torch.float32, ["a", "b", "c"], [1.0, 1.0, 1.0],
                                        method="mean", norm_factor=0.0)
        else:
            reducer = TensorPartReducer(shapes, 3)
        dying = asyncio.create_task(accumulate(reducer, 0, 0, torch.full((4,), 3.0), 1.0))
        waiting = asyncio.create_task(accumulate(reducer, 1, 0, torch.full((4,), 6.0), 1.0))
        for _ in range(10):  # a few turns of the loop, until both parts are in and their senders wait there
            if reducer.current_part_accumulated_from == 2:
                break
            await asyncio.sleep(0)
        assert reducer.current_part_accumulated_from == 2 and reducer.current_part_index == 0
        dying.cancel()
        last = await asyncio.wait_for(accumulate(reducer, 2, 0, torch.full((4,), 9.0), 1.0), 5)
        return [last, await asyncio.wait_for(waiting, 5)]

    for part in asyncio.run(run()):
        assert torch.allclose(part, torch.full((4,), 6.0))  # the dying sender's part had arrived: it counts


def test_a_part_our_check_cannot_judge_is_a_fault_not_a_stall_or_a_ban() -> None:
    async def run() -> tuple[list[torch.Tensor], RobustPartReducer]:
        reducer = RobustPartReducer([torch.Size([4])], torch.float32, ["a", "b"], [1.0, 1.0],
                                    method="mean", norm_factor=0.0)

        def broken(sender: int, part_index: int, part: torch.Tensor) -> torch.Tensor:
            if sender == 1:
                raise RuntimeError("bug in our check")
            return part

        reducer._within_limit = broken  # type: ignore[method-assign]
        parts = [torch.full((4,), 2.0), torch.full((4,), 4.0)]
        done = await asyncio.wait_for(
            asyncio.gather(*(reducer.accumulate_part(i, 0, part) for i, part in enumerate(parts))), 5
        )
        return done, reducer

    results, reducer = asyncio.run(run())
    assert all(torch.equal(r, results[0]) for r in results)  # both senders got the part back
    assert reducer.rejected() == {}  # the sender did nothing wrong: nobody is banned
    assert len(reducer.reduce_faults) == 1 and "bug in our check" in reducer.reduce_faults[0]


def test_a_part_of_a_single_value_never_gets_an_honest_peer_banned() -> None:
    # One bias value (or a split's remainder) per sender: honest coordinates differ by orders of magnitude.
    honest = [torch.tensor([1e-4]), torch.tensor([2e-4]), torch.tensor([0.5])]
    value, rejected = _reduce(honest, [1.0, 1.0, 1.0])
    assert rejected == {}  # before: the third, 2500x the median, was banned for the run
    # its value is still left out of this one part, as a sender's whole norm budget put into one
    # coordinate would be
    assert float(value) == pytest.approx(1.5e-4, rel=1e-5)  # the mean of the two others
    # a 64-value part is large enough to judge a sender by: a scaled one is banned as before
    parts = [torch.full((64,), 1.0), torch.full((64,), 1.1), torch.full((64,), 100.0)]
    _, rejected = _reduce(parts, [1.0, 1.0, 1.0])
    assert list(rejected) == ["peer2"]


def test_a_fold_round_screens_each_region_by_its_own_weight() -> None:
    """Members that fold late work are judged in each region by that region's weight, not fresh plus late.

    Four members of fresh weight 1; peers 0 and 1 (peer 0 reduces) also fold late work of weight 2 (two
    missed rounds). Every fresh part is an honest one of the same size per weight, except peer 3's, a joiner's
    6x (a fresh inner optimizer moves every coordinate). Divided by fresh plus late weight, the folders' parts
    shrank 9x, the reducer's own anchor with them, and the joiner stood 49x over the median: banned. By
    region it is 6x."""
    from p2p_diloco.core.robust import screen_weights

    assert screen_weights(1.0, 2.0) == (1.0, 2.0)
    assert screen_weights(0.0, 2.0) == (2.0, 2.0)  # a zeroed region may still carry a codec's residual
    assert screen_weights(1.0, 0.0) == (1.0, 1.0)
    fresh = [torch.full((64,), v) for v in (1.0, 1.1, 0.9, 6.0)]
    weights = [(1.0, 2.0), (1.0, 2.0), (1.0, 0.0), (1.0, 0.0)]
    _, rejected = _reduce(fresh, [1.0] * 4, screen_weights=[screen_weights(f, s) for f, s in weights])
    assert rejected == {}
    _, rejected = _reduce(fresh, [1.0] * 4, screen_weights=[(f + s, f + s) for f, s in weights])
    assert list(rejected) == ["peer3"]  # the sum, as before: an honest joiner banned
    # the late-work region of another group: three members fold one round each (late weight 1, the same size
    # of part); two also trained a long fresh phase (weight 9), the third has no fresh work. By the sum, the
    # reducer's anchor shrank 100x and the third member stood 90x over it; by the late weight they are equal.
    late = [torch.full((64,), v) for v in (1.0, 1.1, 0.9)]
    weights = [(9.0, 1.0), (9.0, 1.0), (0.0, 1.0)]
    _, rejected = _reduce(late, [9.0, 9.0, 0.0], regions=[1], screen_weights=[screen_weights(f, s) for f, s in weights])
    assert rejected == {}
    _, rejected = _reduce(late, [9.0, 9.0, 0.0], regions=[1], screen_weights=[(f + s, f + s) for f, s in weights])
    assert list(rejected) == ["peer2"]
    fresh = [torch.full((64,), v) for v in (1.0, 1.1, 0.9, 6.0)]
    weights = [(1.0, 2.0), (1.0, 2.0), (1.0, 0.0), (1.0, 0.0)]
    # a 100x attack in the fresh region is still caught by the folder's anchored screen
    fresh[3] = torch.full((64,), 100.0)
    _, rejected = _reduce(fresh, [1.0] * 4, screen_weights=[screen_weights(f, s) for f, s in weights])
    assert list(rejected) == ["peer3"]


def test_sybils_sending_tiny_parts_cannot_get_an_honest_sender_banned() -> None:
    # reducer peer0 and sender peer1 are honest; three Sybils send near-zero parts to drag the median down
    honest = [torch.full((64,), 1.0), torch.full((64,), 1.5)]
    sybils = [torch.full((64,), 1e-6)] * 3
    value, rejected = _reduce([*honest, *sybils], [1.0] * 5)
    assert rejected == {}  # before: the lower median was a Sybil's, and both honest parts were 10^6 x over it
    # without its own part as a yardstick, a reducer leaves the flagged part out but bans nobody
    _, rejected = _reduce([torch.zeros(64), honest[1], *sybils], [1.0] * 5, screen_weights=[(1.0, 1.0)] * 5)
    assert rejected == {}
    # a scaled attack far above the reducer's own part is still banned
    _, rejected = _reduce([*honest, torch.full((64,), 100.0), *sybils[:2]], [1.0] * 5)
    assert list(rejected) == ["peer2"]


def test_a_part_that_reaches_a_finalized_reducer_is_refused_not_counted() -> None:
    """A part that arrives after the all-reduce finalized the reducer (which cancels the current part's future)
    was counted: its sender then awaited the cancelled future (``CancelledError``), or, as the part's last
    sender, called ``set_result`` on it (``InvalidStateError``, the likely end of a survivor's round that named
    no group). Both of our reducers now refuse it, as hivemind refuses a part of a later index."""
    from hivemind.averaging.partition import BannedException

    from p2p_diloco.swarm.completion import OwnerPickReducer

    async def run() -> list[str]:
        robust = RobustPartReducer([torch.Size([4])], torch.float32, ["peer0", "peer1"], [1.0, 1.0],
                                   method="mean", norm_factor=20.0, own=0)
        check = OwnerPickReducer([torch.Size([4])], torch.zeros(4), [0, 1])
        refused = []
        for reducer in (robust, check):
            reducer.finalize()  # the all-reduce ended (a member died): the current part's future is cancelled
            try:
                await reducer.accumulate_part(1, 0, torch.ones(4))
            except BannedException as e:
                refused.append(str(e))
        return refused

    assert asyncio.run(run()) == ["the reducer finished before this part arrived"] * 2
