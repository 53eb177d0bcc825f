"""Where the time of an all-reduce goes: link counters and CPU seconds sampled while testbed peers run.

``Sampler`` runs in the benchmark's own process (a thread) and reads, every ``interval_s``:

- each peer's ``eth0`` byte counters from ``/proc/<pid>/net/dev`` of a process inside that peer's namespace
  (the file shows the namespace of the process, so no ``ip netns exec`` per sample). ``eth0`` sits behind
  the upload ``tbf`` and in front of the download ``tbf``, so tx counts what the uplink let through and rx
  what the downlink delivered, Ethernet headers included, as ``tbf`` counts them;
- the CPU seconds (user + system) of each peer's whole process tree (the probe, its DHT and averager
  processes, the p2p daemon), by role;
- the machine's busy CPU seconds from ``/proc/stat`` (every process, ours or not).

``link_activity`` and ``cpu_overlap`` turn the series into busy / idle seconds inside a window; they are
plain functions of the samples, so they are unit-tested on synthetic series (tests/unit/test_link_profile.py).

Choosing ``interval_s``: 50 ms is 125 KB at 20 Mbit/s, several ``tbf`` buckets (10 ms each), so a sample of
a saturated link reads close to the rate; much shorter intervals alias with the bucket refills, and longer
ones blur the gaps between parts (a 512 KB part takes 0.2 s at 20 Mbit/s, 0.04 s at 100).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

BUSY_FRACTION = 0.8
"""A sample interval counts as busy when the link carried at least this fraction of its rate."""
IDLE_FRACTION = 0.1
"""... and idle below this fraction; in between it is partly used."""
MIN_GAP_S = 0.2
"""Idle stretches at least this long are listed one by one (shorter ones only count in ``idle_s``)."""


def net_dev_bytes(pid: int, iface: str = "eth0") -> tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` of ``iface`` in the network namespace of process ``pid``."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise LookupError(f"no interface {iface} in the namespace of process {pid}")


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _role(proc: psutil.Process, root: psutil.Process) -> str:
    """p2pd, main (the probe), dht (the python child that owns the daemon) or averager (the other one)."""
    if proc.pid == root.pid:
        return "main"
    if "p2pd" in proc.name():
        return "p2pd"
    return "dht" if any("p2pd" in c.name() for c in proc.children()) else "averager"


@dataclass
class Series:
    """One peer's samples: times (monotonic s), cumulative rx/tx bytes, cumulative CPU s by role."""

    t: list[float] = field(default_factory=list)
    rx: list[int] = field(default_factory=list)
    tx: list[int] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)


class Sampler:
    """Samples peers' links and process trees and the machine's CPU in a thread, until ``stop()``.

    ``pids`` are the peers' root processes (inside their namespaces). CPU seconds of a process that exited
    between two samples are lost; probes keep every process alive for the whole run.
    """

    def __init__(self, pids: Sequence[int], interval_s: float = 0.05, tree_refresh_s: float = 1.0):
        self.pids, self.interval_s, self.tree_refresh_s = list(pids), interval_s, tree_refresh_s
        self.series = [Series() for _ in self.pids]
        self.machine_t: list[float] = []
        self.machine_busy: list[float] = []
        self.sampler_cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)
        self._trees: list[list[tuple[str, psutil.Process]]] = [[] for _ in self.pids]
        # per pid: its role and last CPU seconds, kept after it exits
        self._seen: list[dict[int, tuple[str, float]]] = [{} for _ in self.pids]

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _refresh_trees(self) -> None:
        for k, pid in enumerate(self.pids):
            try:
                root = psutil.Process(pid)
                self._trees[k] = [(_role(p, root), p) for p in [root, *root.children(recursive=True)]]
            except psutil.Error:
                self._trees[k] = []

    def _cpu(self, k: int) -> dict[str, float]:
        seen = self._seen[k]
        for role, proc in self._trees[k]:
            try:
                times = proc.cpu_times()
                seen[proc.pid] = (role, times.user + times.system)
            except psutil.Error:
                pass  # exited: its last reading stays in ``seen``
        by_role: dict[str, float] = {}
        for role, secs in seen.values():
            by_role[role] = by_role.get(role, 0.0) + secs
        return by_role

    def _run(self) -> None:
        own0 = time.thread_time()
        next_tree = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_tree:
                self._refresh_trees()
                next_tree = now + self.tree_refresh_s
            for k, pid in enumerate(self.pids):
                try:
                    rx, tx = net_dev_bytes(pid)
                except (OSError, LookupError):
                    continue
                s = self.series[k]
                s.t.append(time.monotonic())
                s.rx.append(rx)
                s.tx.append(tx)
                s.cpu.append(self._cpu(k))
            self.machine_t.append(time.monotonic())
            self.machine_busy.append(machine_busy_s())
            self.sampler_cpu_s = time.thread_time() - own0
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - now)))


# ---------------------------------------------------------------------------------------------- analysis


def _clip(t: Sequence[float], values: Sequence[float], begin: float, end: float
          ) -> tuple[list[float], list[float]]:
    """Samples inside [begin, end], with the cumulative value interpolated at both ends."""

    def at(x: float) -> float:
        i = bisect.bisect_left(t, x)
        if i <= 0:
            return float(values[0])
        if i >= len(t):
            return float(values[-1])
        t0, t1 = t[i - 1], t[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (x - t0) / (t1 - t0) if t1 > t0 else float(values[i])

    inside = [(x, float(v)) for x, v in zip(t, values, strict=True) if begin < x < end]
    return [begin, *(x for x, _ in inside), end], [at(begin), *(v for _, v in inside), at(end)]


def link_activity(t: Sequence[float], cum_bytes: Sequence[float], rate_bytes_s: float, begin: float, end: float,
                  busy_fraction: float = BUSY_FRACTION, idle_fraction: float = IDLE_FRACTION,
                  min_gap_s: float = MIN_GAP_S) -> dict[str, Any]:
    """How busy one link direction was in [begin, end], from its cumulative byte counter.

    Returns the window's length, bytes carried, ``utilization`` (bytes / (rate x window): 1.0 means the link
    ran flat out throughout), seconds busy / partly used / idle (see ``BUSY_FRACTION``, ``IDLE_FRACTION``),
    the idle seconds before the link first got busy (``idle_head_s``), after it was last busy
    (``idle_tail_s``) and in between (``idle_middle_s``), and the idle ``gaps`` of at least ``min_gap_s``
    as ``[start offset, length]`` in seconds from ``begin``.
    """
    if end <= begin or len(t) < 2:
        raise ValueError("need a window with end > begin and at least two samples")
    ts, vs = _clip(t, cum_bytes, begin, end)
    busy = partial = idle = 0.0
    kinds: list[tuple[float, float, str]] = []
    for t0, t1, v0, v1 in zip(ts, ts[1:], vs, vs[1:], strict=False):
        dt = t1 - t0
        if dt <= 0:
            continue
        frac = (v1 - v0) / dt / rate_bytes_s
        kind = "busy" if frac >= busy_fraction else "idle" if frac < idle_fraction else "partial"
        busy += dt if kind == "busy" else 0.0
        partial += dt if kind == "partial" else 0.0
        idle += dt if kind == "idle" else 0.0
        kinds.append((t0, t1, kind))
    active = [k for k in kinds if k[2] != "idle"]
    first = active[0][0] if active else end
    last = active[-1][1] if active else end
    head = sum(t1 - t0 for t0, t1, k in kinds if k == "idle" and t1 <= first)
    tail = sum(t1 - t0 for t0, t1, k in kinds if k == "idle" and t0 >= last) if active else 0.0
    gaps: list[list[float]] = []
    run_start: float | None = None
    for t0, _t1, kind in [*kinds, (end, end, "end")]:
        if kind == "idle":
            run_start = t0 if run_start is None else run_start
        elif run_start is not None:
            if t0 - run_start >= min_gap_s:
                gaps.append([round(run_start - begin, 3), round(t0 - run_start, 3)])
            run_start = None
    carried = vs[-1] - vs[0]
    return dict(window_s=end - begin, bytes=carried, utilization=carried / (rate_bytes_s * (end - begin)),
                busy_s=busy, partial_s=partial, idle_s=idle, idle_head_s=head, idle_tail_s=tail,
                idle_middle_s=idle - head - tail, gaps=gaps)


def cpu_seconds(t: Sequence[float], cum_cpu_s: Sequence[float], begin: float, end: float) -> float:
    """CPU seconds spent in [begin, end], from a cumulative CPU-seconds series (interpolated at the ends)."""
    _, vs = _clip(t, cum_cpu_s, begin, end)
    return vs[-1] - vs[0]


def cpu_overlap(links: Sequence[tuple[Sequence[float], Sequence[float]]], rate_bytes_s: float,
                cpu_t: Sequence[float], cpu_busy_s: Sequence[float], cores: float, begin: float, end: float,
                busy_fraction: float = BUSY_FRACTION, saturated_fraction: float = 0.9) -> dict[str, Any]:
    """Split [begin, end] into link-bound, CPU-bound and neither, on the grid of ``cpu_t``.

    Each interval of the CPU series is *link-bound* when at least one of ``links`` (``(times, cumulative
    bytes)`` pairs, e.g. every uplink and downlink of a group) carried ``busy_fraction`` of its rate;
    otherwise *CPU-bound* when the machine used at least ``saturated_fraction`` of ``cores``; otherwise
    *neither* (every link below its rate and CPU to spare: the protocol was waiting). ``busy_links_s[k]`` is
    the seconds during which exactly ``k`` of the links were busy.
    """
    ts, busy = _clip(cpu_t, cpu_busy_s, begin, end)
    out: dict[str, Any] = dict(link_bound_s=0.0, cpu_bound_s=0.0, neither_s=0.0, cpu_saturated_s=0.0,
                               busy_links_s=[0.0] * (len(links) + 1))
    for t0, t1, b0, b1 in zip(ts, ts[1:], busy, busy[1:], strict=False):
        dt = t1 - t0
        if dt <= 0:
            continue
        saturated = (b1 - b0) / dt >= saturated_fraction * cores
        out["cpu_saturated_s"] += dt if saturated else 0.0
        count = 0
        for link_t, link_bytes in links:
            _, v = _clip(link_t, link_bytes, t0, t1)
            count += (v[-1] - v[0]) / dt >= busy_fraction * rate_bytes_s
        out["busy_links_s"][count] += dt
        link_busy = count > 0
        key = "link_bound_s" if link_busy else "cpu_bound_s" if saturated else "neither_s"
        out[key] += dt
    return out
