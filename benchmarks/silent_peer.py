"""What a peer that goes silent costs the others' rounds, with deadlines learned from arrivals and without.

Three real ``run_peer`` processes and a bootstrap on loopback, the swarm's default deadlines
(``--matchmaking-time-s 15``, ``--request-timeout-s 5``), the tiny model, H = 20. Peer ``c`` is killed with
SIGKILL after its ``--warm-rounds``-th round, as when a volunteer's machine loses power. Its signed progress
record lives on (``--progress-ttl-s``), so the others count it due until the swarm's epoch leaves its record
behind; every such round waits out the matchmaking window for it. With ``--adaptive-deadlines`` the window
is the one learned from the arrivals of the rounds before (``core.deadlines``); without, the fixed 15 s.

Reported per run: for each survivor, the rounds after the kill with their window, wait and cut members, and
the total seconds waited for the dead peer (wait of the rounds that cut it).

Run: ``python -m benchmarks.silent_peer [--warm-rounds 4] [--after-rounds 4]``; writes
``benchmarks/results/silent_peer.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.round_wait import PEER, RESULTS, _env, _rows
from p2p_diloco.demo import wait_for_maddr


def _rounds(work: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in _rows(work / f"{name}.jsonl") if r["event"] == "round"]


def run(adaptive: bool, warm_rounds: int, after_rounds: int, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "bootstrap.out", "w") as out:
        boot = subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", "--identity-path",
                                 str(work / "bootstrap.id"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                                stdout=out, stderr=subprocess.STDOUT, env=_env())
    procs: dict[str, subprocess.Popen] = {}
    total = warm_rounds + after_rounds
    try:
        maddr = wait_for_maddr(work / "bootstrap.out", boot)
        for name in ("a", "b", "c"):
            with open(work / f"{name}.out", "w") as out:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "p2p_diloco.cli.run_peer", *PEER, "--initial-peers", maddr,
                     "--run-id", f"silent-{adaptive}", "--adaptive-deadlines", str(adaptive).lower(),
                     "--max-rounds", str(total if name != "c" else total + 10),
                     "--log-file", str(work / f"{name}.jsonl")],
                    stdout=out, stderr=subprocess.STDOUT, env=_env())
        deadline = time.monotonic() + 60 * total + 180
        while len(_rounds(work, "c")) < warm_rounds and time.monotonic() < deadline:
            if procs["c"].poll() is not None:
                break
            time.sleep(0.5)  # polling a log file another process writes; bounded by the deadline
        procs["c"].send_signal(signal.SIGKILL)
        killed = time.time()
        codes = {}
        for name in ("a", "b"):
            try:
                codes[name] = procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                procs[name].kill()
                codes[name] = procs[name].wait()
    finally:
        for proc in (*procs.values(), boot):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    survivors = {}
    for name in ("a", "b"):
        rows = _rounds(work, name)
        before = [r for r in rows if r["time"] <= killed]
        after = [r for r in rows if r["time"] > killed]
        survivors[name] = dict(
            windows_before=[r["window_s"] for r in before],
            after=[dict(epoch=r["epoch"], outcome=r["outcome"], window_s=r["window_s"], wait_s=r["wait_seconds"],
                        due=r["due_members"], cut=r["cut_members"], group_size=r["group_size"]) for r in after],
            waited_for_dead_s=sum(r["wait_seconds"] for r in after if r["cut_members"] > 0),
            rounds_cutting_dead=sum(1 for r in after if r["cut_members"] > 0),
        )
    return dict(adaptive=adaptive, codes=codes, survivors=survivors)


def plot(payload: dict[str, Any]) -> Path:
    """Wait per round after the kill, fixed against learned deadlines (each survivor a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for run in payload["runs"]:
        label = "learned deadlines" if run["adaptive"] else "fixed --matchmaking-time-s 15"
        for i, (name, s) in enumerate(run["survivors"].items()):
            ax.plot(range(1, len(s["after"]) + 1), [r["wait_s"] for r in s["after"]], marker="o",
                    color="tab:green" if run["adaptive"] else "tab:red", alpha=0.8,
                    label=label if i == 0 else None, linestyle="-" if name == "a" else "--")
    ax.set_xlabel("round after the kill")
    ax.set_ylabel("matchmaking wait (s)")
    ax.set_title("A peer killed: what the two survivors wait for it")
    ax.legend()
    fig.tight_layout()
    path = RESULTS / "silent_peer.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-rounds", type=int, default=4, help="rounds before the kill (they teach the window)")
    parser.add_argument("--after-rounds", type=int, default=4, help="rounds the survivors run after it")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the saved JSON")
    args = parser.parse_args(argv)
    if args.plot_only:
        print(plot(json.loads((RESULTS / "silent_peer.json").read_text())))
        return 0
    runs = []
    with tempfile.TemporaryDirectory(prefix="silent_peer_") as tmp:
        for adaptive in (False, True):
            began = time.monotonic()
            result = run(adaptive, args.warm_rounds, args.after_rounds, Path(tmp) / str(adaptive))
            result["wall_s"] = time.monotonic() - began
            runs.append(result)
            for name, s in result["survivors"].items():
                print(f"adaptive={adaptive} {name}: windows before the kill {s['windows_before']}; after: "
                      + ", ".join(f"{r['outcome']} window {r['window_s']:.1f} s wait {r['wait_s']:.1f} s "
                                  f"cut {r['cut']}" for r in s["after"])
                      + f"; waited for the dead peer {s['waited_for_dead_s']:.1f} s in "
                        f"{s['rounds_cutting_dead']} rounds")
    RESULTS.mkdir(exist_ok=True)
    payload = dict(flags=PEER, warm_rounds=args.warm_rounds, after_rounds=args.after_rounds, runs=runs,
                   machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                                python=platform.python_version(), load_average=os.getloadavg()[0]))
    (RESULTS / "silent_peer.json").write_text(json.dumps(payload, indent=1))
    plot(payload)
    return 0 if all(c == 0 for r in runs for c in r["codes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
