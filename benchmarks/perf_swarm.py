"""Swarm performance benchmarks on the emulated internet (benchmarks/testbed.py); run as root.

    sudo .venv/bin/python -m benchmarks.perf_swarm all        # or one of: allreduce utilization codecs
                                                               #            sparse joiner hetero scale
    sudo .venv/bin/python -m benchmarks.perf_swarm allreduce_profile  # where the all-reduce's time goes
    .venv/bin/python -m benchmarks.perf_report                # tables into BENCHMARKS.md, PNG plots

Each benchmark writes ``benchmarks/results/perf_<name>.json`` with the hardware and every measured value.
Every process is a real part: ``RoundAverager`` probes (benchmarks/perf_probe.py) or the real ``run_peer``,
each in its own network namespace behind a ``tc tbf`` rate limit. Ratios against the link's bound are the
headline numbers because they stay meaningful on a loaded machine; absolute seconds are noisy there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.testbed import (
    Testbed,
    TestbedError,
    install_signal_teardown,
    missing_requirements,
    start_swarm,
    wait_for_maddr,
    wait_peers,
)
from p2p_diloco.peer.runlog import read_records

logger = logging.getLogger("perf_swarm")
RESULTS = Path(__file__).resolve().parent / "results"
WORK = Path(os.environ.get("PERF_WORKDIR", "/tmp/p2p_diloco_perf"))
LAN_MBIT = 1000.0  # the "no bandwidth limit" runs: far above what two cores can push
PEER_BASE = ["--model", "tiny", "--batch-size", "4", "--seq-len", "64", "--inner-lr", "2e-3", "--warmup-steps", "5",
             "--eval-batches", "4", "--request-timeout-s", "2", "--next-chunk-timeout-s", "30",
             "--allreduce-timeout-s", "120", "--state-download-timeout-s", "120", "--progress-ttl-s", "60"]


def hardware() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return dict(machine=platform.machine(), cpu=model, cores=os.cpu_count(), load_avg_1m=os.getloadavg()[0],
                python=platform.python_version(), kernel=platform.release())


def save(name: str, payload: dict[str, Any], indent: int | None = 1) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = dict(payload, hardware=hardware(), finished_unix=time.time())
    (RESULTS / f"perf_{name}.json").write_text(json.dumps(payload, indent=indent))
    logger.info("wrote %s", RESULTS / f"perf_{name}.json")


def fresh(name: str) -> Path:
    """An empty output folder: run logs append, and a rerun must never read the last run's rows."""
    out = WORK / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def read_log(path: Path, kind: str = "round") -> list[dict[str, Any]]:
    return read_records(path, kind)


def _boot(bed: Testbed, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    proc = bed.popen(0, [sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", "--identity-path",
                         str(out / "bootstrap.id"), "--host-maddrs", f"/ip4/{bed.ip(0)}/tcp/0", "--use-relay",
                         "false"], stdout=open(out / "bootstrap.out", "w"), stderr=subprocess.STDOUT)
    return wait_for_maddr(out / "bootstrap.out", proc)


def _probe_group(bed: Testbed, out: Path, maddr: str, n: int, tag: str, *extra: str,
                 timeout: float = 400) -> list[dict[str, Any]]:
    return collect_probes(out, tag, spawn_probes(bed, out, maddr, n, tag, *extra), timeout)


def spawn_probes(bed: Testbed, out: Path, maddr: str, n: int, tag: str, *extra: str) -> list[subprocess.Popen]:
    """``n`` all-reduce probes (benchmarks/perf_probe.py), probe i in host i's namespace."""
    procs = []
    for i in range(1, n + 1):
        procs.append(bed.popen(i, [sys.executable, "-m", "benchmarks.perf_probe", "--ip", bed.ip(i),
                                   "--initial-peers", maddr, "--group", str(n), "--run-id", tag,
                                   "--out", str(out / f"{tag}-{i}.json"), *extra],
                               stdout=open(out / f"{tag}-{i}.out", "w"), stderr=subprocess.STDOUT,
                               env=dict(os.environ, OMP_NUM_THREADS="1")))
    return procs


def collect_probes(out: Path, tag: str, procs: list[subprocess.Popen], timeout: float = 400) -> list[dict[str, Any]]:
    """Wait for the probes of ``spawn_probes`` (bounded by ``timeout``) and read their results."""
    n = len(procs)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    results = []
    for i in range(1, n + 1):
        path = out / f"{tag}-{i}.json"
        if not path.exists():
            raise TestbedError(f"probe {tag}-{i} wrote no result: {(out / f'{tag}-{i}.out').read_text()[-1500:]}")
        results.append(json.loads(path.read_text()))
    return results


_SINK = ("import socket, sys, time\n"
         "s = socket.create_server((sys.argv[1], 9000)); c, _ = s.accept(); n = 0; t0 = None\n"
         "while (b := c.recv(1 << 20)):\n"
         "    t0 = t0 or time.monotonic(); n += len(b)\n"
         "print(n, time.monotonic() - t0)")
_SOURCE = ("import socket, sys, time\n"
           "for _ in range(200):\n"
           "    try:\n"
           "        c = socket.create_connection((sys.argv[1], 9000), timeout=2); break\n"
           "    except OSError: time.sleep(0.05)\n"
           "buf = b'x' * (1 << 20)\n"
           "for _ in range(int(sys.argv[2])): c.sendall(buf)\n"
           "c.close()")


def tcp_goodput(bed: Testbed, megabytes: int) -> float:
    """Payload bit/s of one plain TCP flow from host 1 to host 0, as a fraction of the link's rate.

    The best any protocol can do on this testbed: tbf counts Ethernet, IP and TCP headers, so payload
    reaches about 95% of the configured rate. Ratios to the bound above 1 / this value are protocol overhead.
    """
    sink = bed.popen(0, [sys.executable, "-c", _SINK, bed.ip(0)], stdout=subprocess.PIPE, text=True)
    source = bed.popen(1, [sys.executable, "-c", _SOURCE, bed.ip(0), str(megabytes)])
    source.wait(timeout=300)
    out, _ = sink.communicate(timeout=60)
    nbytes, seconds = out.split()
    return int(nbytes) * 8 / float(seconds) / (bed.rate_mbit * 1e6)


# ---------------------------------------------------------------------------------------------- benchmarks


def bench_allreduce(rounds: int = 3) -> None:
    """Measured all-reduce seconds / the bandwidth bound 2(N-1)/N * S * 8 / B, ~22 MB fp32 pseudo-gradient."""
    rows = []
    for n in (2, 4):
        for rate in (20.0, 100.0):
            with Testbed(n + 1, rate) as bed:
                out = fresh(f"allreduce-{n}-{int(rate)}")
                goodput = tcp_goodput(bed, int(rate * 1.25))  # about 10 s of traffic
                maddr = _boot(bed, out)
                peers = _probe_group(bed, out, maddr, n, f"ar{n}x{int(rate)}", "--rounds", str(rounds))
            nbytes = peers[0]["nbytes"]
            bound = 2 * (n - 1) / n * nbytes * 8 / (rate * 1e6)
            per_round = [max(p["rounds"][r]["allreduce_seconds"] for p in peers) for r in range(rounds)]
            ok = all(p["rounds"][r]["outcome"] == "averaged" for p in peers for r in range(rounds))
            rows.append(dict(peers=n, rate_mbit=rate, nbytes=nbytes, bound_s=bound, seconds=per_round,
                             median_s=statistics.median(per_round), ratio=statistics.median(per_round) / bound,
                             all_averaged=ok, bytes_sent=[p["rounds"][-1]["bytes_sent"] for p in peers],
                             outcomes=[[r["outcome"] for r in p["rounds"]] for p in peers],
                             tcp_goodput_fraction=goodput, floor_ratio=1 / goodput))
            logger.info("all-reduce N=%d %g Mbit/s: %s", n, rate, rows[-1])
    save("allreduce", dict(rounds=rounds, rows=rows, netem=False))


def _utilization_run(mode: str, rate: float, steps: int, rounds: int) -> dict[str, Any]:
    out = fresh(f"util-{mode}")
    # With eager overlap the all-reduce runs while both cores train flat out, so the averager process answers
    # slowly: a follower that waits only 2 s (PEER_BASE) for its leader gives up while the leader counts it in,
    # and that round fails (measured: the first eager all-reduce lost, and the three after it not sent).
    args = [*PEER_BASE, "--run-id", f"util-{mode}", "--overlap", mode, "--local-steps", str(steps),
            "--min-local-steps", str(steps), "--max-rounds", str(rounds), "--eval-every", "0",
            "--matchmaking-time-s", "5", "--matchmaking-timeout-s", "60", "--request-timeout-s", "4"]
    with Testbed(3, rate) as bed:
        procs = start_swarm(bed, out, 2, args)
        codes = wait_peers(procs, 600)
    per_peer = []
    for name in ("peer1", "peer2"):
        rows = read_log(out / f"{name}.jsonl")
        starts = read_log(out / f"{name}.jsonl", "eval")  # the initial evaluation ends right before round 0
        times = [starts[0]["time"]] + [r["time"] for r in rows] if starts else [r["time"] for r in rows]
        util = [r["inner_seconds"] / (t1 - t0) for r, t0, t1 in zip(rows, times, times[1:], strict=False)]
        per_peer.append(dict(outcomes=[r["outcome"] for r in rows], utilization=util,
                             inner_s=[r["inner_seconds"] for r in rows], blocked_s=[r["blocked_seconds"] for r in rows],
                             allreduce_s=[r["allreduce_seconds"] for r in rows]))
    # Round 0 has no previous all-reduce to hide, and eager's last all-reduce finishes after training ends.
    steady = [u for p in per_peer for u in p["utilization"][1:]]
    return dict(mode=mode, codes=codes, peers=per_peer, median_utilization=statistics.median(steady) if steady
                else float("nan"))


def bench_utilization(rate: float = 10.0, steps: int = 400, rounds: int = 5) -> None:
    """Compute utilization (inner seconds / wall seconds per round), blocking against eager, 2 peers.

    ``steps`` sets the inner phase to about twice the blocking all-reduce round on this machine when idle
    (blocking then costs about a third of a round); a loaded machine trains slower and blocking costs less.
    """
    runs = [_utilization_run(mode, rate, steps, rounds) for mode in ("none", "eager")]
    save("utilization", dict(rate_mbit=rate, local_steps=steps, rounds=rounds, runs=runs))


def bench_codecs(rate: float = 100.0) -> None:
    """Bytes each peer sends per round with every codec (tiny model's pseudo-gradient, 2 peers)."""
    rows = []
    with Testbed(3, rate) as bed:
        out = fresh("codecs")
        maddr = _boot(bed, out)
        for codec in ("none", "fp16", "int8", "4bit"):
            peers = _probe_group(bed, out, maddr, 2, f"codec-{codec}", "--model", "tiny", "--rounds", "2",
                                 "--compression", codec)
            sent = [r["bytes_sent"] for p in peers for r in p["rounds"]]
            rows.append(dict(codec=codec, numel=peers[0]["numel"], fp32_bytes=peers[0]["nbytes"],
                             bytes_sent_per_round=statistics.median(sent), samples=sent))
    save("codecs", dict(rate_mbit=rate, rows=rows))


def bench_sparse(rate: float = 20.0, sizes: tuple[int, ...] = (2, 4, 8), rounds: int = 3) -> None:
    """All-reduce seconds and bytes per direction per peer, 4-bit against top-k (64 of 4096 at 2 bits), both with
    error feedback, for groups of ``sizes`` at ``rate`` Mbit/s: the default 5.5M-value pseudo-gradient (22 MB
    in fp32). A round's seconds are its slowest member's all-reduce; medians over the rounds."""
    rows = []
    for n in sizes:
        for codec in ("4bit", "topk"):
            with Testbed(n + 1, rate) as bed:
                out = fresh(f"sparse-{n}-{codec}")
                maddr = _boot(bed, out)
                peers = _probe_group(bed, out, maddr, n, f"sp{n}{codec}", "--compression", codec, "--error-feedback",
                                     "--rounds", str(rounds))
            fp32 = peers[0]["nbytes"]
            per_round = [max(p["rounds"][r]["allreduce_seconds"] for p in peers) for r in range(rounds)]
            sent = [r["bytes_sent"] for p in peers for r in p["rounds"]]
            received = [r["bytes_received"] for p in peers for r in p["rounds"]]
            rows.append(dict(peers=n, codec=codec, rate_mbit=rate, numel=peers[0]["numel"], fp32_bytes=fp32,
                             allreduce_s=per_round, median_s=statistics.median(per_round),
                             sent_median=statistics.median(sent), received_median=statistics.median(received),
                             sent_fraction_of_fp32=statistics.median(sent) / fp32,
                             received_fraction_of_fp32=statistics.median(received) / fp32,
                             outcomes=[[r["outcome"] for r in p["rounds"]] for p in peers]))
            logger.info("sparse N=%d %s: %s", n, codec, {k: v for k, v in rows[-1].items() if k != "outcomes"})
    save("sparse", dict(rate_mbit=rate, rounds=rounds, rows=rows))


def bench_joiner(rate: float = 2.0, steps: int = 900, name: str = "joiner", join_at: int = 2) -> None:
    """A third peer joins a running 2-peer swarm: spawn to ready (state loaded) and spawn to its first
    contribution to an average, against the state's transfer bound.

    2 Mbit/s makes the state transfer (6.7 MB, 27 s) the larger part of joining, as it is for real models on
    home links; at higher rates the start-up of Python, torch and the p2p daemon (5-20 s here) dominates and
    the ratio says more about imports than about the download. ``steps`` makes a round (about 40 s) outlast
    the download, DiLoCo's regime: when a download takes longer than a round the joiner arrives behind and
    downloads again (measured and discussed in BENCHMARKS.md). The running peers send int8, so their
    all-reduce leaves the donor's uplink to the download most of the time. The joiner starts once the swarm
    reached epoch ``join_at``: at epoch 1 its own initial state (every peer starts from the same seeded one)
    is the swarm's state of epoch 0, so it fetches only that round's update (``swarm.catchup``), half a
    state; from epoch 2 on it must download the whole state, as a joiner of any running swarm does.
    """
    out = fresh(name)
    args = [*PEER_BASE, "--run-id", name, "--local-steps", str(steps), "--min-local-steps", "5",
            "--eval-every", "0", "--matchmaking-time-s", "10", "--matchmaking-timeout-s", "60",
            "--compression", "int8"]
    with Testbed(4, rate) as bed:
        spawned = time.time()
        procs = start_swarm(bed, out, 2, [*args, "--max-rounds", "60"])  # stopped once the joiner is done
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(r["new_epoch"] >= join_at
                                                      for r in read_log(out / "peer1.jsonl")):
            time.sleep(0.5)
        maddr = wait_for_maddr(out / "bootstrap.out", procs["bootstrap"])
        join_spawned = time.time()
        procs["joiner"] = bed.popen(3, [sys.executable, "-m", "p2p_diloco.cli.run_peer", "--host-maddrs",
                                        f"/ip4/{bed.ip(3)}/tcp/0", "--initial-peers", maddr, "--use-relay", "false",
                                        "--log-file", str(out / "joiner.jsonl"), *args, "--max-rounds", "3"],
                                    stdout=open(out / "joiner.out", "w"), stderr=subprocess.STDOUT,
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
        codes = wait_peers({"joiner": procs["joiner"]}, 400)
        for peer in ("peer1", "peer2"):
            procs[peer].terminate()
        codes.update(wait_peers({n: procs[n] for n in ("peer1", "peer2")}, 60))
    fresh_ready = [read_log(out / f"peer{i}.jsonl", "start")[0]["time"] - spawned for i in (1, 2)]
    start = read_log(out / "joiner.jsonl", "start")
    rounds = read_log(out / "joiner.jsonl")
    # The state is fp32 parameters plus fp32 outer momentum; run_peer prints the parameter count.
    params = int(re.search(r"([\d,]+)-parameter", (out / "peer1.out").read_text()).group(1).replace(",", ""))
    state_bytes = 2 * params * 4
    bound = state_bytes * 8 / (rate * 1e6)
    ready = start[0]["time"] - join_spawned if start else float("nan")
    first = next((r["time"] - join_spawned for r in rounds if r["outcome"] in ("averaged", "folded_late")
                  and r["group_size"] >= 2), float("nan"))
    log = (out / "joiner.out").read_text(errors="replace")
    synced = [r for r in rounds if r["outcome"] in ("averaged", "folded_late") and r["group_size"] >= 2]
    swarm_rounds = read_log(out / "peer1.jsonl")
    # The first round the swarm ended after the joiner was ready: the earliest it could contribute in. The
    # wait for it is the swarm's round length, not the joiner's doing; its work was in it when the joiner's
    # first contribution ended within seconds of it (both log the same all-reduce).
    after = next((r["time"] for r in swarm_rounds if start and r["time"] > start[0]["time"]), float("nan"))
    first_abs = synced[0]["time"] if synced else float("nan")
    save(name, dict(rate_mbit=rate, local_steps=steps, join_at_epoch=join_at, state_bytes=state_bytes, bound_s=bound, how=start[0]["how"] if start else "",
                    ready_s=ready, fresh_startup_s=fresh_ready, first_contribution_s=first,
                    transfer_s=ready - statistics.median(fresh_ready), codes=codes,
                    joiner_outcomes=[r["outcome"] for r in rounds],
                    # rounds the joiner ran before the one that carried its work (0: its first round did)
                    rounds_before_contribution=rounds.index(synced[0]) if synced else None,
                    donors_used=[int(n) for n in re.findall(r"Loaded state of epoch \d+ from (\d+) donor", log)],
                    caught_up=log.count("Applied the round of epoch"),
                    first_swarm_round_after_ready_s=after - join_spawned,
                    contributed_to_it=bool(abs(first_abs - after) < 15.0),
                    swarm_round_s=[b["time"] - a["time"] for a, b in itertools.pairwise(swarm_rounds)]))


def _hetero_run(mode: str, slow_s: float, rounds: int, steps: int) -> dict[str, Any]:
    out = fresh(f"hetero-{mode}")
    # DyLU rounds are shorter, so it gets twice the rounds: the comparison is the time to reach synchronous
    # waiting's final eval loss, and with equal rounds DyLU would stop before it had the chance.
    rounds = rounds if mode == "sync" else 2 * rounds
    common = [*PEER_BASE, "--run-id", f"het-{mode}", "--local-steps", str(steps), "--max-rounds", str(rounds)]
    if mode == "sync":
        # Synchronous waiting: everyone runs H steps, and matchmaking holds the group open until all three are in.
        extra = ["--min-local-steps", str(steps), "--target-group-size", "3", "--matchmaking-time-s", "60",
                 "--matchmaking-timeout-s", "120"]
    else:
        extra = ["--min-local-steps", "5", "--matchmaking-time-s", "3", "--matchmaking-timeout-s", "30"]
    slow = ",".join(f"slow_steps@{e}={slow_s}" for e in range(rounds + 8))
    with Testbed(4, LAN_MBIT) as bed:
        procs = start_swarm(bed, out, 3, [*common, *extra], peer_env={3: {"P2P_DILOCO_FAULTS": slow}})
        codes = wait_peers(procs, 600)
    return dict(hetero_summary(out), mode=mode, local_steps=steps, codes=codes)


def hetero_summary(out: Path, segment: int = -1) -> dict[str, Any]:
    """Curves and rates of one run from its logs; ``segment`` picks a run when several appended to one log.

    Time 0 is the first peer's ``start`` event (all start-up excluded, identically for both modes). Wall time
    ends when the last fast peer (1 or 2) finished, and tokens count the rounds every peer completed by then:
    a slow peer's last round, started after the others stopped, waits out matchmaking alone and says nothing
    about the swarm.
    """
    logs = {}
    for i in (1, 2, 3):
        path = out / f"peer{i}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        cuts = [k for k, r in enumerate(rows) if r["event"] == "start"]
        cuts.append(len(rows))
        index = segment if segment >= 0 else len(cuts) - 2
        logs[i] = rows[cuts[index]:cuts[index + 1]]
    origin = min(rows[0]["time"] for rows in logs.values())
    peers = {}
    for i, rows in logs.items():
        rounds = [r for r in rows if r["event"] == "round"]
        peers[f"peer{i}"] = dict(
            curve=[(r["time"] - origin, r["eval_loss"]) for r in rows
                   if r["event"] in ("eval", "round") and r.get("eval_loss") is not None],
            steps=[r["inner_steps"] for r in rounds], inner_s=[r["inner_seconds"] for r in rounds],
            outcomes=[r["outcome"] for r in rounds], end=rounds[-1]["time"] - origin if rounds else float("nan"),
            round_end=[r["time"] - origin for r in rounds])
    wall = max(peers["peer1"]["end"], peers["peer2"]["end"])
    tokens = sum(n for p in peers.values() for n, t in zip(p["steps"], p["round_end"], strict=True) if t <= wall) * 4 * 64
    speed = [sum(p["steps"]) / sum(p["inner_s"]) for p in peers.values()]
    return dict(peers=peers, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall, steps_per_s=speed,
                slowdown=max(speed[:2]) / speed[2])


def bench_hetero(slow_s: float = 0.12, rounds: int = 5, steps: int = 100, reps: int = 1) -> None:
    """One peer ~2.5x slower: synchronous waiting against DyLU plus delayed folding.

    Repetitions accumulate in the JSON (``HETERO_KEEP=1`` keeps the earlier ones), so a median can be taken
    over runs made at different times on a shared machine.
    """
    path = RESULTS / "perf_hetero.json"
    runs = json.loads(path.read_text())["runs"] if os.environ.get("HETERO_KEEP") and path.exists() else []
    first = 1 + max((r.get("rep", 0) for r in runs), default=-1)
    for rep in range(first, first + reps):
        runs += [dict(_hetero_run(mode, slow_s, rounds, steps), rep=rep) for mode in ("sync", "dylu")]
    save("hetero", dict(slow_step_delay_s=slow_s, rounds=rounds, runs=runs))


def bench_scale(sizes: tuple[int, ...] = (2, 4, 8), rounds: int = 3, steps: int = 20) -> None:
    """The most training peers this machine runs in one swarm: round time against the number of peers."""
    rows = []
    for n in sizes:
        out = fresh(f"scale-{n}")
        args = [*PEER_BASE, "--run-id", f"scale{n}", "--local-steps", str(steps), "--min-local-steps", "5",
                "--max-rounds", str(rounds), "--eval-every", "0", "--matchmaking-time-s", "3",
                "--matchmaking-timeout-s", "90", "--startup-timeout-s", "60"]
        with Testbed(n + 1, LAN_MBIT) as bed:
            procs = start_swarm(bed, out, n, args)
            codes = wait_peers(procs, 420)
        logs = [read_log(out / f"peer{i}.jsonl") for i in range(1, n + 1)]
        groups = [r["group_size"] for rows in logs for r in rows if r["outcome"] in ("averaged", "folded_late")]
        round_s = [b["time"] - a["time"] for rows in logs for a, b in zip(rows, rows[1:], strict=False)]
        rows.append(dict(peers=n, codes=codes, finished=sum(c == 0 for c in codes.values()),
                         median_round_s=statistics.median(round_s) if round_s else float("nan"),
                         max_group=max(groups, default=0), median_group=statistics.median(groups) if groups else 0,
                         outcomes=[[r["outcome"] for r in rows] for rows in logs]))
        logger.info("scale %d: %s", n, rows[-1])
    save("scale", dict(rounds=rounds, local_steps=steps, rows=rows))


BENCHES = dict(allreduce=bench_allreduce, utilization=bench_utilization, codecs=bench_codecs, sparse=bench_sparse,
               joiner=bench_joiner, hetero=bench_hetero, scale=bench_scale,
               # 1 Mbit/s with shorter rounds (500 steps), meant to make the state download (54 s bound)
               # outlast a round so that the joiner must catch up (swarm.catchup); check swarm_round_s
               joiner_1mbit=lambda: bench_joiner(rate=1.0, steps=500, name="joiner_1mbit"))


def _allreduce_profile() -> None:
    from benchmarks.allreduce_profile import bench_allreduce_profile  # imports this module

    bench_allreduce_profile()


def _p2p_mesh() -> None:
    from benchmarks.p2p_mesh import bench_p2p_mesh  # imports this module

    bench_p2p_mesh()


# Diagnostics: run by name only, not by "all" (they explain a benchmark's number rather than add one).
DIAGNOSTICS = dict(allreduce_profile=_allreduce_profile, p2p_mesh=_p2p_mesh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="perf_swarm", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", choices=[*BENCHES, *DIAGNOSTICS, "all"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = missing_requirements()
    if problem:
        print(f"perf_swarm: cannot run: {problem}", file=sys.stderr)
        return 1
    install_signal_teardown()
    names = list(BENCHES) if "all" in args.names else args.names
    try:
        for name in names:
            began = time.monotonic()
            {**BENCHES, **DIAGNOSTICS}[name]()
            took = time.monotonic() - began
            logger.info("%s took %.0f s", name, took)
            path = RESULTS / f"perf_{name}.json"
            # diagnostics keep sample series: one line, not one line per number
            path.write_text(json.dumps(dict(json.loads(path.read_text()), took_s=took),
                                       indent=None if name in DIAGNOSTICS else 1))
    except KeyboardInterrupt:
        print("perf_swarm: interrupted; namespaces removed", file=sys.stderr)
        return 130
    except TestbedError as e:
        print(f"perf_swarm: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
