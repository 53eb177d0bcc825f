"""The simulator's ``swarm`` mode: the swarm's round policy under scripted and seeded faults."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig
from p2p_diloco.simulate import SimConfig
from p2p_diloco.simulate.__main__ import main as simulate_main
from p2p_diloco.simulate.faults import FaultSchedule
from p2p_diloco.simulate.swarm_mode import SwarmSimulation


def _cfg() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig("tiny", seq_len=32),
        data=DataConfig(eval_batches=1),
        inner=InnerConfig(batch_size=2, lr=2e-3, warmup_steps=1),
        outer=OuterConfig(local_steps=2, min_local_steps=1),
        run=RunConfig(seed=0),
    )


def test_scripted_faults_take_the_swarms_paths_and_synced_workers_agree() -> None:
    faults = FaultSchedule(script=["late@1:2", "partial@3", "drop@3:0"], joins={1: 1})
    sim = SwarmSimulation(_cfg(), SimConfig(mode="swarm", workers=3, rounds=5), faults)
    outcomes = list(sim.run().outcomes.values())
    assert outcomes == [
        ["averaged", "averaged", "averaged", None, "averaged"],
        [None, "averaged", "averaged", "skipped", "averaged"],
        ["averaged", "resynced", "folded_late", "skipped", "averaged"],
    ], outcomes
    # 1 joined at round 1 from the swarm's state; 2 was late in epoch 1 and folded its work into epoch 2; in
    # epoch 3 worker 0 crashed and the others' all-reduce failed: nobody applied it, and 0 restarted from the
    # swarm's state; every worker ends at the same parameters.
    assert [w.state.epoch for w in sim.workers] == [4, 4, 4]
    for w in sim.workers[1:]:
        for a, b in zip(sim.workers[0].state.anchors, w.state.anchors, strict=True):
            assert torch.equal(a, b)


def test_eager_rounds_run_through_the_same_policy_and_a_late_worker_steps_on_its_own_term() -> None:
    cfg = _cfg()
    cfg = dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, overlap="eager"))
    faults = FaultSchedule(script=["late@1:2", "partial@3"])
    sim = SwarmSimulation(cfg, SimConfig(mode="swarm", workers=3, rounds=5), faults)
    outcomes = list(sim.run().outcomes.values())
    # Round 0 has no previous round; each later round applies the previous round's background all-reduce. 2 was
    # late in round 1: its launch found no group, so in round 2 it steps on its own term; the group of round 3
    # failed (partial), so round 4 is own-term for everybody.
    assert outcomes == [
        ["own_only", "averaged", "averaged", "averaged", "own_only"],
        ["own_only", "averaged", "averaged", "averaged", "own_only"],
        ["own_only", "averaged", "own_only", "averaged", "own_only"],
    ], outcomes
    assert [w.state.epoch for w in sim.workers] == [5, 5, 5]


def test_drawn_faults_are_reproducible_per_seed_and_round() -> None:
    def draws(seed: int) -> list:
        schedule = FaultSchedule(seed=seed, drop_rate=0.5, late_rate=0.2, partial_rate=0.1)
        return [schedule.round_faults(r, r, 8) for r in range(200)]

    first = draws(3)
    assert first == draws(3) and first != draws(4)
    dropped = sum(len(f.dropped) for f in first) / (200 * 8)
    late = sum(len(f.late) for f in first) / (200 * 8)
    assert 0.33 < dropped < 0.47 and 0.15 < late < 0.25  # drops exclude the late: 0.5 * 0.8 = 0.4
    assert all(not (f.late & f.dropped) for f in first)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(drop_rate=1.5), "drop_rate"),
    (dict(script=["late@x:1"]), "cannot read"),
    (dict(joins={0: 2}), "worker 0"),
])
def test_fault_schedule_rejects_bad_values(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        FaultSchedule(**kwargs)


def test_fault_flags_need_the_swarm_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        simulate_main(["--mode", "diloco", "--drop-rate", "0.5"])
    assert exit_info.value.code == 2 and "--mode swarm" in capsys.readouterr().err
