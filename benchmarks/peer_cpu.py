"""Where a peer's CPU goes: the ``p2p`` side of ``benchmarks/vs_hivemind.py``, with each peer's process tree
accounted per role.

    .venv/bin/python -m benchmarks.peer_cpu [--peers 3] [--seconds 120]

Same peers and settings as ``vs_hivemind``'s ``p2p`` side (``run_peer`` at its defaults, the ``tiny`` preset,
H = 20, an evaluation every round), on loopback. Once a second it reads, from ``/proc`` through psutil (a
dependency already, for the doctor), the CPU seconds of every process and thread of each peer's tree and keeps
the last reading of each, so a process that exits keeps what it used. Roles:

- ``training thread``: the thread of ``run_peer``'s main process whose id is the process id;
- ``trainer's other threads``: the rest of that process (DHT writer, swarm view, checkpoint writer, serving);
- ``DHT process``: the child with the p2p daemon below it; ``p2p daemon``: that daemon (``p2pd``);
- ``averager process``: any other child (the round's all-reduce, state serving).

Also per peer: steps, the seconds its round log counts as inner phase, and the wall seconds from its start event.
Writes ``benchmarks/results/peer_cpu.json`` and ``.png``. The peers share the machine's cores: report its
load beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.vs_hivemind import (
    BATCH,
    MODEL,
    RESULTS,
    ROOT,
    SEQ_LEN,
    H,
    Hosts,
    _bootstrap,
    _env,
    _rows,
    _wait,
    p2p_peer_argv,
)

ROLES = ("training thread", "trainer's other threads", "averager process", "DHT process", "p2p daemon")


def _role_seconds(root: psutil.Process) -> dict[str, float]:
    """CPU seconds (user + system) of ``root``'s tree by role, read now."""
    out = dict.fromkeys(ROLES, 0.0)
    with root.oneshot():
        for thread in root.threads():
            key = "training thread" if thread.id == root.pid else "trainer's other threads"
            out[key] += thread.user_time + thread.system_time
    for child in root.children():
        tree = [child, *child.children(recursive=True)]
        has_daemon = any("p2pd" in p.name() for p in tree)
        for proc in tree:
            times = proc.cpu_times()
            if "p2pd" in proc.name():
                out["p2p daemon"] += times.user + times.system
            else:
                out["DHT process" if has_daemon else "averager process"] += times.user + times.system
    return out


def _sample(procs: list[subprocess.Popen], last: list[dict[str, float]], stop: threading.Event) -> None:
    """Keep the latest reading per peer; a process gone keeps its last reading (bounded by ``stop``)."""
    while not stop.is_set():
        for i, proc in enumerate(procs):
            try:
                reading = _role_seconds(psutil.Process(proc.pid))
            except (psutil.Error, OSError):
                continue
            # a child that exited between readings must not take its seconds away
            last[i] = {role: max(last[i].get(role, 0.0), reading[role]) for role in ROLES}
        stop.wait(1.0)


def run(peers: int, seconds: float, work: Path) -> dict[str, Any]:
    from p2p_diloco.demo import wait_for_maddr

    work.mkdir(parents=True, exist_ok=True)
    boot = _bootstrap(work, Hosts())
    procs: list[subprocess.Popen] = []
    last: list[dict[str, float]] = [{} for _ in range(peers)]
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(procs, last, stop), daemon=True)
    load = [os.getloadavg()[0]]
    try:
        maddr = wait_for_maddr(work / "bootstrap.out", boot)
        for i in range(peers):
            procs.append(subprocess.Popen(
                p2p_peer_argv(maddr, "peer-cpu", work / f"p{i}.jsonl"),
                stdout=open(work / f"p{i}.out", "w"), stderr=subprocess.STDOUT, env=_env(), cwd=ROOT))
        sampler.start()
        deadline = time.monotonic() + seconds + 600
        stopped: set[int] = set()
        while len(stopped) < peers and time.monotonic() < deadline:
            for i, proc in enumerate(procs):
                start = next((r for r in _rows(work / f"p{i}.jsonl") if r["event"] == "start"), None)
                if i not in stopped and (proc.poll() is not None or (start and time.time() - start["time"] >= seconds)):
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGINT)
                    stopped.add(i)
            time.sleep(0.5)
        load.append(os.getloadavg()[0])
        codes = [_wait(p, 120) for p in procs]
    finally:
        stop.set()
        for proc in (*procs, boot):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    per_peer = []
    for i in range(peers):
        rows = _rows(work / f"p{i}.jsonl")
        start = next(r for r in rows if r["event"] == "start")
        rounds = [r for r in rows if r["event"] == "round"]
        wall = rounds[-1]["time"] - start["time"] if rounds else 0.0
        per_peer.append(dict(cpu_s={k: round(v, 2) for k, v in last[i].items()}, steps=sum(r["inner_steps"] for r in rounds),
                             rounds=len(rounds), inner_s=round(sum(r["inner_seconds"] for r in rounds), 2),
                             wall_s=round(wall, 2), outcomes=[r["outcome"] for r in rounds]))
    return dict(peers=per_peer, exit_codes=codes, load_avg_1m=load, seconds=seconds, cores=os.cpu_count(),
                settings=dict(model=MODEL, local_steps=H, batch=BATCH, seq_len=SEQ_LEN, eval_every=1))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(result["peers"])
    names = [f"peer {i}" for i in range(len(result["peers"]))]
    for role in ROLES:
        values = [p["cpu_s"].get(role, 0.0) for p in result["peers"]]
        ax.bar(names, values, bottom=bottom, label=role)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("CPU seconds")
    ax.set_title(f"CPU per role, {result['seconds']:.0f} s per peer, {result['cores']} cores shared")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "peer_cpu.json")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the peers' logs here")
    args = parser.parse_args()
    if args.peers < 1 or args.seconds <= 0:
        parser.error("--peers must be at least 1 and --seconds positive")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.peers, args.seconds, args.work_dir or Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    for i, p in enumerate(result["peers"]):
        total = sum(p["cpu_s"].values())
        parts = ", ".join(f"{k} {v:.1f}" for k, v in p["cpu_s"].items())
        print(f"peer {i}: {p['steps']} steps in {p['wall_s']:.0f} s ({p['inner_s']:.0f} s inner), "
              f"CPU {total:.1f} s: {parts}")
    print(f"load average {result['load_avg_1m']}")


if __name__ == "__main__":
    main()
