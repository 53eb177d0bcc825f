"""How a peer behind NAT becomes reachable through a relay: the p2p daemon options that make it work.

A peer with ``use_auto_relay`` asks a public peer (the bootstrap nodes relay by default) to keep a slot for it
and announces a ``/p2p-circuit`` address through that relay; others dial it there. Left to the daemon's
defaults this never happened within a round, for three reasons found in a home-network testbed
(``benchmarks/testbed.py`` with ``homes``):

1. **Reachability never becomes "private".** The daemon announces relayed addresses only once AutoNAT has
   decided that the host is private, which takes dial-back attempts from several public peers. A swarm whose
   only public host is its bootstrap node never gets there: the peer stays "unknown" and announces only its
   LAN addresses, which nobody outside can dial. A peer that asks for a relay says it is behind NAT, so we
   force reachability to private.
2. **The relay is reserved only after three minutes.** With relay discovery on (the daemon's default), the
   relay finder waits until it has four candidate relays, or three minutes, before it reserves a slot. We
   name the relays (``trustedRelays``: the initial peers, i.e. the bootstrap nodes) and turn discovery off:
   the daemon then reserves with every named relay at once, within a second of its start.
3. **The relay cut every relayed connection after 128 KiB.** The daemon relays with its configured limits
   (4 GiB and 30 minutes per connection) only once it finds itself public; until then a second relay with
   libp2p's defaults (128 KiB, 2 minutes) answers, and every all-reduce stream through it was reset. A host
   that relays for others (``relay_service``: the bootstrap nodes) has a public address by definition, so we
   force its reachability to public.
   The daemon registers that default relay too, on the same protocol, and which of the two answers is a race
   at the daemon's start (in 3 of 10 relayed test swarms the default one won and every relayed stream was
   reset); no daemon flag reaches it, so a relay host runs its daemon with one goroutine thread, which makes
   the configured one win, checks its relay at start and restarts its daemon until the configured one
   answers (``swarm.relay_check``).
4. (Testbeds only.) A relay on a private address (10.0.0.0/8 ...) is never announced; real bootstrap nodes
   have public addresses.

The daemon also tries to replace a relayed connection by a direct one (hole punching, on with AutoNAT); behind
routers that drop unsolicited inbound packets, as in the testbed, the connection stays relayed.

The daemon's flag for (2), ``relayDiscovery``, has no parameter in hivemind's ``P2P.create`` (it is accepted
and ignored there), so :func:`install` adds it where hivemind turns its arguments into the daemon's command
line (``P2P._make_process_args``, named in tests/unit/test_hivemind_internals.py). It touches only daemons
started with both ``autoRelay`` and ``trustedRelays``, which only this module asks for.
"""

from __future__ import annotations

from typing import Any

from hivemind.p2p import P2P

from p2p_diloco.swarm.config import SwarmConfig

_MARK = "_p2p_diloco_static_relays"


def daemon_kwargs(cfg: SwarmConfig) -> dict[str, Any]:
    """Extra ``hivemind.DHT``/``P2P.create`` arguments for ``cfg``: the relay settings above, or none."""
    if cfg.relay_service and cfg.use_relay:
        return {"force_reachability": "public"}
    if not (cfg.use_auto_relay and cfg.use_relay and cfg.initial_peers):
        return {}
    install()
    return {"force_reachability": "private", "trusted_relays": list(cfg.initial_peers)}


def install() -> None:
    """Make daemons that name trusted relays use exactly those (``-relayDiscovery=0``); idempotent."""
    original = P2P._make_process_args
    if getattr(original, _MARK, False):
        return

    def make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
            kwargs.setdefault("relayDiscovery", False)
        return original(*args, **kwargs)

    setattr(make_process_args, _MARK, True)
    P2P._make_process_args = staticmethod(make_process_args)
