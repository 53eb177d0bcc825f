"""Swarm scale with churn: up to 32 peers in one swarm on this machine, peers leaving and joining.

Full trainers do not fit 32 times on 2 cores and 24 GB, so each peer here is **averager-only**: the real
swarm side of a peer (``SwarmSession``: DHT, averager process, state server, round policy, checksum vote,
state download, progress records, run log) with a synthetic inner phase in place of the model. The inner
phase stands for a volunteer's GPU: its steps take ``--step-seconds`` of wall time off this machine's CPU
(a sleep: the work is elsewhere), and it moves the parameters by a seeded random step, so every round has a
real pseudo-gradient to average and every peer's digest shows whether it applied the same update.

Churn: every ``--churn-every-s`` seconds one running peer leaves (alternately SIGKILL, a crash, and SIGTERM,
a clean stop) and a fresh one joins, downloading the swarm's state.

Reported per scenario (``benchmarks/results/swarm_scale.json``, ``swarm_scale.png``, BENCHMARKS.md):
round time, group sizes, rounds averaged and lost (skipped), state downloads (joins and resyncs), and
**whether anything was applied partially**: for every epoch reached through the swarm, every peer that
reached it must hold the same parameter digest. Memory: the proportional set size of all peers' processes.

Usage::

    python -m benchmarks.swarm_scale                      # the scenarios of BENCHMARKS.md
    python -m benchmarks.swarm_scale --peers 8 --minutes 3 --target-group-size 32
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
logger = logging.getLogger("swarm_scale")

# Round deadlines of a LAN swarm on a loaded 2-core machine: every process of 32 peers shares the cores.
PEER_FLAGS = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--matchmaking-time-s", "15", "--matchmaking-timeout-s",
              "60", "--request-timeout-s", "5", "--allreduce-timeout-s", "120", "--next-chunk-timeout-s", "30",
              "--startup-timeout-s", "120", "--state-download-timeout-s", "120", "--progress-ttl-s", "120",
              "--outer-lr", "1.0", "--outer-momentum", "0.0", "--batch-size", "8", "--seq-len", "64"]


# ---------------------------------------------------------------------------------------------- one peer


class _Stop(BaseException):
    """SIGTERM/SIGINT; a BaseException, as run_peer's ``Stop``, so that no round API's ``except Exception``
    swallows it."""


def _raise_stop(*_: object) -> None:
    raise _Stop


def peer_main(argv: list[str]) -> int:
    """One averager-only peer: ``SwarmSession`` rounds over a synthetic inner phase."""
    import torch

    from p2p_diloco.cli.common import make_parser, parse_config, setup_logging
    from p2p_diloco.host_memory import return_freed_memory, threshold_for
    from p2p_diloco.inner_stats import InnerStats
    from p2p_diloco.peer.config import PeerConfig
    from p2p_diloco.peer.runlog import RunLog
    from p2p_diloco.peer.session import SwarmSession
    from p2p_diloco.swarm import SwarmStartError

    parser = make_parser("swarm_scale peer", "An averager-only peer (see benchmarks/swarm_scale.py).", PeerConfig)
    parser.add_argument("--synthetic-params", type=int, default=262_144, help="parameters averaged each round")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="wall time of one synthetic inner step")
    cfg, args = parse_config(parser, PeerConfig, argv)
    setup_logging(args.verbose)
    # as run_peer does for a CUDA peer, whose host holds model-sized buffers only, like this synthetic peer
    return_freed_memory(threshold_for("cuda"))
    n = args.synthetic_params
    params = [torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02]
    fingerprint = hashlib.sha256(f"swarm-scale-{n}".encode()).hexdigest()[:16]
    runlog = RunLog(cfg.run.log_file)
    session = SwarmSession(cfg, params, fingerprint)
    try:
        try:
            how = session.start()
        except SwarmStartError as e:
            print(f"swarm_scale peer: error: {e}", file=sys.stderr, flush=True)
            return 1
        for sig in (signal.SIGINT, signal.SIGTERM):  # after start(): its forked processes keep the default
            signal.signal(sig, _raise_stop)
        runlog.write("start", peer_id=session.peer_id, epoch=session.epoch, how=how,
                     params_sha256=session.params_sha256())
        rounds = 0
        while not session.done:
            session.begin_round()
            steps = session.local_steps()
            began = time.monotonic()
            for step in range(steps):
                time.sleep(args.step_seconds)  # the GPU's step, not this machine's work (see the module docstring)
                session.on_inner_step(step, 1.0)
            seed = int.from_bytes(hashlib.sha256(f"{session.peer_id}/{rounds}".encode()).digest()[:8], "little")
            params[0].add_(torch.randn(n, generator=torch.Generator().manual_seed(seed)), alpha=1e-3 * steps)
            stats = InnerStats(steps=steps, samples=steps * cfg.inner.batch_size,
                               tokens=steps * cfg.inner.batch_size * cfg.model.seq_len,
                               seconds=time.monotonic() - began, mean_loss=1.0, last_loss=1.0)
            report = session.end_round(stats)
            runlog.write("round", peer_id=session.peer_id, **report.as_dict())
            rounds += 1
    except _Stop:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        session.close()
        runlog.close()
    return 0


# ---------------------------------------------------------------------------------------------- the swarm


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _wait_for_maddr(path: Path, proc: subprocess.Popen, timeout: float = 180.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines() if path.exists() else []:
            for word in line.split():
                if word.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in word:
                    return word
        if proc.poll() is not None:
            raise RuntimeError(f"bootstrap exited: {path.read_text()[-2000:]}")
        time.sleep(0.5)
    raise TimeoutError("the bootstrap node printed no address")


def _signal_tree(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the peer's whole process group (started with ``start_new_session``)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tree_memory(pids: list[int]) -> dict[str, int]:
    """Proportional set size of the peers' process trees, and unique set size by process role."""
    import psutil

    out: Counter = Counter()
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree = (root, *root.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
        for proc in tree:
            try:
                info = proc.memory_full_info()
                role = "peer" if proc.pid == pid else ("forked" if proc.name().startswith("python") else proc.name())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            out["pss"] += info.pss
            out[f"uss_{role}"] += info.uss
    out["trees"] = len(pids)
    return dict(out)


START_WAVE = 4
"""Peers started together; the next wave starts once these logged their start."""
MIN_AVAILABLE_BYTES = 3 * 2**30
"""Below this much available memory the scenario stops (a benchmark must not push the machine into the OOM killer)."""


class OutOfMemory(RuntimeError):
    pass


def _memory_guard(procs: dict[str, subprocess.Popen]) -> None:
    import psutil

    available = psutil.virtual_memory().available
    if available < MIN_AVAILABLE_BYTES:
        for proc in procs.values():
            _signal_tree(proc, signal.SIGKILL)
        raise OutOfMemory(f"{available / 2**30:.1f} GiB available with {len(procs)} peers started")


def _events(path: Path, kind: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a SIGKILL
        if row.get("event") == kind:
            rows.append(row)
    return rows


def run_scenario(name: str, peers: int, minutes: float, churn_every_s: float, target_group_size: int,
                 local_steps: int, step_seconds: float, synthetic_params: int, seed: int = 0) -> dict[str, Any]:
    """Run one swarm of ``peers`` averager-only peers for ``minutes`` with churn; return its summary."""
    out = RESULTS / "swarm_scale" / name
    if out.exists():
        for f in out.iterdir():
            f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    boot = subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", "--host-maddrs",
                             "/ip4/127.0.0.1/tcp/0", "--identity-path", str(out / "bootstrap.id")], stdout=open(out / "bootstrap.out", "w"),
                            stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    procs: dict[str, subprocess.Popen] = {}
    left: list[dict[str, Any]] = []
    joins: list[dict[str, Any]] = []
    memory: list[dict[str, int]] = []
    started = time.time()
    aborted = ""

    def start(i: int, bootstrap: str) -> None:
        tag = f"p{i:03d}"
        args = [sys.executable, "-m", "benchmarks.swarm_scale", "peer", *PEER_FLAGS, "--initial-peers", bootstrap,
                "--run-id", f"scale-{name}", "--target-group-size", str(target_group_size),
                "--local-steps", str(local_steps), "--min-local-steps", str(max(1, local_steps // 4)),
                "--synthetic-params", str(synthetic_params), "--step-seconds", str(step_seconds),
                "--log-file", str(out / f"{tag}.jsonl")]
        # its own session: a peer is killed as a whole tree (its DHT and averager processes and p2p daemons)
        procs[tag] = subprocess.Popen(args, stdout=open(out / f"{tag}.out", "w"), stderr=subprocess.STDOUT,
                                      env=_env(), cwd=ROOT, start_new_session=True)
        joins.append(dict(peer=tag, time=time.time()))

    try:
        bootstrap = _wait_for_maddr(out / "bootstrap.out", boot)
        # In waves: 32 interpreters importing torch at once on 2 cores take minutes each and, all at their
        # import peak together, more memory than the swarm needs once it runs.
        for first in range(0, peers, START_WAVE):
            wave = range(first, min(peers, first + START_WAVE))
            for i in wave:
                start(i, bootstrap)
            wave_deadline = time.time() + 300
            while time.time() < wave_deadline and not all(_events(out / f"p{i:03d}.jsonl", "start") for i in wave):
                _memory_guard(procs)
                time.sleep(2.0)  # polling the peers' logs
        next_index = peers
        started = time.time()  # the measured window starts with every peer up
        deadline = started + 60 * minutes
        next_churn = started + churn_every_s
        kill_hard = True
        while time.time() < deadline:
            time.sleep(5.0)  # the benchmark's sampling period; the peers do not wait on it
            _memory_guard(procs)
            memory.append(_tree_memory([p.pid for p in procs.values() if p.poll() is None]))
            if churn_every_s and time.time() >= next_churn:
                alive = [t for t, p in procs.items() if p.poll() is None and _events(out / f"{t}.jsonl", "round")]
                if alive:
                    victim = rng.choice(alive)
                    _signal_tree(procs[victim], signal.SIGKILL if kill_hard else signal.SIGTERM)
                    left.append(dict(peer=victim, time=time.time(), how="SIGKILL" if kill_hard else "SIGTERM"))
                    kill_hard = not kill_hard
                    start(next_index, bootstrap)
                    next_index += 1
                next_churn += churn_every_s
    except OutOfMemory as e:
        aborted = f"stopped early: {e}"
        logger.error("%s: %s", name, aborted)
    finally:
        for proc in procs.values():
            _signal_tree(proc, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            _signal_tree(proc, signal.SIGKILL)  # whatever of its tree is left (a killed peer's orphans too)
        boot.terminate()
        try:
            boot.wait(timeout=30)
        except subprocess.TimeoutExpired:
            boot.kill()
    summary = summarize(name, out, peers, minutes, churn_every_s, target_group_size, local_steps, step_seconds,
                        synthetic_params, left, joins, memory, started)
    summary["aborted"] = aborted
    return summary


def _group_digest_checks(rounds: dict[str, list[dict]], starts: dict[str, list[dict]]) -> tuple[list[int], list[int]]:
    """Epochs of groups whose members, having entered the round with the same parameters, left it with
    different ones (something applied partially: a bug), and epochs of groups whose members entered it with
    different parameters (a member from another group of the epoch before; the checksum vote resyncs it)."""
    after: dict[tuple, set[str]] = defaultdict(set)
    entered_states: dict[tuple, set[str]] = defaultdict(set)
    for name, rows in rounds.items():
        held = {s["epoch"]: s["params_sha256"] for s in starts.get(name, [])[-1:]}
        for r in rows:
            entered = held.get(r["epoch"])
            if r["outcome"] in ("averaged", "folded_late") and entered is not None:
                group = (r["epoch"], tuple(sorted(r["contributors"])))
                after[(*group, entered)].add(r["params_sha256"])
                entered_states[group].add(entered)
            held = {r["new_epoch"]: r["params_sha256"]}
    partial = sorted({k[0] for k, v in after.items() if len(v) > 1})
    mixed = sorted({k[0] for k, v in entered_states.items() if len(v) > 1})
    return partial, mixed


def summarize(name: str, out: Path, peers: int, minutes: float, churn_every_s: float, target_group_size: int,
              local_steps: int, step_seconds: float, synthetic_params: int, left: list, joins: list,
              memory: list[dict[str, int]], started: float) -> dict[str, Any]:
    rounds = {p.stem: _events(p, "round") for p in sorted(out.glob("p*.jsonl"))}
    starts = {p.stem: _events(p, "start") for p in sorted(out.glob("p*.jsonl"))}
    outcomes = Counter(r["outcome"] for rows in rounds.values() for r in rows)
    synced = ("averaged", "folded_late", "resynced", "solo")
    digests: dict[int, set[str]] = defaultdict(set)
    for rows in rounds.values():
        for r in rows:
            if r["outcome"] in synced and r["outcome"] != "solo":
                digests[r["new_epoch"]].add(r["params_sha256"])
    split_epochs = sorted(e for e, s in digests.items() if len(s) > 1)
    partial_groups, mixed_groups = _group_digest_checks(rounds, starts)
    # groups of one epoch: the distinct groups (by contributors) that averaged it
    groups_by_epoch: dict[int, set[tuple[str, ...]]] = defaultdict(set)
    group_sizes = []
    for rows in rounds.values():
        for r in rows:
            if r["outcome"] in ("averaged", "folded_late"):
                groups_by_epoch[r["epoch"]].add(tuple(sorted(r["contributors"])))
                group_sizes.append(r["group_size"])
    round_s = [b["time"] - a["time"] for rows in rounds.values() for a, b in zip(rows, rows[1:], strict=False)]
    downloads = sum(1 for rows in starts.values() for s in rows if str(s.get("how", "")).startswith("joined"))
    resyncs = outcomes.get("resynced", 0)
    max_epoch = max((r["new_epoch"] for rows in rounds.values() for r in rows), default=0)
    summary = dict(
        name=name, peers=peers, minutes=minutes, churn_every_s=churn_every_s, target_group_size=target_group_size,
        local_steps=local_steps, step_seconds=step_seconds, synthetic_params=synthetic_params,
        load_average=os.getloadavg(), peers_started=len(joins), peers_left=left,
        rounds_total=sum(outcomes.values()), outcomes=dict(outcomes),
        lost_fraction=outcomes.get("skipped", 0) / max(1, sum(outcomes.values())),
        median_round_s=statistics.median(round_s) if round_s else math.nan,
        p90_round_s=sorted(round_s)[int(0.9 * (len(round_s) - 1))] if round_s else math.nan,
        median_group=statistics.median(group_sizes) if group_sizes else 0, max_group=max(group_sizes, default=0),
        groups_per_epoch=statistics.mean(len(g) for g in groups_by_epoch.values()) if groups_by_epoch else 0,
        epochs_with_several_groups=sum(len(g) > 1 for g in groups_by_epoch.values()),
        epochs=max_epoch, joins_downloaded=downloads, resyncs=resyncs,
        epochs_with_differing_digests=split_epochs, groups_with_members_from_different_states=mixed_groups,
        groups_with_differing_digests=partial_groups, applied_partially=bool(partial_groups),
        peak_pss_gb=max((m["pss"] for m in memory), default=0) / 1e9,
        # per peer, in MB, at the last sample: the whole tree's PSS and each role's private (unique) memory
        last_memory_per_peer_mb={k: v / max(1, memory[-1]["trees"]) / 1e6 for k, v in memory[-1].items()
                                 if k != "trees"} if memory else {},
        wall_s=time.time() - started,
    )
    logger.info("%s: %s", name, json.dumps({k: v for k, v in summary.items() if k != "peers_left"}))
    return summary


SCENARIOS = {
    # name: (peers, target_group_size). Above the target at 16 peers, not 32: 32 peers and the other work on
    # this machine did not fit its 24 GB together (the memory guard stopped that run at 20 peers).
    "32-one-group": (32, 32),
    "16-one-group": (16, 32),
    "16-above-target": (16, 8),
}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for res in results:
        rows = {p.stem: _events(p, "round") for p in sorted((RESULTS / "swarm_scale" / res["name"]).glob("p*.jsonl"))}
        points = sorted((r["time"], r["group_size"]) for rs in rows.values() for r in rs
                        if r["outcome"] in ("averaged", "folded_late"))
        if points:
            t0 = points[0][0]
            axes[0].scatter([(t - t0) / 60 for t, _ in points], [g for _, g in points], s=6, label=res["name"])
        axes[1].bar(res["name"], res["outcomes"].get("averaged", 0), label="averaged" if res is results[0] else None,
                    color="tab:green")
        axes[1].bar(res["name"], res["outcomes"].get("skipped", 0), bottom=res["outcomes"].get("averaged", 0),
                    label="skipped" if res is results[0] else None, color="tab:red")
        axes[1].bar(res["name"], res["outcomes"].get("resynced", 0),
                    bottom=res["outcomes"].get("averaged", 0) + res["outcomes"].get("skipped", 0),
                    label="resynced" if res is results[0] else None, color="tab:blue")
    axes[0].set_xlabel("minutes")
    axes[0].set_ylabel("group size of an averaged round")
    axes[0].legend()
    axes[1].set_ylabel("peer-rounds")
    axes[1].legend()
    fig.suptitle("Averager-only peers with churn (group sizes include the start-up in waves)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["peer"]:
        return peer_main(argv[1:])
    parser = argparse.ArgumentParser(prog="swarm_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--peers", type=int, default=None, help="override the scenarios' peer count")
    parser.add_argument("--target-group-size", type=int, default=None)
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--churn-every-s", type=float, default=45.0)
    parser.add_argument("--local-steps", type=int, default=40)
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--synthetic-params", type=int, default=262_144)
    parser.add_argument("--reanalyze", action="store_true",
                        help="recompute the digest checks of the saved results from their logs, run nothing")
    args = parser.parse_args(argv)
    if args.reanalyze:
        path = RESULTS / "swarm_scale.json"
        results = json.loads(path.read_text())
        for res in results:
            out = RESULTS / "swarm_scale" / res["name"]
            rounds = {p.stem: _events(p, "round") for p in sorted(out.glob("p*.jsonl"))}
            starts = {p.stem: _events(p, "start") for p in sorted(out.glob("p*.jsonl"))}
            partial, mixed = _group_digest_checks(rounds, starts)
            res.update(groups_with_differing_digests=partial, groups_with_members_from_different_states=mixed,
                       applied_partially=bool(partial))
        path.write_text(json.dumps(results, indent=1))
        plot(results, RESULTS / "swarm_scale.png")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "swarm_scale.json"
    results = json.loads(path.read_text()) if path.exists() else []
    for name in args.scenarios:
        peers, target = SCENARIOS[name]
        peers = args.peers or peers
        target = args.target_group_size or target
        res = run_scenario(name, peers, args.minutes, args.churn_every_s, target, args.local_steps,
                           args.step_seconds, args.synthetic_params)
        results = [r for r in results if r["name"] != name] + [res]
        path.write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / "swarm_scale.png")
    for res in results:
        print(json.dumps({k: v for k, v in res.items() if k != "peers_left"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
