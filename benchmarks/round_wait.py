"""How long a round waits beyond its all-reduce when every peer is ready, blocking against eager.

Two real ``run_peer`` processes and a bootstrap on loopback, the swarm's DEFAULT deadlines
(``--matchmaking-time-s 15`` and the rest), the tiny model, H = 20 inner steps, 12 rounds per mode. Per
round (after the first, which includes start-up skew):

- ``round_s``: wall seconds between this peer's consecutive round ends;
- ``wait_beyond_allreduce_s``: ``round_s - inner_seconds - allreduce_seconds``, what the round lost to
  anything but training and the all-reduce itself (matchmaking, mostly);
- ``utilization``: ``inner_seconds / round_s``.

The medians are over the rounds that ran with the LEARNED matchmaking window (``window_s`` below the
``--matchmaking-time-s`` flag, from about round 4 on: ``core.deadlines`` needs 3 samples), which is the
steady state of a long run; rounds 2-3 still use the flag. Fewer than about 10 rounds hides the learned
window's behaviour behind the warm-up rounds, so ``--rounds`` below 10 is refused. ``all_rounds`` holds the
medians over every round after the first as well.

Run: ``python -m benchmarks.round_wait [--rounds 12] [--tag before]``; writes
``benchmarks/results/round_wait_<tag>.json`` and prints the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2p_diloco.demo import wait_for_maddr
from p2p_diloco.peer.runlog import read_records

RESULTS = Path(__file__).resolve().parent / "results"
MATCHMAKING_TIME_S = 15.0
"""The peer's default ``--matchmaking-time-s``: a round whose window is below it used the learned window."""
MIN_ROUNDS = 10
PEER = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--use-relay", "false", "--model", "tiny", "--batch-size", "4",
        "--seq-len", "64", "--local-steps", "20", "--min-local-steps", "20", "--eval-every", "0"]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _rows(path: Path) -> list[dict[str, Any]]:
    return read_records(path)


def run_mode(mode: str, rounds: int, work: Path) -> dict[str, Any]:
    """One swarm of two peers with ``--overlap mode``; the per-round figures of both peers."""
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "bootstrap.out", "w") as out:
        boot = subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", "--identity-path",
                                 str(work / "bootstrap.id"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                                stdout=out, stderr=subprocess.STDOUT, env=_env())
    procs: dict[str, subprocess.Popen] = {}
    try:
        maddr = wait_for_maddr(work / "bootstrap.out", boot)
        for name in ("a", "b"):
            with open(work / f"{name}.out", "w") as out:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "p2p_diloco.cli.run_peer", *PEER, "--initial-peers", maddr,
                     "--run-id", f"wait-{mode}", "--overlap", mode, "--max-rounds", str(rounds),
                     "--log-file", str(work / f"{name}.jsonl")],
                    stdout=out, stderr=subprocess.STDOUT, env=_env())
        deadline = time.monotonic() + 120 * rounds + 120
        codes = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
    finally:
        for proc in (*procs.values(), boot):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    peers = {}
    for name in procs:
        rows = [r for r in _rows(work / f"{name}.jsonl") if r["event"] == "round"]
        per_round = []
        for prev, row in zip(rows, rows[1:], strict=False):
            round_s = row["time"] - prev["time"]
            per_round.append(dict(
                epoch=row["epoch"], outcome=row["outcome"], round_s=round_s, inner_s=row["inner_seconds"],
                allreduce_s=row["allreduce_seconds"], matchmaking_s=row["wait_seconds"],
                blocked_s=row["blocked_seconds"],
                wait_beyond_allreduce_s=round_s - row["inner_seconds"] - row["allreduce_seconds"],
                utilization=row["inner_seconds"] / round_s if round_s > 0 else float("nan"),
                due=row.get("due_members"), cut=row.get("cut_members"),
                formed_early=row.get("formed_early"), stepped_back=row.get("stepped_back"),
                window_s=row.get("window_s"),
            ))
        peers[name] = dict(outcomes=[r["outcome"] for r in rows], rounds=per_round)
    every = [r for p in peers.values() for r in p["rounds"]]
    learned = [r for r in every if r["window_s"] and r["window_s"] < MATCHMAKING_TIME_S]
    return dict(mode=mode, codes=codes, peers=peers, learned_rounds=len(learned), **medians(learned),
                all_rounds=medians(every))


def medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """The medians the benchmark reports, over ``rounds`` (both peers' rows)."""

    def med(key: str) -> float:
        values = [r[key] for r in rounds if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    return dict(median_round_s=med("round_s"), median_inner_s=med("inner_s"), median_allreduce_s=med("allreduce_s"),
                median_matchmaking_s=med("matchmaking_s"), median_blocked_s=med("blocked_s"),
                median_wait_beyond_allreduce_s=med("wait_beyond_allreduce_s"), median_utilization=med("utilization"),
                median_window_s=med("window_s"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12,
                        help=f"rounds per mode, at least {MIN_ROUNDS}: the learned window takes over from round 4")
    parser.add_argument("--tag", default="after", help="suffix of the JSON file (e.g. before, after)")
    parser.add_argument("--modes", default="none,eager")
    args = parser.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}, got {args.rounds}: fewer leave too few rounds "
                     "with the learned matchmaking window to take a median over")
    runs = []
    with tempfile.TemporaryDirectory(prefix="round_wait_") as tmp:
        for mode in args.modes.split(","):
            began = time.monotonic()
            run = run_mode(mode, args.rounds, Path(tmp) / mode)
            run["wall_s"] = time.monotonic() - began
            runs.append(run)
            print(f"{mode}: codes {run['codes']}, median round {run['median_round_s']:.2f} s, inner "
                  f"{run['median_inner_s']:.2f} s, all-reduce {run['median_allreduce_s']:.2f} s, wait beyond it "
                  f"{run['median_wait_beyond_allreduce_s']:.2f} s, utilization {run['median_utilization']:.2f}, "
                  f"window {run['median_window_s']:.2f} s (medians over {run['learned_rounds']} learned-window "
                  "rounds); "
                  f"outcomes {[p['outcomes'] for p in run['peers'].values()]}")
    RESULTS.mkdir(exist_ok=True)
    payload = dict(rounds=args.rounds, flags=PEER, runs=runs, machine=dict(
        cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), python=platform.python_version(),
        load_average=os.getloadavg()[0]))
    (RESULTS / f"round_wait_{args.tag}.json").write_text(json.dumps(payload, indent=1))
    return 0 if all(c == 0 for run in runs for c in run["codes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
