"""``run_bootstrap``: a DHT node that helps volunteers find each other. It does not train.

Run one (better two or three) on machines with a public address and a stable identity, and give
volunteers the ``run_peer --initial-peers ...`` line it prints at start.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from p2p_diloco.cli.common import make_parser, parse_config, setup_logging, usage_error
from p2p_diloco.cli.open_files import raise_open_files_limit
from p2p_diloco.config import RUN_ID_RULE, is_run_id
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.dht import SwarmStartError, start_dht, visible_maddrs
from p2p_diloco.swarm.records import run_validator
from p2p_diloco.swarm.relay_check import RelayStartup, start_relay_dht

logger = logging.getLogger(__name__)
PROG = "run_bootstrap"
READY_LINE = "Volunteers join with:"
"""Printed once the node is up (its relay checked): the addresses on the next line are the ones to use."""
RELAY_LINE = "relay check:"
"""Starts the line, printed just before the join line, that says how the relay check ended and how many p2p
daemon starts it took (:func:`relay_line`; :func:`read_relay_line` reads it back)."""
_RELAY_LINE_RE = re.compile(re.escape(RELAY_LINE) + r" (\w+) after (\d+) daemon starts? of at most (\d+)")


@dataclass
class BootstrapConfig:
    """A bootstrap node's settings."""

    identity_path: str = "bootstrap.id"
    """Private key file that fixes this node's peer id, so the address volunteers use stays valid across
    restarts. Created with mode 0600 on first run; keep it secret and never commit it."""

    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/31337"])
    """Where to listen. Use a fixed port and open it in the firewall (TCP)."""

    announce_maddrs: list[str] = field(default_factory=list)
    """Public addresses to advertise, e.g. /ip4/203.0.113.7/tcp/31337, when the machine sits behind NAT or
    a load balancer. Default: whatever the node sees on its interfaces."""

    initial_peers: list[str] = field(default_factory=list)
    """Other bootstrap nodes of the same swarm, so that the nodes know each other (redundancy)."""

    use_relay: bool = True
    """Relay traffic for volunteers behind NAT who run with ``--use-auto-relay`` (libp2p circuit relay). Every
    relayed byte crosses this node's link twice; bootstrap/README.md says what that costs per round."""

    relay_check_starts: int = 32
    """With ``use_relay``: how many times at most to start the p2p daemon until a check at start finds the
    right one of its two relays answering (libp2p's default one resets every relayed stream after 128 KiB, and
    volunteers behind NAT never average); 0 skips the check, for a private test network. 32 leave a bad relay
    about once in 10^30 node starts under load
    (bootstrap/README.md#9-relaying-for-volunteers-behind-nat-what-it-costs)."""

    metrics_port: int | None = None
    """Serve swarm-level Prometheus metrics (peers online, global epoch, tokens/s, per-peer epoch lag, rounds)
    on this port (0.0.0.0), read from the progress records peers publish in the DHT. Default: none."""

    monitor_run_ids: list[str] = field(default_factory=lambda: ["p2p-diloco-demo"])
    """The runs (--run-id of the peers) this node guards and reports on: it drops unsigned and malformed
    progress records of these runs on receipt, and the swarm metrics show them. One DHT can carry several."""

    monitor_interval_s: float = 5.0
    """Seconds between reads of the peers' progress records. Keep it at or below Prometheus'
    scrape_interval; each read is one DHT lookup per run, so 1 to 15 s costs next to nothing."""

    def __post_init__(self) -> None:
        if not self.identity_path:
            raise ValueError("identity_path: a bootstrap node needs a persistent identity file")
        if not self.host_maddrs:
            raise ValueError("host_maddrs: give at least one address to listen on")
        if not 0 <= self.relay_check_starts <= 100:
            raise ValueError(f"relay_check_starts: must be in [0, 100], got {self.relay_check_starts}")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"metrics_port: must be in [1, 65535], got {self.metrics_port}")
        bad = [r for r in self.monitor_run_ids if not is_run_id(r)]
        if bad or not self.monitor_run_ids:
            raise ValueError(f"monitor_run_ids: give run ids of {RUN_ID_RULE} (got {bad or 'none'})")
        if not 0.5 <= self.monitor_interval_s <= 3600:
            raise ValueError(f"monitor_interval_s: must be in [0.5, 3600], got {self.monitor_interval_s}")

    def swarm(self) -> SwarmConfig:
        return SwarmConfig(
            initial_peers=list(self.initial_peers), host_maddrs=list(self.host_maddrs),
            announce_maddrs=list(self.announce_maddrs), identity_path=self.identity_path,
            client_mode=False, use_relay=self.use_relay, relay_service=self.use_relay,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(PROG, "Run a DHT bootstrap node for a p2p_diloco swarm.", BootstrapConfig)
    cfg, args = parse_config(parser, BootstrapConfig, argv)
    setup_logging(args.verbose)
    raise_open_files_limit()  # before the DHT's processes start: they inherit it (see cli.open_files)
    try:
        swarm = cfg.swarm()
    except ValueError as e:
        usage_error(PROG, str(e))
    try:
        validators = [run_validator(run_id) for run_id in cfg.monitor_run_ids]
        if cfg.relay_check_starts:
            startup = start_relay_dht(swarm, validators, attempts=cfg.relay_check_starts)
        else:
            startup = RelayStartup(start_dht(swarm, record_validators=validators), (), 0)
        dht = startup.dht
    except SwarmStartError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    # After the DHT process is forked: a child inheriting this handler would ignore its own shutdown.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        addrs = [a for a in visible_maddrs(dht) if "/p2p-circuit" not in a]
        print(relay_line(cfg, startup), flush=True)
        print(f"bootstrap node {dht.peer_id} is up. {READY_LINE}", flush=True)
        print(f"  run_peer --initial-peers {' '.join(addrs)}", flush=True)
        if cfg.metrics_port:
            _serve_swarm_metrics(cfg, dht, startup)
        print("Ctrl+C stops this node.", flush=True)
        stop.wait()
        print("shutting down", flush=True)
    finally:
        dht.shutdown()
    return 0


def relay_line(cfg: BootstrapConfig, startup: RelayStartup) -> str:
    """How the relay check ended, with the p2p daemon starts it took and the verdict on each, in one line."""
    if not cfg.use_relay:
        return f"{RELAY_LINE} off (--use-relay false: this node relays for nobody)"
    if not startup.checks:
        return f"{RELAY_LINE} skipped (--relay-check-starts 0: nobody checked that relayed streams get through)"
    starts = startup.starts
    verdicts = ", ".join(c.verdict.value for c in startup.checks)
    return (f"{RELAY_LINE} {startup.check.verdict.value} after {starts} daemon start{'s' if starts > 1 else ''} "
            f"of at most {startup.limit} ({verdicts})")


@dataclass(frozen=True)
class RelayLine:
    """A bootstrap's relay line, read back from its output."""

    verdict: str
    starts: int
    limit: int


def read_relay_line(output: str) -> RelayLine | None:
    """The last relay line in a bootstrap's ``output`` with a verdict; ``None`` if there is none (not checked)."""
    found = _RELAY_LINE_RE.findall(output)
    if not found:
        return None
    verdict, starts, limit = found[-1]
    return RelayLine(verdict, int(starts), int(limit))


def _serve_swarm_metrics(cfg: BootstrapConfig, dht, startup: RelayStartup) -> None:
    from prometheus_client import start_http_server

    from p2p_diloco.monitoring import SwarmExporter
    from p2p_diloco.monitoring.relay_metrics import RelayStartsCollector

    exporter = SwarmExporter(dht, cfg.monitor_run_ids, interval_s=cfg.monitor_interval_s)
    exporter.registry.register(RelayStartsCollector(startup.checks, startup.limit))
    try:
        start_http_server(cfg.metrics_port, registry=exporter.registry)
    except OSError as e:
        usage_error(PROG, f"cannot serve metrics on port {cfg.metrics_port}: {e.strerror or e}; "
                          "pick a free --metrics-port")
    exporter.start()
    print(f"swarm metrics for run(s) {', '.join(cfg.monitor_run_ids)} on "
          f"http://0.0.0.0:{cfg.metrics_port}/metrics", flush=True)


if __name__ == "__main__":
    sys.exit(main())
