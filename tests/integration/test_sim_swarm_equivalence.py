"""The simulator and the swarm run the same round policy: one scripted fault schedule gives the same outcomes,
round by round, and the same parameters in the ``swarm`` simulation mode and in a real 3-peer swarm.

The schedule: peer c is late in epoch 1 (the simulator's ``late@1:2``). Its groupmates average without it; c
finds the swarm ahead, downloads the state (``resynced``) and folds its work into epoch 2 (``folded_late``).
The real swarm is paced by events, not by sleeps, so load cannot change who was in which group: every peer
begins epoch 0 once it sees the others' records (``start_together``); c stops after its first step of epoch 1
until a and b have written their epoch-1 rounds (a test gate, ``swarm_helpers/gated_peer.py``), so it is late
whatever the machine's speed; and a and b stop after their first step of epoch 2 until c has written its
epoch-1 round (its download is done), so that all three train epoch 2 from the same moment and c's folded round
meets them, however long the download took. The outcome lists are then exact in the swarm as in the
simulator, which trains on the very data shards the peers trained on (a peer's shard is named by its peer id).

The eager schedule (``--overlap eager``, no fault past the start): each round collects the previous round's
background all-reduce, so the first round steps on the own term (``own_only``) and every later one on the
group's average of the round before (``averaged``), in the swarm and in the simulator alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from swarm_procs import FAST, events, start_bootstrap, start_peer, start_together, tail, wait_all, wait_for

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
SWARM_FAULTS = {n: start_together(3) for n in "abc"}
SIM_FAULTS = ["late@1:2"]
LATE_GATES = {"c": {1: "c_late"}, "a": {2: "c_back"}, "b": {2: "c_back"}}
"""Peer -> epoch -> the gate file it waits for after that epoch's first step (module docstring)."""
GATE_EVENTS = {"c_late": (("a", 1), ("b", 1)), "c_back": (("c", 1),)}
"""Gate file -> the (peer, epoch) rounds in the run logs after which the test opens it, in the order opened."""


EAGER_TIMING = [*TIMING[:-1], "eqe", "--overlap", "eager"]
EAGER_FAULTS = {n: start_together(3) for n in "abc"}


def _open_gates(tmp_path: Path, gate_events: dict[str, tuple[tuple[str, int], ...]]) -> None:
    """Open each gate file, in order, once the run logs hold its (peer, epoch) rounds (bounded waits)."""
    for gate, rounds in gate_events.items():
        def logged(rounds: tuple[tuple[str, int], ...] = rounds) -> bool:
            return all(any(r["epoch"] == e for r in events(tmp_path, n, "round")) for n, e in rounds)

        wait_for(logged, 180, lambda gate=gate: f"the rounds that open {gate}: {({n: tail(tmp_path, n) for n in 'abc'})}")
        (tmp_path / gate).write_text("open")


def _swarm_then_simulator(tmp_path: Path, timing: list[str], swarm_faults: dict[str, str], expected: dict,
                          sim_faults: list[str], gates: dict[str, dict[int, str]] | None = None) -> SwarmSimulation:
    """Run the three peers under ``timing`` and ``swarm_faults``, opening each gate (``GATE_EVENTS``) once its
    rounds are logged, check their outcomes are ``expected``, then the simulator on their data shards under
    ``sim_faults``, and check it gives the same outcomes."""
    gates = gates or {}
    boot, maddr = start_bootstrap(tmp_path)
    try:
        procs = {n: start_peer(tmp_path, n, maddr, *timing, "--checkpoint-dir", str(tmp_path / f"ck-{n}"),
                               "--checkpoint-every", "1", faults=swarm_faults[n],
                               gates={e: tmp_path / g for e, g in gates.get(n, {}).items()}) for n in "abc"}
        try:
            if gates:
                _open_gates(tmp_path, GATE_EVENTS)
            codes = wait_all(procs, 240)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
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
        SIM_FAULTS, LATE_GATES)
    _same_parameters(tmp_path, simulation)


@pytest.mark.long
def test_eager_rounds_give_the_same_outcomes_and_parameters_in_simulator_and_swarm(tmp_path: Path) -> None:
    simulation = _swarm_then_simulator(tmp_path, EAGER_TIMING, EAGER_FAULTS,
                                       {n: ["own_only", "averaged", "averaged", "averaged"] for n in "abc"}, [])
    _same_parameters(tmp_path, simulation)

