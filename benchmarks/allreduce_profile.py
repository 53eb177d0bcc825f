"""Profile of the all-reduce on the testbed: link-bound, CPU-bound and waiting time, per peer and round.

    sudo .venv/bin/python -m benchmarks.perf_swarm allreduce_profile    # N=4 at 20 and 100 Mbit/s, 3 rounds
    .venv/bin/python -m benchmarks.perf_report                          # subsection + PNG

The same real ``RoundAverager`` probes as the ``allreduce`` benchmark (one per namespace), watched by
``link_profile.Sampler`` from this process every 50 ms. Each probe reports when each round's ``average``
returned (monotonic clock, shared by every process of the machine) and how long its all-reduce took; the
all-reduce window of a peer is ``[ended - allreduce_seconds, ended]`` (a few ms late: the host's copy of the
result comes after the averager process stopped the clock), the group's window spans its members' windows.

Per peer and round: the window, the fraction of it each uplink and downlink ran near its rate (busy),
partly, or idle, where the idle time lies (before the first busy sample, in the middle, after the last),
and the CPU seconds of the peer's process tree by role. Per round: the peers' CPU seconds / wall seconds
against the machine's cores, and the window split into link-bound (some link of the group ran near its
rate), CPU-bound (no link did and the machine's cores were saturated) and neither (waiting).
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.link_profile import (
    BUSY_FRACTION,
    IDLE_FRACTION,
    Sampler,
    cpu_overlap,
    cpu_seconds,
    link_activity,
)
from benchmarks.perf_swarm import _boot, collect_probes, fresh, save, spawn_probes
from benchmarks.testbed import Testbed

logger = logging.getLogger("allreduce_profile")
INTERVAL_S = 0.05


_MESH = """
import socket, sys, threading, time
me, start_at, nbytes, others = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
server = socket.create_server((me, 9001), backlog=len(others))
ends = []
def serve(conn):
    while conn.recv(1 << 20):
        pass
    ends.append(time.monotonic())
def accept():
    for _ in others:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,)).start()
def send(ip):
    for _ in range(400):
        try:
            conn = socket.create_connection((ip, 9001), timeout=2)
            break
        except OSError:
            time.sleep(0.05)
    conn.settimeout(None)
    time.sleep(max(0.0, start_at - time.monotonic()))
    buf, left = bytes(1 << 20), nbytes
    while left > 0:
        left -= conn.send(buf[:min(left, 1 << 20)])
    conn.close()
threads = [threading.Thread(target=accept)] + [threading.Thread(target=send, args=(ip,)) for ip in others]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=600)
while len(ends) < len(others) and time.monotonic() < start_at + 600:
    time.sleep(0.01)
print(max(ends))
"""


def tcp_mesh(bed: Testbed, n: int, nbytes_per_flow: int) -> float:
    """Seconds for every host 1..n to send ``nbytes_per_flow`` to every other one over plain TCP at once.

    The all-reduce's traffic pattern without the all-reduce: n-1 flows leave each uplink and n-1 enter each
    downlink, every flow through two rate limits, as parts and replies do. The plain single-flow floor
    (perf_swarm ``tcp_goodput``) has one flow per link; this is the floor for a mesh.
    """
    start_at = time.monotonic() + 3.0
    procs = [bed.popen(i, [sys.executable, "-c", _MESH, bed.ip(i), str(start_at), str(nbytes_per_flow),
                           *[bed.ip(j) for j in range(1, n + 1) if j != i]], stdout=subprocess.PIPE, text=True)
             for i in range(1, n + 1)]
    ends = [float(p.communicate(timeout=600)[0].split()[-1]) for p in procs]
    return max(ends) - start_at


def _tc_stats(bed: Testbed, n: int) -> dict[str, str]:
    """``tc -s qdisc`` of every peer's uplink and downlink after the run (drops, overlimits)."""
    stats = {}
    for i in range(1, n + 1):
        for name, ns, dev in ((f"peer{i}_up", bed.ns(i), "eth0"), (f"peer{i}_down", bed.bridge_ns, f"h{i}")):
            proc = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
                                  capture_output=True, text=True, timeout=10)
            stats[name] = " ".join(proc.stdout.split())
    return stats


def _series_in(t: list[float], values: list[float], begin: float, end: float, scale: float
               ) -> list[list[float]]:
    """``[offset from begin, rate]`` per sample interval inside [begin - 0.5, end + 0.5], for plots."""
    out = []
    for t0, t1, v0, v1 in zip(t, t[1:], values, values[1:], strict=False):
        if t1 > t0 and begin - 0.5 <= t0 and t1 <= end + 0.5:
            out.append([round(t1 - begin, 3), round((v1 - v0) / (t1 - t0) * scale, 3)])
    return out


def analyse(sampler: Sampler, peers: list[dict[str, Any]], rate_mbit: float, cores: int) -> list[dict[str, Any]]:
    rate_bytes = rate_mbit * 1e6 / 8
    rounds = []
    for r in range(len(peers[0]["rounds"])):
        windows = [(p["rounds"][r]["ended_monotonic"] - p["rounds"][r]["allreduce_seconds"],
                    p["rounds"][r]["ended_monotonic"]) for p in peers]
        begin, end = min(w[0] for w in windows), max(w[1] for w in windows)
        per_peer = []
        for k, (series, (b, e)) in enumerate(zip(sampler.series, windows, strict=True)):
            roles = sorted({role for sample in series.cpu for role in sample})
            cpu = {role: cpu_seconds(series.t, [s.get(role, 0.0) for s in series.cpu], b, e) for role in roles}
            per_peer.append(dict(
                peer=k + 1, window_s=e - b, begin_offset_s=b - begin, outcome=peers[k]["rounds"][r]["outcome"],
                up=link_activity(series.t, series.tx, rate_bytes, b, e),
                down=link_activity(series.t, series.rx, rate_bytes, b, e),
                cpu_s=sum(cpu.values()), cpu_s_by_role=cpu,
                timeline=dict(
                    up_mbit=_series_in(series.t, series.tx, begin, end, 8e-6),
                    down_mbit=_series_in(series.t, series.rx, begin, end, 8e-6),
                    cpu_cores=_series_in(series.t, [sum(s.values()) for s in series.cpu], begin, end, 1.0))))
        wall = end - begin
        peers_cpu = sum(cpu_seconds(s.t, [sum(x.values()) for x in s.cpu], begin, end) for s in sampler.series)
        machine_cpu = cpu_seconds(sampler.machine_t, sampler.machine_busy, begin, end)
        links = [(s.t, s.tx) for s in sampler.series] + [(s.t, s.rx) for s in sampler.series]
        split = cpu_overlap(links, rate_bytes, sampler.machine_t, sampler.machine_busy, cores, begin, end)
        rounds.append(dict(
            round=r, group_window_s=wall, slowest_allreduce_s=max(e - b for b, e in windows),
            peers_cpu_s=peers_cpu, peers_cores=peers_cpu / wall, machine_cpu_s=machine_cpu,
            machine_cores=machine_cpu / wall, cores=cores, **split, peers=per_peer,
            machine_cores_timeline=_series_in(sampler.machine_t, sampler.machine_busy, begin, end, 1.0)))
    return rounds


def run_case(n: int, rate: float, rounds: int, variant: str = "default", extra: tuple[str, ...] = ()
             ) -> dict[str, Any]:
    tag = f"arprof{n}x{int(rate)}{variant.replace(' ', '')}"
    with Testbed(n + 1, rate) as bed:
        out = fresh(f"allreduce-profile-{n}-{int(rate)}-{variant.replace(' ', '')}")
        maddr = _boot(bed, out)
        load_before = os.getloadavg()[0]
        procs = spawn_probes(bed, out, maddr, n, tag, "--rounds", str(rounds), *extra)
        sampler = Sampler([p.pid for p in procs], INTERVAL_S).start()
        try:
            peers = collect_probes(out, tag, procs, timeout=400)
        finally:
            sampler.stop()
        tc = _tc_stats(bed, n)
        nbytes = peers[0]["nbytes"]
        bound = 2 * (n - 1) / n * nbytes * 8 / (rate * 1e6)
        # each uplink carries 2(n-1)/n x S: (n-1) flows of 2 S / n each
        mesh_s = tcp_mesh(bed, n, int(2 * nbytes / n)) if variant == "default" else None
    analysed = analyse(sampler, peers, rate, os.cpu_count() or 1)
    samples = len(sampler.machine_t)
    span = sampler.machine_t[-1] - sampler.machine_t[0] if samples > 1 else float("nan")
    case = dict(variant=variant, probe_args=list(extra), peers=n, rate_mbit=rate, nbytes=nbytes, bound_s=bound,
                ratios=[r["slowest_allreduce_s"] / bound for r in analysed],
                tcp_mesh_s=mesh_s, tcp_mesh_ratio=None if mesh_s is None else mesh_s / bound,
                outcomes=[[x["outcome"] for x in p["rounds"]] for p in peers],
                load_avg_1m_before=load_before, load_avg_1m_after=os.getloadavg()[0],
                sampler=dict(interval_s=INTERVAL_S, samples=samples, span_s=span,
                             mean_interval_s=span / max(1, samples - 1), cpu_s=sampler.sampler_cpu_s),
                tc_after=tc, rounds=analysed)
    for r in analysed:
        logger.info("%s N=%d %g Mbit/s round %d: %.2f s (%.2fx bound), peers %.2f cores, machine %.2f cores; "
                    "link-bound %.2f s, CPU-bound %.2f s, neither %.2f s; uplink utilization %s",
                    variant, n, rate, r["round"], r["slowest_allreduce_s"], r["slowest_allreduce_s"] / bound, r["peers_cores"],
                    r["machine_cores"], r["link_bound_s"], r["cpu_bound_s"], r["neither_s"],
                    [round(p["up"]["utilization"], 2) for p in r["peers"]])
        logger.info("seconds with k of %d links busy: %s", 2 * n, [round(x, 2) for x in r["busy_links_s"]])
    return case


VARIANTS = {"default": (), "prefetch 8": ("--prefetch", "8")}
"""The runner as it is, and one experiment: deeper prefetch of parts (see perf_probe ``--prefetch``)."""


def keep_one_timeline(case: dict[str, Any]) -> None:
    """Drop the per-sample timelines of every round but the median one (the plot's), to keep the JSON small."""
    ordered = sorted(case["rounds"], key=lambda r: r["slowest_allreduce_s"])
    keep = ordered[len(ordered) // 2]["round"]
    case["timeline_round"] = keep
    for r in case["rounds"]:
        if r["round"] != keep:
            r.pop("machine_cores_timeline", None)
            for p in r["peers"]:
                p.pop("timeline", None)


def bench_allreduce_profile(n: int = 4, rates: tuple[float, ...] = (20.0, 100.0), rounds: int = 3) -> None:
    cases = [run_case(n, rate, rounds, variant, extra) for variant, extra in VARIANTS.items() for rate in rates]
    for case in cases:
        keep_one_timeline(case)
    save("allreduce_profile", dict(rounds=rounds, interval_s=INTERVAL_S, busy_fraction=BUSY_FRACTION,
                                   idle_fraction=IDLE_FRACTION, cases=cases,
                                   median_ratio={f"{c['variant']} {c['rate_mbit']:g}": statistics.median(c["ratios"])
                                                 for c in cases}), indent=None)
