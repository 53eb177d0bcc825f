"""Who can dial whom: how a peer is reached, and why a swarm whose peers nobody can dial never averages.

Peers of a group dial each other: a follower dials its leader, and every member dials each peer that reduces
a part. A peer in client mode dials out only, so it can neither lead nor reduce; a full peer behind a home
router without a forwarded port or a relay cannot be dialled either, so groups it should lead never form and
parts it should reduce never arrive. When nobody in the swarm can be dialled, no round ever averages: every
peer waits out ``matchmaking_timeout_s`` and skips. :func:`diagnose` names that case from what a peer knows:
its own announced addresses and the signed progress records of the run (a record's ``client_mode`` is what
its writer says of itself, so the diagnosis is a warning to the operator and never an input to a decision).
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable, Sequence

from p2p_diloco.core.rounds import Stall

__all__ = ["MESSAGES", "Reach", "Stall", "diagnose", "is_public", "own_reach"]


class Reach(str, enum.Enum):
    """How other peers reach this one, judged from the addresses its p2p daemon announces."""

    CLIENT = "client"
    """Client mode: nobody dials it; it sends its parts to full peers and reduces nothing."""
    RELAYED = "relayed"
    """It announces an address through a relay (``/p2p-circuit``)."""
    PUBLIC = "public"
    """It announces a public address (its own, a forwarded port, or one mapped by UPnP)."""
    PRIVATE = "private"
    """Only private or loopback addresses: only hosts of its own network can dial it."""

    def __str__(self) -> str:
        return self.value


FIX = ("one peer must be reachable: a peer with a public address, or a forwarded TCP port "
       "(--host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT), or "
       "--use-auto-relay true through a bootstrap node that relays; client-mode peers need such a full peer")

MESSAGES = {
    Stall.ALL_CLIENTS: "every peer of this run is in client mode, so nobody can lead a group or reduce parts "
                       "and no round can average. Fix: " + FIX,
    Stall.UNREACHABLE: "this peer announces only private addresses and no relay, so peers outside its network "
                       "cannot dial it: it cannot lead a group or reduce parts, and when no peer of the swarm "
                       "can be dialled no round forms. Fix: forward a TCP port and announce your public address "
                       "(--announce-maddrs), or --use-auto-relay true, or --client-mode true when a reachable "
                       "full peer is online",
}


def _host(maddr_text: str) -> tuple[str, str] | None:
    from hivemind.utils.multiaddr import Multiaddr  # here: the doctor imports this module without hivemind

    try:
        maddr = Multiaddr(maddr_text)
    except Exception:  # noqa: BLE001 - a malformed address is simply not public
        return None
    for proto in ("ip4", "ip6", "dns", "dns4", "dns6", "dnsaddr"):
        if proto in maddr:
            return proto, maddr[proto]
    return None


def is_public(maddr_text: str) -> bool:
    """Whether peers elsewhere on the internet could dial this address (a global IP or a DNS name)."""
    host = _host(maddr_text)
    if host is None:
        return False
    proto, value = host
    if proto.startswith("dns"):
        return value != "localhost"
    try:
        return ipaddress.ip_address(value).is_global
    except ValueError:
        return False


def own_reach(visible: Iterable[str], client_mode: bool) -> Reach:
    """How others reach a peer that announces ``visible`` (full multiaddrs, relayed ones included)."""
    if client_mode:
        return Reach.CLIENT
    visible = list(visible)
    if any("/p2p-circuit" in a for a in visible):
        return Reach.RELAYED
    if any(is_public(a) for a in visible):
        return Reach.PUBLIC
    return Reach.PRIVATE


def diagnose(reach: Reach, full_peers_seen: int, initial_peers: Sequence[str]) -> Stall:
    """Why rounds cannot average, given this peer's ``reach``, how many peers of the run not in client mode
    it sees (itself excluded) and its initial peers (public ones mean the swarm lives on the internet)."""
    if reach is Reach.CLIENT and full_peers_seen == 0:
        return Stall.ALL_CLIENTS
    if reach is Reach.PRIVATE and any(is_public(p) for p in initial_peers):
        return Stall.UNREACHABLE
    return Stall.NONE
