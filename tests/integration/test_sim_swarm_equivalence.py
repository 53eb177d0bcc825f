"""The simulator and the swarm run the same round policy: one scripted fault schedule gives the same outcomes,
round by round, and the same parameters in the ``swarm`` simulation mode and in a real 3-peer swarm.

The schedule: peer c is late in epoch 1 (the swarm fault ``slow_steps@1``, the simulator's ``late@1:2``). Its
groupmates average without it; c finds the swarm ahead, downloads the state (``resynced``) and folds its work
into epoch 2 (``folded_late``). The real peers' timings leave room for loopback and a loaded host:
every peer begins epoch 0 once it sees the others' records (``start_together``), the matchmaking window (15 s,
groups of 3 form at once) absorbs what skew is left, and c's slow phase (21 s) outlasts it. The simulator
then trains on the very data shards the peers trained on (a peer's shard is named by its peer id).

The eager schedule (``--overlap eager``, no fault past the start): each round collects the previous round's
background all-reduce, so the first round steps on the own term (``own_only``) and every later one on the
group's average of the round before (``averaged``), in the swarm and in the simulator alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from swarm_procs import FAST, events, start_bootstrap, start_peer, start_together, tail, wait_all

from p2p_diloco.checkpoint import load_latest
from p2p_diloco.cli.common import make_parser, parse_config
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.simulate import SimConfig
from p2p_diloco.simulate.faults import FaultSchedule
from p2p_diloco.simulate.swarm_mode import SwarmSimulation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROUNDS = 4
TIMING = ["--matchmaking-time-s", "15", "--matchmaking-timeout-s", "40", "--target-group-size", "3",
          "--max-rounds", str(ROUNDS), "--eval-every", "0", "--run-id", "eq"]
SWARM_FAULTS = {"a": start_together(3), "b": start_together(3), "c": f"{start_together(3)},slow_steps@1=2.1"}
SIM_FAULTS = ["late@1:2"]


EAGER_TIMING = [*TIMING[:-1], "eqe", "--overlap", "eager"]
EAGER_FAULTS = {n: start_together(3) for n in "abc"}


def _swarm_then_simulator(tmp_path: Path, timing: list[str], swarm_faults: dict[str, str], expected: dict,
                          sim_faults: list[str]) -> SwarmSimulation:
    """Run the three peers under ``timing`` and ``swarm_faults``, check their outcomes are ``expected``, then
    the simulator on their data shards under ``sim_faults``, and check it gives the same outcomes."""
    boot, maddr = start_bootstrap(tmp_path)
    try:
        procs = {n: start_peer(tmp_path, n, maddr, *timing, "--checkpoint-dir", str(tmp_path / f"ck-{n}"),
                               "--checkpoint-every", "1", faults=swarm_faults[n]) for n in "abc"}
        codes = wait_all(procs, 240)
    finally:
        boot.terminate()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: tail(tmp_path, n) for n in "abc"}
    swarm = {n: [r["outcome"] for r in events(tmp_path, n, "round")] for n in "abc"}
    assert swarm == expected, ({n: [r["reason"] for r in events(tmp_path, n, "round")] for n in "abc"},
                               {n: tail(tmp_path, n) for n in "abc"})

    ids = [events(tmp_path, n, "start")[0]["peer_id"] for n in "abc"]
    cfg, _ = parse_config(make_parser("run_peer", "", PeerConfig), PeerConfig,
                          [*FAST, *timing, "--initial-peers", maddr])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the peers (OMP_NUM_THREADS=1)
    try:
        simulation = SwarmSimulation(cfg, SimConfig(mode="swarm", workers=3, rounds=ROUNDS),
                                     FaultSchedule(script=sim_faults), data_ids=ids)
        result = simulation.run()
    finally:
        torch.set_num_threads(threads)
    assert result.outcomes == {ids[i]: swarm[n] for i, n in enumerate("abc")}
    return simulation


def _same_parameters(tmp_path: Path, simulation: SwarmSimulation) -> None:
    # The peers' last checkpoints (epoch 4) against the simulated workers' anchors: bit for bit. The simulator
    # reduces in the swarm's arithmetic (fp32 scaling, a float64 mean rounded once), and the order in which the
    # parts arrive does not change a float64 sum of a few fp32 values. When the simulator summed in fp32
    # instead, an ulp of difference grew to 1e-6..2e-5 within the four rounds, depending on the shards.
    for worker, name in zip(simulation.workers, "abc", strict=True):
        ck = load_latest(tmp_path / f"ck-{name}")
        assert ck is not None and ck.epoch == ROUNDS == worker.state.epoch
        for i, anchor in enumerate(worker.state.anchors):
            real = ck.tensors[f"param.{i}"]
            assert torch.equal(real, anchor), (name, i, float((real - anchor).abs().max()))


def test_one_fault_schedule_gives_the_same_outcomes_and_parameters_in_simulator_and_swarm(tmp_path: Path) -> None:
    simulation = _swarm_then_simulator(
        tmp_path, TIMING, SWARM_FAULTS,
        {"a": ["averaged"] * 4, "b": ["averaged"] * 4, "c": ["averaged", "resynced", "folded_late", "averaged"]},
        SIM_FAULTS)
    _same_parameters(tmp_path, simulation)


@pytest.mark.long
def test_eager_rounds_give_the_same_outcomes_and_parameters_in_simulator_and_swarm(tmp_path: Path) -> None:
    simulation = _swarm_then_simulator(tmp_path, EAGER_TIMING, EAGER_FAULTS,
                                       {n: ["own_only", "averaged", "averaged", "averaged"] for n in "abc"}, [])
    _same_parameters(tmp_path, simulation)

