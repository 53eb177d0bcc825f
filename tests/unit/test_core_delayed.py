"""The peer-to-peer delayed rule and the server-style async baselines."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.core.delayed import (
    Contribution,
    DelayedNesterov,
    NaiveAsyncNesterov,
    StalenessPolicy,
    aggregate_round,
    apply_round,
    contribution_scales,
    delayed_outer_step,
    summarize_round,
)
from p2p_diloco.core.outer import make_anchors, nesterov_outer_optimizer
from p2p_diloco.core.pseudograd import weighted_mean


def _tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 5, generator=gen), torch.randn(7, generator=gen)]


def _scalar(value: float) -> list[torch.Tensor]:
    return [torch.tensor([value], dtype=torch.float32)]


# --- the peer-to-peer rule -----------------------------------------------------------------


def test_no_late_work_is_diloco_bit_for_bit() -> None:
    start = _tensors(0)
    rounds = [[_tensors(10 * r + i) for i in range(3)] for r in range(3)]
    weights = [1.0, 2.5, 0.75]

    plain = nesterov_outer_optimizer(make_anchors(start))
    delayed = nesterov_outer_optimizer(make_anchors(start))
    for deltas in rounds:
        plain.step(weighted_mean(deltas, weights))
        stats = delayed_outer_step(
            delayed, [Contribution(d, w) for d, w in zip(deltas, weights, strict=True)]
        )
        assert (stats.n_fresh, stats.n_stale, stats.n_dropped) == (3, 0, 0)
    for a, b in zip(plain.anchors, delayed.anchors, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain.momentum_buffers(), delayed.momentum_buffers(), strict=True):
        assert torch.equal(a, b)


def test_late_work_moves_params_but_not_momentum() -> None:
    start, fresh_deltas, late_delta = _tensors(0), [_tensors(1), _tensors(2)], _tensors(3)
    fresh_only = nesterov_outer_optimizer(make_anchors(start))
    fresh_only.step(_tensors(9))  # non-zero momentum before the round
    with_late = nesterov_outer_optimizer(make_anchors(start))
    with_late.step(_tensors(9))

    fresh_only.step(weighted_mean(fresh_deltas, [1.0, 3.0]))
    contributions = [
        Contribution(fresh_deltas[0], 1.0),
        Contribution(late_delta, 2.0, staleness=1, peer_id="slow"),
        Contribution(fresh_deltas[1], 3.0),
    ]
    stats = delayed_outer_step(with_late, contributions)

    assert (stats.n_fresh, stats.n_stale, stats.n_dropped) == (2, 1, 0)
    for a, b in zip(fresh_only.momentum_buffers(), with_late.momentum_buffers(), strict=True):
        assert torch.equal(a, b)
    # The late peer moves θ by η·w_j/W_f·Δ_j = 0.7·2/4·Δ_j, once.
    for a, b, d in zip(fresh_only.anchors, with_late.anchors, late_delta, strict=True):
        assert torch.allclose(a - b, 0.7 * 0.5 * d, atol=1e-6)


def test_hand_numbers_with_decay() -> None:
    # Fresh Δ = 1 (w 1): θ = 0 − 0.5·(1 + 0.9·1) = −0.95.
    # Late Δ = 2 (w 1), s = 3, decay 0.5: λ = 0.25, θ −= 0.5·0.25·2/1 = 0.25  → −1.2.
    anchors = _scalar(0.0)
    outer = nesterov_outer_optimizer(anchors, lr=0.5, momentum=0.9)
    policy = StalenessPolicy(staleness_decay=0.5, max_staleness=4)
    delayed_outer_step(outer, [Contribution(_scalar(1.0), 1.0), Contribution(_scalar(2.0), 1.0, 3)], policy)
    assert anchors[0].item() == pytest.approx(-1.2, abs=1e-6)
    assert outer.momentum_buffers()[0].item() == pytest.approx(1.0)


def test_too_stale_work_is_dropped_and_counted() -> None:
    start = _tensors(0)
    fresh, stale, dropped = _tensors(1), _tensors(2), _tensors(3)
    outer = nesterov_outer_optimizer(make_anchors(start))
    reference = nesterov_outer_optimizer(make_anchors(start))
    contributions = [
        Contribution(fresh, 1.0, 0, "a"),
        Contribution(dropped, 1.0, 5, "b"),
        Contribution(stale, 2.0, 4, "c"),
    ]
    stats = delayed_outer_step(outer, contributions, StalenessPolicy(max_staleness=4))
    assert (stats.n_fresh, stats.n_stale, stats.n_dropped) == (1, 1, 1)
    assert stats.stalenesses == [0, 5, 4]
    assert stats.weights == [1.0, 1.0, 2.0]
    assert stats.peer_ids == ["a", "b", "c"]
    assert stats.fresh_weight_total == 1.0 and stats.late_weight_total == 2.0

    reference.step(fresh)
    # D = max(W_f, late total) = 2: late work weighing more than all fresh work is applied at most once.
    reference.apply_momentum_free(stale, scale=1.0)
    for a, b in zip(outer.anchors, reference.anchors, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_only_late_work_uses_late_weights_and_no_momentum() -> None:
    anchors = _scalar(0.0)
    outer = nesterov_outer_optimizer(anchors, lr=1.0)
    contributions = [Contribution(_scalar(1.0), 1.0, 1), Contribution(_scalar(4.0), 3.0, 2)]
    stats = delayed_outer_step(outer, contributions)
    assert stats.denominator == 4.0 and not stats.has_fresh
    assert anchors[0].item() == pytest.approx(-(1.0 * 1.0 + 3.0 * 4.0) / 4.0)
    assert outer.momentum_buffers() == [None]


def test_round_with_only_dropped_work_changes_nothing() -> None:
    anchors = _scalar(3.0)
    outer = nesterov_outer_optimizer(anchors)
    aggregate = aggregate_round([Contribution(_scalar(1.0), 1.0, 9)])
    assert aggregate.fresh_mean is None and aggregate.stale_term is None
    apply_round(outer, aggregate)
    assert anchors[0].item() == 3.0 and aggregate.stats.n_dropped == 1


@pytest.mark.parametrize("with_fresh", [True, False])
def test_prescaled_linear_sums_equal_direct_aggregate(with_fresh: bool) -> None:
    policy = StalenessPolicy(staleness_decay=0.5, max_staleness=3)
    stalenesses = [0, 2, 0, 1, 7, 0, 3] if with_fresh else [2, 1, 7, 3]
    weights = [1.0, 2.0, 0.5, 3.0, 1.5, 2.5, 0.25][: len(stalenesses)]
    deltas = [_tensors(i) for i in range(len(stalenesses))]
    contributions = [Contribution(d, w, s) for d, w, s in zip(deltas, weights, stalenesses, strict=True)]
    direct = aggregate_round(contributions, policy)

    stats = summarize_round(weights, stalenesses, policy)
    scales = [contribution_scales(w, s, stats, policy) for w, s in zip(weights, stalenesses, strict=True)]
    group = len(stalenesses)
    fresh_sum = [sum(a * d[k] for (a, _), d in zip(scales, deltas, strict=True)) / group for k in range(2)]
    stale_sum = [sum(b * d[k] for (_, b), d in zip(scales, deltas, strict=True)) / group for k in range(2)]

    assert stats.has_stale
    assert direct.stale_term is not None
    for got, want in zip(stale_sum, direct.stale_term, strict=True):
        assert torch.allclose(got, want, atol=1e-5)
    if with_fresh:
        assert direct.fresh_mean is not None
        for got, want in zip(fresh_sum, direct.fresh_mean, strict=True):
            assert torch.allclose(got, want, atol=1e-5)
    else:
        assert direct.fresh_mean is None
        assert all(a == 0.0 for a, _ in scales)
    # The dropped peer sends zeros in both buffers.
    assert scales[stalenesses.index(7)] == (0.0, 0.0)


def test_validation() -> None:
    with pytest.raises(ValueError, match="weight"):
        Contribution(_scalar(1.0), -1.0)
    with pytest.raises(ValueError, match="staleness"):
        Contribution(_scalar(1.0), 1.0, staleness=-1)
    with pytest.raises(ValueError, match="staleness"):
        Contribution(_scalar(1.0), 1.0, staleness=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="staleness_decay"):
        StalenessPolicy(staleness_decay=0.0)
    with pytest.raises(ValueError, match="staleness_decay"):
        StalenessPolicy(staleness_decay=1.5)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessPolicy(max_staleness=-1)
    with pytest.raises(ValueError, match="stalenesses"):
        summarize_round([1.0, 1.0], [0])


def test_policy_factor() -> None:
    policy = StalenessPolicy(staleness_decay=0.5, max_staleness=3)
    assert [policy.factor(s) for s in range(5)] == [1.0, 1.0, 0.5, 0.25, 0.0]
    assert StalenessPolicy(max_staleness=0).factor(1) == 0.0


# --- server-style baselines ----------------------------------------------------------------


def test_delayed_nesterov_c0_equals_nesterov_on_the_mean() -> None:
    n, lr, beta = 4, 0.7, 0.9
    start = _tensors(0)
    dn = DelayedNesterov(make_anchors(start), buffer_size=n, beta=beta, lr=lr)
    sync = nesterov_outer_optimizer(make_anchors(start), lr=lr, momentum=beta)
    for window in range(2):
        pushes = [_tensors(100 * window + i) for i in range(n)]
        for g in pushes:
            dn.push(g)
        sync.step(weighted_mean(pushes, [1.0] * n))
        for a, b in zip(dn.params, sync.anchors, strict=True):
            assert torch.allclose(a, b, atol=1e-5)
    assert dn.num_pushes == 2 * n


def test_naive_async_differs_from_synchronous() -> None:
    n, lr, beta = 4, 0.7, 0.9
    start = _tensors(0)
    pushes = [_tensors(i + 1) for i in range(n)]
    naive = NaiveAsyncNesterov(make_anchors(start), lr=lr / n, momentum=beta)
    sync = nesterov_outer_optimizer(make_anchors(start), lr=lr, momentum=beta)
    for g in pushes:
        naive.push(g)
    sync.step(weighted_mean(pushes, [1.0] * n))
    gap = max(float((a - b).abs().max()) for a, b in zip(naive.params, sync.anchors, strict=True))
    assert gap > 1e-2


def test_delayed_nesterov_with_c_by_hand() -> None:
    # N = 2, c = 0.5, β = 0.5, ε = 1, g = 1 each push, θ0 = 0.
    # push 1 (no flush): θ −= c·β·0 + g/2 = 0.5                  → −0.5
    # push 2 (flush):    m = (1+1)/2 = 1; θ −= (1−1+0.5)·0.5·1 + 0.5 = 0.75 → −1.25
    # push 3 (no flush): θ −= 0.5·0.5·1 + 0.5 = 0.75             → −2.0
    dn = DelayedNesterov(_scalar(0.0), buffer_size=2, beta=0.5, lr=1.0, c=0.5)
    expected = [-0.5, -1.25, -2.0]
    for want in expected:
        dn.push(_scalar(1.0))
        assert dn.params[0].item() == pytest.approx(want)
    assert dn.momentum[0].item() == pytest.approx(1.0)
    assert dn.accumulator[0].item() == pytest.approx(1.0)


def test_delayed_nesterov_validation() -> None:
    with pytest.raises(ValueError, match="c must be"):
        DelayedNesterov(_scalar(0.0), buffer_size=4, c=0.5)
    with pytest.raises(ValueError, match="buffer_size"):
        DelayedNesterov(_scalar(0.0), buffer_size=0)
    dn = DelayedNesterov(_scalar(0.0), buffer_size=2)
    with pytest.raises(ValueError, match="shape"):
        dn.push([torch.zeros(2)])


@settings(max_examples=60, deadline=None, database=None)
@given(
    members=st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=100.0), st.integers(min_value=0, max_value=6)),
        min_size=1,
        max_size=8,
    ),
    decay=st.sampled_from([0.25, 0.5, 1.0]),
    max_staleness=st.integers(min_value=0, max_value=5),
)
def test_prescaled_sums_match_for_any_group(
    members: list[tuple[float, int]], decay: float, max_staleness: int
) -> None:
    policy = StalenessPolicy(staleness_decay=decay, max_staleness=max_staleness)
    weights = [w for w, _ in members]
    stalenesses = [s for _, s in members]
    deltas = [[torch.full((3,), float(i + 1)), torch.full((2,), -float(i + 1))] for i in range(len(members))]
    direct = aggregate_round(
        [Contribution(d, w, s) for d, w, s in zip(deltas, weights, stalenesses, strict=True)], policy
    )
    stats = summarize_round(weights, stalenesses, policy)
    scales = [contribution_scales(w, s, stats, policy) for w, s in zip(weights, stalenesses, strict=True)]
    group = len(members)
    for which, aggregate in ((0, direct.fresh_mean), (1, direct.stale_term)):
        summed = [
            sum(sc[which] * d[k] for sc, d in zip(scales, deltas, strict=True)) / group for k in range(2)
        ]
        if aggregate is None:
            assert all(sc[which] == 0.0 for sc in scales)
        else:
            for got, want in zip(summed, aggregate, strict=True):
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert stats.n_fresh + stats.n_stale + stats.n_dropped == group
