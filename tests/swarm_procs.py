"""Start real bootstrap and peer processes on loopback for the multi-peer tests, and read their logs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from p2p_diloco.core.rounds import Outcome
from p2p_diloco.demo import wait_for_maddr  # noqa: F401 - the tests import it from here
from p2p_diloco.peer.runlog import read_records

# Loopback timings: rounds of a few seconds. Every peer of a test shares them. DyLU is held at H
# (min-local-steps = local-steps): peers sharing this machine's two cores are not independent hardware,
# and the one that happens to get the CPU while the others wait measures itself fastest, which makes the
# others' step counts swing. DyLU itself is tested in tests/unit/test_core_dylu.py and the simulator.
# --eval-every 1: tests read a peer's eval loss of a given round (the default evaluates every few rounds).
# --outer-lr 0.7 --outer-momentum 0.9: the settings these tests were written for (at H = 10 the peer would
# choose 1 and 0), so that momentum's paths (its state chunks, its checkpoint tensors) stay exercised.
FAST = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--matchmaking-time-s", "3", "--matchmaking-timeout-s", "15",
        "--allreduce-timeout-s", "30", "--next-chunk-timeout-s", "10", "--request-timeout-s", "2",
        "--state-download-timeout-s", "30", "--startup-timeout-s", "15", "--progress-ttl-s", "30",
        "--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--inner-lr", "2e-3", "--warmup-steps", "5",
        "--eval-batches", "2", "--eval-every", "1", "--outer-lr", "0.7", "--outer-momentum", "0.9", "--local-steps", "10", "--min-local-steps", "10"]


GATED_PEER = Path(__file__).resolve().parent / "swarm_helpers" / "gated_peer.py"
"""``run_peer`` with test gates (``start_peer(gates=...)``)."""


def start_together(peers: int) -> str:
    """``P2P_DILOCO_FAULTS`` entry for ``peers`` peers a test starts at once and needs in one group from epoch 0.

    Their processes come up seconds apart (1-2 s on an idle machine, 8 s seen with two test files at a time),
    and a round of 10 FAST steps takes about a second: the first peer up read no record of the others and
    applied its own round alone ("no other peer visible"), or led a group of those whose records it had read,
    formed early, and the last one up missed epoch 0 and then the next while it downloaded the state (seen in
    CI rehearsals: faults, kill-and-resume, port-forwarded and unreachable home peers). A fixed sleep in every
    step of epoch 0 (the fault ``slow_steps@0=0.4``, 4 s in all) covered the usual gap and not the 8 s one.
    ``start_together`` waits for the event itself: each peer begins epoch 0 once all ``peers`` progress
    records are visible to it, so its first round reads every one of them (``peer.faults``)."""
    return f"start_together@0={peers}"

# Round outcomes after which a peer holds the swarm's parameters for the round's new epoch.
SYNCED = tuple(o.value for o in Outcome if o.synced)
# The longest a FAST round may take: matchmaking_timeout_s + the followers' patience (2 * request_timeout_s)
# + allreduce_timeout_s + the averager's grace.
ROUND_BUDGET_S = 15 + 2 * 2 + 30 + 10


def check_rounds(rounds: dict[str, list[dict]], window_s: float = 3.0) -> None:
    """Assert what every fault test needs: identical parameters wherever an epoch was reached through the
    swarm, and every round ended (averaged or cleanly skipped) within its deadline. ``window_s``: the peers'
    ``--matchmaking-time-s`` (FAST's unless the test set another)."""
    by_epoch: dict[int, set[str]] = defaultdict(set)
    for rows in rounds.values():
        for r in rows:
            if r["outcome"] in SYNCED:
                by_epoch[r["new_epoch"]].add(r["params_sha256"])
    assert by_epoch and all(len(s) == 1 for s in by_epoch.values()), by_epoch
    for name, rows in rounds.items():
        for r in rows:
            assert r["outcome"] in (*SYNCED, "skipped"), (name, r)
            assert r["wait_seconds"] + r["allreduce_seconds"] <= ROUND_BUDGET_S, (name, r)
            # learned deadlines stay within the flags (0: no round ran, e.g. a resync)
            assert 0 <= r["window_s"] <= window_s and 0 <= r["allreduce_deadline_s"] <= 30, (name, r)
        if sum(r["outcome"] == "averaged" for r in rows) >= 4:
            # all-reduces of well under a second: the deadline drops to its floor, 2 x --next-chunk-timeout-s
            assert any(r["allreduce_deadline_s"] == 20 for r in rows), (name, rows)

def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    e.pop("P2P_DILOCO_FAULTS", None)
    e.update(extra)
    return e


def start_bootstrap(tmp: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    out = open(tmp / "bootstrap.out", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", "--identity-path", str(tmp / "bootstrap.id"),
         "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
         # on loopback every peer dials every other directly and nobody needs the relay: its check at start
         # (1-3 s, swarm.relay_check) is tested in test_relay_check.py and by the home-network tests
         "--relay-check-starts", "0", *extra],
        stdout=out, stderr=subprocess.STDOUT, env=env(),
    )
    return proc, wait_for_maddr(tmp / "bootstrap.out", proc)




def start_peer(tmp: Path, name: str, bootstrap: str, *extra: str, faults: str = "",
               gates: dict[int, Path] | None = None) -> subprocess.Popen:
    """``gates``: epoch -> a file the peer waits for after its first inner step of that epoch
    (``swarm_helpers/gated_peer.py``; needs ``faults``), so a test paces it by events it saw."""
    out = open(tmp / f"{name}.out", "a")
    program = [str(GATED_PEER)] if gates else ["-m", "p2p_diloco.cli.run_peer"]
    args = [sys.executable, *program, *FAST, "--initial-peers", bootstrap,
            "--log-file", str(tmp / f"{name}.jsonl"), *extra]
    extra_env = {"P2P_DILOCO_FAULTS": faults} if faults else {}
    if gates:
        extra_env["P2P_TEST_GATES"] = ";".join(f"{epoch}={path}" for epoch, path in gates.items())
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env(**extra_env))


def wait_all(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[name] = proc.wait()
    return codes


def events(tmp: Path, name: str, kind: str | None = None) -> list[dict]:
    return read_records(tmp / f"{name}.jsonl", kind)


def assert_loss_fell(tmp: Path, names: list[str], by: float) -> None:
    """Each named peer's last eval loss is at least ``by`` below the untrained model's.

    The untrained loss comes from whichever peer of the run evaluated epoch 0 (all start from the same seed): a
    peer that joined after round 0 downloaded a model that had trained already, so its own first eval is no
    start.
    """
    peers = [path.stem for path in sorted(tmp.glob("*.jsonl"))]
    untrained = [e["eval_loss"] for n in peers for e in events(tmp, n, "eval") if e["epoch"] == 0]
    assert untrained, "no peer evaluated the untrained model"
    for name in names:
        last = [r["eval_loss"] for r in events(tmp, name, "round") if r["eval_loss"] is not None][-1]
        assert last < untrained[0] - by, (name, untrained, last)


def wait_for(predicate, timeout: float, what: str | Callable[[], str], every: float = 0.2) -> None:
    """Return once ``predicate()`` holds, read every ``every`` s; fail naming ``what`` after ``timeout`` s (a
    callable is called then: the peers' logs as they are at the failure, not as they were when the wait began)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")


def tail(tmp: Path, name: str, n: int = 3000) -> str:
    path = tmp / f"{name}.out"
    return path.read_text()[-n:] if path.exists() else ""


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a started process and every process it started (its DHT process, p2p daemons): a lost machine."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for p in [*children, psutil.Process(proc.pid)] if proc.poll() is None else children:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait(timeout=30)


def run_peer_programs(tmp: Path, program: str, run_id: str, count: int = 2, timeout: float = 240.0) -> list:
    """Run ``count`` copies of a test file that is also a peer program (``python FILE SPEC.json``), each given
    ``index``, the loopback bootstrap's ``initial_peers``, ``run_id`` and its ``out`` path, until they exit
    (killed after ``timeout`` s). Asserts that each exited 0 (with the ends of their logs) and returns what each
    wrote to its ``out`` (JSON)."""
    import json

    from p2p_diloco.swarm import SwarmConfig, start_dht, visible_maddrs

    here = Path(__file__).resolve().parent  # the program imports this module, and the package from the checkout
    path = os.pathsep.join([str(here.parent), str(here)])
    boot = start_dht(SwarmConfig.for_loopback())
    procs = []
    try:
        for index in range(count):
            spec = dict(index=index, initial_peers=visible_maddrs(boot), run_id=run_id,
                        out=str(tmp / f"p{index}.json"))
            (tmp / f"p{index}.spec").write_text(json.dumps(spec))
            log = open(tmp / f"p{index}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, program, str(tmp / f"p{index}.spec")],
                                          stdout=log, stderr=subprocess.STDOUT,
                                          env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")))
        wait_all({str(i): proc for i, proc in enumerate(procs)}, timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        boot.shutdown()
    logs = [(tmp / f"p{i}.log").read_text(errors="replace")[-3000:] for i in range(count)]
    assert all(p.wait() == 0 for p in procs), logs
    return [json.loads((tmp / f"p{i}.json").read_text()) for i in range(count)]
