"""``python -m p2p_diloco.demo``: a bootstrap node and 3 peers on this machine, trained for a few minutes.

Everything is real: separate processes, a hivemind DHT on loopback, all-reduce rounds. The demo follows
the peers' JSON-line logs, prints each round as it completes, and ends with a summary. Extra arguments
are passed to every peer (e.g. ``--compression 4bit`` or ``--max-rounds 4``). Ctrl+C stops everything.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from p2p_diloco.cli.run_bootstrap import READY_LINE

PEERS = ("a", "b", "c")
MADDR = re.compile(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+")
# Loopback timings and a tiny model: rounds of a few seconds, the whole demo in a few minutes on a laptop.
# Outer lr 1 without momentum: at H = 40 over 8 rounds the paper's 0.7 / 0.9 (tuned for H = 500) overshoots
# (see --outer-lr's help and BENCHMARKS.md, "Convergence").
PEER_ARGS = ["--model", "tiny", "--dataset", "embedded", "--run-id", "demo", "--max-rounds", "8",
             "--local-steps", "40", "--outer-lr", "1", "--outer-momentum", "0",
             "--batch-size", "8", "--seq-len", "128", "--inner-lr", "2e-3",
             "--warmup-steps", "20", "--eval-batches", "4", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
             "--matchmaking-time-s", "4", "--matchmaking-timeout-s", "30", "--allreduce-timeout-s", "60",
             "--next-chunk-timeout-s", "20", "--request-timeout-s", "3", "--state-download-timeout-s", "60"]
DEADLINE_S = 1800


def _env() -> dict[str, str]:
    threads = str(max(1, (os.cpu_count() or 2) // len(PEERS)))
    return dict(os.environ, OMP_NUM_THREADS=threads, PYTHONUNBUFFERED="1")


def announced(text: str, ready: str | None, pattern: re.Pattern[str]) -> str | None:
    """The first multiaddr matching ``pattern`` after the line ``ready`` (anywhere when ``ready`` is None)."""
    if ready is not None:
        at = text.rfind(ready)
        if at < 0:
            return None
        text = text[at:]
    match = pattern.search(text)
    return match.group(0) if match else None


def wait_for_maddr(path: Path, proc: subprocess.Popen, timeout: float = 120,
                   ready: str | None = READY_LINE) -> str:
    """The first loopback multiaddr ``proc`` prints to ``path`` after ``ready`` (default: a bootstrap node's
    line once it is up; a bootstrap that restarts its daemon to fix its relay logs other addresses before);
    ``ready=None`` for any process's first. Raises if it exits or stays silent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        maddr = announced(path.read_text(), ready, MADDR)
        if maddr:
            return maddr
        if proc.poll() is not None:
            raise RuntimeError(f"{path.name}: exited with {proc.returncode}: {path.read_text()[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{path.name}: no multiaddr within {timeout} s")


class LogFollower:
    """Reads new complete lines of a peer's JSON-line log."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rows = path, 0, []

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        new = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.rows.extend(new)
        return new


def _show(name: str, row: dict) -> None:
    if row["event"] == "start":
        print(f"[{name}] peer {row['peer_id'][-8:]} {row['how']}", flush=True)
    elif row["event"] == "eval":
        print(f"[{name}] epoch {row['epoch']}: eval loss {row['eval_loss']:.3f}", flush=True)
    elif row["event"] == "round":
        ev = row.get("eval_loss")
        print(f"[{name}] epoch {row['epoch']} -> {row['new_epoch']}: {row['outcome']:<11} group {row['group_size']}"
              f"  {row['inner_steps']} steps in {row['inner_seconds']:.1f}s  train {row['train_loss']:.3f}"
              + (f"  eval {ev:.3f}" if ev is not None else "")
              + f"  all-reduce {row['allreduce_seconds']:.1f}s  sent {row['bytes_sent'] / 1e6:.1f} MB", flush=True)


def summary(logs: dict[str, list[dict]], wall_s: float) -> str:
    """The closing summary: eval loss start and end, rounds, bytes moved, share of time computing."""
    lines = ["", "summary"]
    for name, rows in logs.items():
        evals = [r["eval_loss"] for r in rows if r["event"] == "eval"]
        rounds = [r for r in rows if r["event"] == "round"]
        evals += [r["eval_loss"] for r in rounds if r.get("eval_loss") is not None]
        if not rounds:
            lines.append(f"  {name}: no round completed")
            continue
        starts = [r["time"] for r in rows if r["event"] == "start"]
        peer_wall = rounds[-1]["time"] - starts[0] if starts else wall_s
        compute = sum(r["inner_seconds"] for r in rounds)
        moved = sum(r["bytes_sent"] + r["bytes_received"] for r in rounds)
        outcomes = {o: sum(r["outcome"] == o for r in rounds) for o in sorted({r["outcome"] for r in rounds})}
        lines.append(
            f"  {name}: eval loss {evals[0]:.3f} -> {evals[-1]:.3f}, {len(rounds)} rounds "
            f"(epoch {rounds[-1]['new_epoch']}; {', '.join(f'{k} {v}' for k, v in outcomes.items())}), "
            f"{moved / 1e6:.1f} MB moved, computing {100 * compute / max(peer_wall, 1e-9):.0f}% of the time"
        )
    lines.append(f"  wall time {wall_s:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    run_dir = Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"demo: a bootstrap node and {len(PEERS)} peers on this machine; logs in {run_dir}/", flush=True)
    procs: dict[str, subprocess.Popen] = {}
    started = time.monotonic()
    try:
        boot_out = open(run_dir / "bootstrap.out", "w")
        procs["bootstrap"] = subprocess.Popen(
            [sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", "--identity-path", str(run_dir / "bootstrap.id"),
             "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], stdout=boot_out, stderr=subprocess.STDOUT, env=_env())
        maddr = wait_for_maddr(run_dir / "bootstrap.out", procs["bootstrap"])
        print(f"bootstrap node at {maddr}", flush=True)
        followers = {}
        for name in PEERS:
            log = run_dir / f"peer-{name}.jsonl"
            out = open(run_dir / f"peer-{name}.out", "w")
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "p2p_diloco.cli.run_peer", *PEER_ARGS, "--initial-peers", maddr,
                 "--log-file", str(log), *extra], stdout=out, stderr=subprocess.STDOUT, env=_env())
            followers[name] = LogFollower(log)
        while time.monotonic() - started < DEADLINE_S:
            for name, follower in followers.items():
                for row in follower.poll():
                    _show(name, row)
            if all(procs[n].poll() is not None for n in PEERS):
                break
            time.sleep(0.5)
        for name, follower in followers.items():
            for row in follower.poll():
                _show(name, row)
        failed = [n for n in PEERS if procs[n].poll() not in (0, None)]
        for n in failed:
            print(f"peer {n} failed; see {run_dir}/peer-{n}.out", file=sys.stderr)
        print(summary({n: f.rows for n, f in followers.items()}, time.monotonic() - started), flush=True)
        return 1 if failed else 0
    except KeyboardInterrupt:
        print("\nstopping the demo", flush=True)
        return 130
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
