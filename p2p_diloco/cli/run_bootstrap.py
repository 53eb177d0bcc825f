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
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.dht import SwarmStartError, start_dht, visible_maddrs

logger = logging.getLogger(__name__)
PROG = "run_bootstrap"


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
    """Relay traffic for volunteers behind NAT (libp2p circuit relay)."""

    def __post_init__(self) -> None:
        if not self.identity_path:
            raise ValueError("identity_path: a bootstrap node needs a persistent identity file")
        if not self.host_maddrs:
            raise ValueError("host_maddrs: give at least one address to listen on")

    def swarm(self) -> SwarmConfig:
        return SwarmConfig(
            initial_peers=list(self.initial_peers), host_maddrs=list(self.host_maddrs),
            announce_maddrs=list(self.announce_maddrs), identity_path=self.identity_path,
            client_mode=False, use_relay=self.use_relay,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(PROG, "Run a DHT bootstrap node for a p2p_diloco swarm.", BootstrapConfig)
    cfg, args = parse_config(parser, BootstrapConfig, argv)
    setup_logging(args.verbose)
    try:
        swarm = cfg.swarm()
    except ValueError as e:
        usage_error(PROG, str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        dht = start_dht(swarm)
    except SwarmStartError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    try:
        addrs = [a for a in visible_maddrs(dht) if "/p2p-circuit" not in a]
        print(f"bootstrap node {dht.peer_id} is up. Volunteers join with:", flush=True)
        print(f"  run_peer --initial-peers {' '.join(addrs)}", flush=True)
        print("Ctrl+C stops this node.", flush=True)
        stop.wait()
        print("shutting down", flush=True)
    finally:
        dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
