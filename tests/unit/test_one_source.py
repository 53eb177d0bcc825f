"""One rule, one place: the fold scales, the codec names and the run-id rule each live in one module, and
every room that needs them (swarm, simulator, configs, CLI) uses that module's answer."""

from __future__ import annotations

import threading
import typing

import pytest
import torch

from p2p_diloco import config as peer_config
from p2p_diloco.core import codecs, sparse
from p2p_diloco.core.bounds import CODEC_NORM_GAIN
from p2p_diloco.core.delayed import (
    StalenessPolicy,
    contribution_scales,
    fold_scales,
    group_stats,
    summarize_round,
)
from p2p_diloco.simulate.swarm_mode import SimGroup
from p2p_diloco.swarm.group import GroupPlan, MemberInfo

# (fresh weight, decayed late weight, late staleness) per member: fresh only, both, late only, fresh only
MEMBERS = [(1.0, 0.0, 0), (3.0, 0.5, 1), (0.0, 1.5, 2), (2.0, 0.0, 0)]


def test_fold_scales_is_contribution_scales_for_one_contribution_per_member() -> None:
    policy = StalenessPolicy(staleness_decay=0.5, max_staleness=3)
    weights, stalenesses = [2.0, 1.0, 4.0, 3.0], [0, 0, 1, 2]
    stats = summarize_round(weights, stalenesses, policy)
    for weight, staleness in zip(weights, stalenesses, strict=True):
        late = 0.0 if staleness == 0 else policy.factor(staleness) * weight
        fresh = weight if staleness == 0 else 0.0
        assert contribution_scales(weight, staleness, stats, policy) == fold_scales(fresh, late, stats)


def test_group_stats_counts_members_not_contributions() -> None:
    stats = group_stats([m[0] for m in MEMBERS], [m[1] for m in MEMBERS], [m[2] for m in MEMBERS])
    assert stats.group_size == 4 and stats.n_fresh == 3 and stats.n_stale == 2
    assert stats.fresh_weight_total == 6.0 and stats.late_weight_total == 2.0 and stats.denominator == 6.0
    assert fold_scales(3.0, 0.5, stats) == (4 * 3.0 / 6.0, 4 * 0.5 / 6.0)
    # late work heavier than the fresh work: D is the late total, so no late term is scaled above its weight
    heavy = group_stats([1.0, 0.0], [0.0, 4.0])
    assert heavy.denominator == 4.0 and fold_scales(0.0, 4.0, heavy) == (0.0, 2.0)
    with pytest.raises(ValueError, match="late weights"):
        group_stats([1.0], [])
    with pytest.raises(ValueError, match="finite"):
        group_stats([float("nan")], [0.0])


def _info(fresh: float, late: float, staleness: int) -> MemberInfo:
    return MemberInfo.for_round("run", "f" * 16, 3, fresh, late, staleness, fresh > 0, late > 0,
                                norm=1.0, stale_norm=1.0)


def test_swarm_plan_and_simulator_group_take_their_scales_from_the_core() -> None:
    infos = [_info(*m) for m in MEMBERS]
    plan = GroupPlan(peer_ids=tuple(f"p{i}" for i in range(4)), members=tuple(infos), bandwidths=(None,) * 4,
                     modes=(), refused=(), with_stale=True, fresh_weight_total=6.0, skip_reason=None)
    stats = group_stats([m[0] for m in MEMBERS], [m[1] for m in MEMBERS])
    for i, (fresh, late, _) in enumerate(MEMBERS):
        assert plan.local_scales(f"p{i}") == fold_scales(fresh, late, stats)

    # The simulator's group: its fresh mean and late term are the plain mean of the pre-scaled work.
    torch.manual_seed(0)
    deltas = [[torch.randn(6)] for _ in MEMBERS]
    lates = [[torch.randn(6)] if m[1] > 0 else None for m in MEMBERS]
    group = SimGroup(range(4), partial=False)
    results: dict[int, object] = {}

    def member(i: int) -> None:
        fresh, late, staleness = MEMBERS[i]
        results[i] = group.average(i, f"p{i}", deltas[i], fresh, staleness, 3, lates[i], late)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    scales = [fold_scales(m[0], m[1], stats) for m in MEMBERS]
    expected_fresh = sum(a * d[0] for (a, _), d in zip(scales, deltas, strict=True)) / 4
    expected_late = sum(b * e[0] for (_, b), e in zip(scales, lates, strict=True) if e is not None) / 4
    result = results[0]
    torch.testing.assert_close(result.fresh_mean[0], expected_fresh)  # type: ignore[attr-defined]
    torch.testing.assert_close(result.stale_term[0], expected_late)  # type: ignore[attr-defined]


def test_codec_names_are_listed_once() -> None:
    assert codecs.CODEC_NAMES == typing.get_args(codecs.CodecName)
    hints = typing.get_type_hints(peer_config.OuterConfig)
    assert typing.get_args(hints["compression"]) == codecs.CODEC_NAMES  # what the CLI offers
    assert set(sparse.SPARSE_CODEC_NAMES) <= set(codecs.CODEC_NAMES)
    assert set(codecs._CODECS) | set(sparse.SPARSE_CODEC_NAMES) == set(codecs.CODEC_NAMES)
    assert set(CODEC_NORM_GAIN) == set(codecs.CODEC_NAMES)
    for name in codecs.CODEC_NAMES:
        assert codecs.get_codec(name).name == name


@pytest.mark.parametrize("run_id, ok", [
    ("p2p-diloco-demo", True), ("a", True), ("A_b-9", True), ("x" * 64, True),
    ("", False), ("-flag", False), ("_x", False), ("x" * 65, False), ("a b", False), ("run\n", False), (7, False),
])
def test_one_run_id_rule_for_configs_wire_and_bootstrap(run_id: object, ok: bool) -> None:
    from p2p_diloco.cli.run_bootstrap import BootstrapConfig
    from p2p_diloco.swarm.config import SwarmConfig

    assert peer_config.is_run_id(run_id) is ok
    checks = [
        lambda: peer_config.RunConfig(run_id=run_id),  # type: ignore[arg-type]
        lambda: SwarmConfig(run_id=run_id),  # type: ignore[arg-type]
        lambda: BootstrapConfig(monitor_run_ids=[run_id]),  # type: ignore[list-item]
        lambda: MemberInfo.from_wire(_info(1.0, 0.0, 0).to_wire() | {"run": run_id}),
    ]
    for check in checks:
        if ok:
            check()
        else:
            with pytest.raises(ValueError):
                check()
