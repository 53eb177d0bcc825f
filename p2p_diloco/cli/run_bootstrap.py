"""``run_bootstrap``: a DHT node that helps volunteers find each other. It does not train.

Run one (better two or three) on machines with a public address and a stable identity, and give
volunteers the ``run_peer --initial-peers ...`` line it prints at start.
"""

from __future__ import annotations

import logging
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
from p2p_diloco.swarm.relay_check import start_relay_dht

logger = logging.getLogger(__name__)
PROG = "run_bootstrap"
READY_LINE = "Volunteers join with:"
"""Printed once the node is up (its relay checked): the addresses on the next line are the ones to use."""


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
    """With ``use_relay``: how many times to start the p2p daemon until a check at start finds the right relay
    answering (``swarm.relay_check``). The daemon runs two relays on one protocol and which one answers is
    decided by a race at its start; with libp2p's default one, every relayed stream resets after 128 KiB and
    volunteers behind NAT never average. Each check costs about 1 s (10 s when the stream stalls). The daemon
    runs with one goroutine thread, which makes ours win most starts (``relay_check.one_go_thread``; measured
    30 of 30 on an idle 2-core machine, 18 of 20 with three busy loops on it; with a thread per core the
    default one won 10 of 10 there and 32 of 32 on the CI machine). 32 starts leave a bad relay about once in
    10^30 node starts at the loaded rate (the node then logs an error and runs on). 0 skips the check (a node
    on a private test network, where nobody relies on the relay)."""

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
            dht, _ = start_relay_dht(swarm, validators, attempts=cfg.relay_check_starts)
        else:
            dht = start_dht(swarm, record_validators=validators)
    except SwarmStartError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    # After the DHT process is forked: a child inheriting this handler would ignore its own shutdown.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        addrs = [a for a in visible_maddrs(dht) if "/p2p-circuit" not in a]
        print(f"bootstrap node {dht.peer_id} is up. {READY_LINE}", flush=True)
        print(f"  run_peer --initial-peers {' '.join(addrs)}", flush=True)
        if cfg.metrics_port:
            _serve_swarm_metrics(cfg, dht)
        print("Ctrl+C stops this node.", flush=True)
        stop.wait()
        print("shutting down", flush=True)
    finally:
        dht.shutdown()
    return 0


def _serve_swarm_metrics(cfg: BootstrapConfig, dht) -> None:
    from prometheus_client import start_http_server

    from p2p_diloco.monitoring import SwarmExporter

    exporter = SwarmExporter(dht, cfg.monitor_run_ids, interval_s=cfg.monitor_interval_s)
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
