"""An emulated internet on one Linux machine: each peer in its own network namespace, behind a rate limit.

Layout (every name and address lives only inside namespaces created here; the host's own network, routes and
interfaces are never touched)::

    netns PREFIXbr:  bridge br0 ── veth h0 ── netns PREFIXh0: eth0 10.77.0.1/24  (bootstrap)
                               ── veth h1 ── netns PREFIXh1: eth0 10.77.0.2/24  (peer 1)
                               ── ...

Hosts named in ``homes`` sit behind a home router instead: a namespace ``PREFIXr<i>`` that holds the public
address on its ``wan0`` and the home's LAN 192.168.1.0/24 on ``lan0`` (every home the same, as most routers
ship), the host at 192.168.1.2. With homes, the internet is 11.77.0.0/24 instead of 10.77.0.0/24 (see
PUBLIC_SUBNET). The router masquerades the LAN (iptables NAT) and drops every new inbound connection, as a
home router does; :meth:`Testbed.forward_port` adds a DNAT rule, as a volunteer forwarding a port does::

    netns PREFIXbr: br0 ── veth h2 ── netns PREFIXr2: wan0 11.77.0.3 │ NAT │ lan0 192.168.1.1 ── netns PREFIXh2:
                                                                                             eth0 192.168.1.2

Each host's link is limited in both directions with ``tc tbf`` (upload on its eth0, or its router's wan0,
download on its bridge port), like a home connection with a symmetric plan. Latency is added with ``netem`` where the kernel has it;
where not (``sch_netem`` is missing on many cloud kernels) the testbed says so and runs without added delay.

Use as a library (benchmarks and tests)::

    with Testbed(hosts=3, rate_mbit=20) as bed:
        proc = bed.popen(1, [sys.executable, "-m", "p2p_diloco.cli.run_peer", ...])

or from the command line (as root): start a bootstrap and N run_peer processes, wait for them, collect
their JSON-line logs into ``--out`` and tear everything down, also on Ctrl+C or failure::

    sudo python -m benchmarks.testbed --peers 4 --rate-mbit 20 --out runs/x -- --max-rounds 3 --model tiny
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

SUBNET = "10.77.0"
# The internet of a testbed with home routers. libp2p treats 10.0.0.0/8 (and the documentation ranges) as
# private: a relay at such an address is never announced (a relayed address must go through a public one)
# and AutoNAT never finds a host public. So the public side holds addresses that libp2p counts as public;
# 11.0.0.0/8 is not routed on the real internet, and no packet to it ever leaves our namespaces anyway.
PUBLIC_SUBNET = "11.77.0"
MADDR = re.compile(r"/ip4/(?:10\.77|11\.77)\.0\.\d+/tcp/\d+/p2p/\w+")


class TestbedError(RuntimeError):
    """The testbed cannot be built here (no root, no iproute2, a command failed)."""


def missing_requirements(nat: bool = False) -> str | None:
    """Why a testbed (with home routers where ``nat``) cannot be built on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root: run as root (e.g. with sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed: install iproute2"
    if nat and shutil.which("iptables") is None:
        return "'iptables' is not installed (home routers need NAT): apt-get install iptables"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def list_namespaces(prefix: str) -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


class Testbed:
    """``hosts`` namespaces joined by a bridge, each link limited to ``rate_mbit`` both ways.

    Args:
        hosts: how many namespaces (a bootstrap plus N peers needs N + 1).
        homes: indices of the hosts behind a home router (NAT, no inbound connections); the rest are
            public. Host 0 is usually the bootstrap node and public.
        rate_mbit: each host's bandwidth in Mbit/s, per direction.
        latency_ms: one-way delay added with netem on each host's uplink, if the kernel has netem.
        prefix: namespace name prefix; default ``pd<pid>`` so concurrent testbeds never collide.
        queue_ms: how long tbf may queue a packet before dropping it; ~100 ms is a typical home router's
            buffer, far smaller values make TCP lose throughput to drops.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, hosts: int, rate_mbit: float, *, latency_ms: float = 0.0, prefix: str | None = None,
                 queue_ms: float = 100.0, homes: Sequence[int] = ()) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be in [1, 200], got {hosts}")
        if any(not 0 <= i < hosts for i in homes):
            raise ValueError(f"homes must be host indices in [0, {hosts - 1}], got {list(homes)}")
        self.homes = frozenset(homes)
        if not 0.1 <= rate_mbit <= 100_000:
            raise ValueError(f"rate_mbit must be in [0.1, 100000], got {rate_mbit}")
        self.hosts, self.rate_mbit, self.latency_ms, self.queue_ms = hosts, rate_mbit, latency_ms, queue_ms
        self.prefix = prefix or f"pd{os.getpid()}"
        self.bridge_ns = f"{self.prefix}br"
        self.netem = False
        self.notes: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self._up = False

    def ns(self, index: int) -> str:
        return f"{self.prefix}h{index}"

    def router_ns(self, index: int) -> str:
        return f"{self.prefix}r{index}"

    def ip(self, index: int) -> str:
        """Host ``index``'s public address: its own, or its home router's."""
        return f"{PUBLIC_SUBNET if self.homes else SUBNET}.{index + 1}"

    def host_ip(self, index: int) -> str:
        """The address host ``index`` binds to: its public one, or its LAN address behind its router."""
        return "192.168.1.2" if index in self.homes else self.ip(index)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        problem = missing_requirements(nat=bool(self.homes))
        if problem:
            raise TestbedError(problem)
        atexit.register(self.down)
        self._up = True
        try:
            _run("ip", "netns", "add", self.bridge_ns)
            _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            self.netem = self._has_netem()
            if self.latency_ms and not self.netem:
                self.notes.append(f"netem is not available in this kernel: no added latency "
                                  f"({self.latency_ms} ms requested); bandwidth limits still apply")
                logger.warning(self.notes[-1])
            for i in range(self.hosts):
                self._add_host(i)
        except BaseException:
            self.down()
            raise

    def _has_netem(self) -> bool:
        probe = _run("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                     "delay", "1ms", check=False)
        if probe.returncode == 0:
            _run("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
        return probe.returncode == 0

    def _add_host(self, i: int) -> None:
        if i in self.homes:
            self._add_home(i)
            return
        ns, port = self.ns(i), f"h{i}"
        _run("ip", "netns", "add", ns)
        # Both veth ends are created inside our namespaces: nothing ever appears in the host's namespace.
        _run("ip", "-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        self._shape(ns, "eth0", delay=True)          # upload
        self._shape(self.bridge_ns, port, delay=False)  # download

    def _add_home(self, i: int) -> None:
        """Host ``i`` behind its own router: masquerade out, drop every new connection in (module docstring)."""
        ns, router, port = self.ns(i), self.router_ns(i), f"h{i}"
        _run("ip", "netns", "add", router)
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "wan0",
             "netns", router)
        _run("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", router, "addr", "add", f"{self.ip(i)}/24", "dev", "wan0")
        _run("ip", "-n", router, "addr", "add", "192.168.1.1/24", "dev", "lan0")
        for dev in ("wan0", "lan0", "lo"):
            _run("ip", "-n", router, "link", "set", dev, "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.host_ip(i)}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "route", "add", "default", "via", "192.168.1.1")
        ipt = ["ip", "netns", "exec", router, "iptables"]
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE")
        _run(*ipt, "-P", "FORWARD", "DROP")
        _run(*ipt, "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
        _run(*ipt, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        # a forwarded port (forward_port) is a DNAT rule; its packets pass FORWARD in state DNAT
        _run(*ipt, "-A", "FORWARD", "-i", "wan0", "-m", "conntrack", "--ctstate", "DNAT", "-j", "ACCEPT")
        # nothing on the router itself listens: new connections to it are dropped, not refused
        _run(*ipt, "-A", "INPUT", "-i", "wan0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
             "-j", "ACCEPT")
        _run(*ipt, "-A", "INPUT", "-i", "wan0", "-j", "DROP")
        self._shape(router, "wan0", delay=True)         # upload
        self._shape(self.bridge_ns, port, delay=False)  # download

    def forward_port(self, index: int, port: int) -> None:
        """Forward TCP ``port`` of home ``index``'s public address to the same port of the host behind it."""
        if index not in self.homes:
            raise ValueError(f"host {index} is not behind a home router")
        _run("ip", "netns", "exec", self.router_ns(index), "iptables", "-t", "nat", "-A", "PREROUTING", "-i",
             "wan0", "-p", "tcp", "--dport", str(port), "-j", "DNAT", "--to-destination",
             f"{self.host_ip(index)}:{port}")

    def _shape(self, ns: str, dev: str, *, delay: bool) -> None:
        rate_bps = self.rate_mbit * 1e6
        # tbf needs a bucket of at least rate/HZ; 10 ms worth of traffic keeps the shaping smooth.
        burst = max(16_000, int(rate_bps / 8 / 100))
        tbf = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", f"{self.queue_ms}ms"]
        base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        if delay and self.netem and self.latency_ms:
            _run(*base, "root", "handle", "1:", "netem", "delay", f"{self.latency_ms}ms")
            _run(*base, "parent", "1:1", "handle", "10:", *tbf)
        else:
            _run(*base, "root", *tbf)

    def down(self) -> None:
        """Stop every process started here and delete every namespace (idempotent)."""
        if not self._up:
            return
        self._up = False
        for proc in self.procs:
            _stop(proc)
        self.procs.clear()
        routers = [self.router_ns(i) for i in sorted(self.homes)]
        for ns in [self.ns(i) for i in range(self.hosts)] + routers + [self.bridge_ns]:
            _run("ip", "netns", "del", ns, check=False)  # deleting a namespace removes its veths too
        try:
            atexit.unregister(self.down)
        except Exception:  # noqa: BLE001 - atexit may already be running
            pass

    def link_bytes(self, index: int) -> tuple[int, int]:
        """Bytes host ``index``'s link has carried so far (received, sent), as its bridge port counts them
        (headers included); for a home, its router's link to the internet."""
        out = _run("ip", "-n", self.bridge_ns, "-s", "-j", "link", "show", f"h{index}").stdout
        stats = json.loads(out)[0]["stats64"]
        # the bridge port's rx is what the host sent, its tx what the host received
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def set_link(self, index: int, up: bool) -> None:
        """Cut (``up=False``) or restore host ``index``'s link: a network partition, as when a home router
        drops its connection. The bridge port goes down, so the host's eth0 loses carrier while its processes
        and their TCP connections live on; traffic resumes on the same addresses when the port comes back."""
        _run("ip", "-n", self.bridge_ns, "link", "set", f"h{index}", "up" if up else "down")

    # ------------------------------------------------------------------ processes

    def popen(self, index: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` inside host ``index``'s namespace (own session, so it is stopped as a group)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(index), *argv], start_new_session=True,
                                **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # helpers such as p2pd share the group
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        logger.warning("process %d did not exit", proc.pid)


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def install_signal_teardown() -> None:
    """SIGTERM behaves like Ctrl+C, so ``with Testbed(...)`` and atexit tear down on either."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)


def wait_for_maddr(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The testbed address a bootstrap node prints once it is up (``demo.announced``)."""
    # imported here, not at the top: the requirement check (``main``) must answer a user who cannot read the
    # package's folder (not root, so no testbed) with its one line, before anything of the package is imported
    from p2p_diloco.cli.run_bootstrap import READY_LINE
    from p2p_diloco.demo import announced

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        maddr = announced(path.read_text(errors="replace"), READY_LINE, MADDR) if path.exists() else None
        if maddr:
            return maddr
        if proc.poll() is not None:
            raise TestbedError(f"{path.name}: exited with {proc.returncode}: {path.read_text()[-1500:]}")
        time.sleep(0.2)
    raise TestbedError(f"{path.name}: printed no multiaddr within {timeout:.0f} s")


RELAY_READY_S = 300.0
"""How long a bootstrap that relays may take to print its address. It checks its own relay at start and restarts
its p2p daemon while libp2p's default relay answers (``swarm.relay_check.start_relay_dht``: up to 32 starts, a
check up to 10 s each). Before the relay host's daemon ran with one goroutine thread (``relay_check.
one_go_thread``) each start was a draw lost about 29 times in 40 on this testbed: 60 s covered about 12 starts, a
CI rehearsal's client-mode test lost 12 draws in a row (03:12:43-03:13:31, 2026-11-27) and never started its
peers, and CI itself once lost all 32. 300 s covers the 32."""


def start_swarm(bed: Testbed, out: Path, peers: int, peer_args: Sequence[str],
                env: dict[str, str] | None = None, peer_env: dict[int, dict[str, str]] | None = None,
                *, relay: bool = False, peer_extra: dict[int, Sequence[str]] | None = None
                ) -> dict[str, subprocess.Popen]:
    """A bootstrap in host 0 and ``peers`` run_peer processes in hosts 1..N, logging to ``out``.

    ``relay`` lets the bootstrap relay for peers behind home routers and turns relays on for every peer (else
    off, as on a testbed where every address is reachable); ``peer_extra`` adds arguments for single peers.
    """
    out.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    boot_out = out / "bootstrap.out"
    boot = bed.popen(0, [sys.executable, "-m", "p2p_diloco.cli.run_bootstrap", "--identity-path",
                         str(out / "bootstrap.id"), "--host-maddrs", f"/ip4/{bed.host_ip(0)}/tcp/0",
                         "--use-relay", str(relay).lower()],
                     stdout=open(boot_out, "w"), stderr=subprocess.STDOUT, env=base_env)
    maddr = wait_for_maddr(boot_out, boot, RELAY_READY_S if relay else 60.0)
    procs = {"bootstrap": boot}
    for i in range(1, peers + 1):
        name = f"peer{i}"
        procs[name] = bed.popen(
            i, [sys.executable, "-m", "p2p_diloco.cli.run_peer", "--host-maddrs", f"/ip4/{bed.host_ip(i)}/tcp/0",
                "--initial-peers", maddr, "--use-relay", str(relay).lower(), "--log-file",
                str(out / f"{name}.jsonl"), *peer_args, *(peer_extra or {}).get(i, ())],
            stdout=open(out / f"{name}.out", "w"), stderr=subprocess.STDOUT,
            env=dict(base_env, **((peer_env or {}).get(i, {}))))
    return procs


def wait_peers(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, int | None]:
    """Wait for every peer (not the bootstrap) to exit, bounded by ``timeout``; None for those still running."""
    deadline = time.monotonic() + timeout
    codes: dict[str, int | None] = {}
    for name, proc in procs.items():
        if name == "bootstrap":
            continue
        try:
            codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[name] = None
    return codes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="testbed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=2, help="run_peer processes (each in its own namespace)")
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="per-peer bandwidth, each direction")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="added one-way delay (needs netem)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="stop everything after this long")
    parser.add_argument("--out", type=Path, default=Path("testbed-run"), help="folder for logs")
    parser.add_argument("peer_args", nargs="*", help="after --: arguments for every run_peer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    problem = missing_requirements()
    if problem:
        print(f"testbed: cannot run: {problem}", file=sys.stderr)
        return 1
    if args.peers < 1:
        print("testbed: error: --peers must be at least 1", file=sys.stderr)
        return 2
    install_signal_teardown()
    try:
        with Testbed(args.peers + 1, args.rate_mbit, latency_ms=args.latency_ms) as bed:
            for note in bed.notes:
                print(f"testbed: {note}")
            procs = start_swarm(bed, args.out, args.peers, args.peer_args)
            codes = wait_peers(procs, args.timeout_s)
    except KeyboardInterrupt:
        print("testbed: interrupted; namespaces removed", file=sys.stderr)
        return 130
    except TestbedError as e:
        print(f"testbed: error: {e}", file=sys.stderr)
        return 1
    print(f"testbed: peers exited with {codes}; logs in {args.out}")
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
