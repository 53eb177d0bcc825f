"""Who may talk to this peer's averager: access control for private swarms and bans of hostile peers.

hivemind's authorizer covers only the DHT; averaging and state download are separate RPCs served by the
averager process. :class:`AccessGate`, one per averager process (``averager_process.AveragerProcess``), checks
``context.remote_id`` at the start of each of them against ``SwarmConfig.allowed_peers`` and against the peers
banned in this run. Matchmaking and planning check the same list (``group.plan_group``), and joiners skip
donors outside it. hivemind's whole-state stream (``rpc_download_state``) is closed (``state_server``), so it
needs no gate.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, get_type_hints

from hivemind.p2p import P2P, PeerID

from p2p_diloco.swarm.bounded_rpc import BOUNDED_RPCS, MAX_ANSWERS, MAX_ANSWERS_PER_PEER, BoundedRequests
from p2p_diloco.swarm.claims import unsigned_payload
from p2p_diloco.swarm.group import decode_gather

logger = logging.getLogger(__name__)


MAX_CHUNK_STREAMS = MAX_ANSWERS
"""State chunk requests this peer serves at once (``rpc_state_chunk``): four joiners' worth at ``DEPTH`` 2 from
each of two workers. A chunk is 1 MiB, so this bounds the serving side's buffers to 16 MiB; beyond it a joiner
is refused and its chunks go to its other donors."""
MAX_CHUNK_STREAMS_PER_PEER = MAX_ANSWERS_PER_PEER
"""Chunk requests served to one peer id at once: a joiner keeps ``DEPTH`` (2) out per donor; twice that leaves
room for a stream that is closing on this side while the joiner's next request arrives."""


def rpc_handle_name(namespace: str | None, servicer: str, rpc: str) -> str:
    """The protocol name an RPC is served under, as hivemind's ``ServicerBase`` names it (the tripwire test
    checks it against hivemind's own rule): its stubs call that name."""
    return f"{servicer}.{rpc}" if namespace is None else f"{namespace}::{servicer}.{rpc}"


class AccessGate:
    """Who may talk to this peer's averager process, and how many chunk streams each may hold.

    Lives in the averager process only (``AveragerProcess`` makes it there), where the RPCs are served and
    groups are planned; the training process reaches it only through ``commands.Ban``.

    :param own_id: this peer's base58 id (never banned, whatever a group's members say of it).
    :param allowed: base58 ids of a private swarm's members (``SwarmConfig.allowed_peers``); ``None``: anyone.
    """

    def __init__(self, own_id: str, allowed: frozenset[str] | None):
        self.own_id, self.allowed = own_id, allowed
        self.banned: dict[str, str] = {}
        """Peer id -> why it was banned, for the rest of the run."""
        self._chunk_serving: dict[str, int] = {}
        """Peer id -> state chunk requests being served to it (this process's event loop only)."""

    def ban(self, rejected: dict[str, str]) -> list[str]:
        """Ban every rejected peer for the rest of the run; return them as "peer id: reason"."""
        for peer, reason in rejected.items():
            if peer not in self.banned and peer != self.own_id:
                logger.warning("Banning %s for the rest of the run: %s", peer, reason)
                self.banned[peer] = reason
        return [f"{peer}: {reason}" for peer, reason in rejected.items()]

    def refuse(self, peer: PeerID) -> str | None:
        """Why an RPC from ``peer`` is refused (not an allowed peer, banned), or ``None``."""
        name = peer.to_base58()
        if self.allowed is not None and name not in self.allowed:
            return "not in allowed_peers"
        if name in self.banned:
            return f"banned: {self.banned[name]}"
        return None

    def refuse_parts(self, peer: PeerID) -> str | None:
        """Why all-reduce parts from ``peer`` are refused (not an allowed peer), or ``None``. Banned peers are
        the reducer's to handle: it drops their data but still answers, so the group's results stay identical."""
        if self.allowed is not None and peer.to_base58() not in self.allowed:
            return "not in allowed_peers"
        return None

    @contextlib.contextmanager
    def chunk_slot(self, peer: PeerID) -> Iterator[str | None]:
        """A slot to serve one state chunk request of ``peer`` in: yields why there is none (not allowed,
        banned, busy: at most ``MAX_CHUNK_STREAMS_PER_PEER`` per peer and ``MAX_CHUNK_STREAMS`` in all), else
        ``None`` and holds the slot until the block ends."""
        reason = self.refuse(peer)
        name, serving = peer.to_base58(), self._chunk_serving
        if reason is None and (serving.get(name, 0) >= MAX_CHUNK_STREAMS_PER_PEER
                               or sum(serving.values()) >= MAX_CHUNK_STREAMS):
            reason = f"busy ({sum(serving.values())} chunk requests served)"
        if reason is not None:
            yield reason
            return
        serving[name] = serving.get(name, 0) + 1
        try:
            yield None
        finally:
            serving[name] -= 1
            if not serving[name]:
                del serving[name]

    def guard_leaders(self, matchmaking: Any) -> None:
        """Never ask a banned or not-allowed peer to lead our group.

        Without this a banned peer that declares itself a leader draws honest followers into a group they
        then refuse to average with, and they skip the round: a cheap way for a hostile peer to stall the
        swarm. hivemind's averager builds its ``Matchmaking`` inside its process's main coroutine, with no
        hook to customise it, so this wraps that instance's join request once, from the first round's step.
        """
        if matchmaking is None or getattr(matchmaking, "_leaders_guarded", False):
            return
        request = matchmaking._request_join_group

        async def guarded(leader: PeerID) -> Any:
            reason = self.refuse(leader)
            if reason is not None:
                logger.info("Not asking %s to lead our group: %s", leader, reason)
                return None
            return await request(leader)

        matchmaking._request_join_group = guarded
        matchmaking._leaders_guarded = True


def epoch_mismatch(gather: bytes, matchmaking: Any) -> str | None:
    """Why a follower of another epoch cannot join our group, or ``None``.

    Peers at different epochs could only form a group that refuses them afterwards (``plan_group``), and
    that round is lost for every member. A peer that fell behind (a joiner whose download outlasted the
    round, a peer back from a partition) must not take the others' round with it: it is turned away here,
    finds no group, and catches up on its own. ``matchmaking`` is hivemind's, whose ``step_control`` is the
    running search (``None``: not searching, hivemind's own answer follows).
    """
    control = getattr(matchmaking, "step_control", None)
    if control is None:
        return None
    try:
        theirs = decode_gather(unsigned_payload(gather))[2].epoch  # checked again, signed, in plan_group
        ours = decode_gather(unsigned_payload(control.data_for_gather))[2].epoch
    except ValueError:
        return None  # malformed metadata is refused, with its reason, by plan_group
    return None if theirs == ours else f"its epoch {theirs} differs from ours {ours}"


async def serve_bounded(p2p: P2P, servicer_type: type, handlers: Any, *, namespace: str | None, balanced: bool,
                        wait_s: float) -> None:
    """Move the one-request handlers hivemind's registration just added to ``bounded_rpc.BoundedRequests``:
    hivemind's wrapper would wait without limit for their requests, before any check here runs. The daemon
    takes one handler per protocol, so each is removed and added again; this runs once, when the averager
    process starts, before matchmaking exists or any state is served. ``servicer_type`` names the protocols (as
    hivemind names them), ``handlers`` has the ``rpc_*`` methods that serve them (the averager, or hivemind's
    wrapper of it); ``wait_s``: how long a caller has to send its request."""
    waiting: dict[Any, int] = {}
    for rpc in BOUNDED_RPCS:
        name = rpc_handle_name(namespace, servicer_type.__name__, rpc)
        request_type = get_type_hints(getattr(servicer_type, rpc))["request"]  # as hivemind reads it
        served = BoundedRequests(name, getattr(handlers, rpc), request_type, p2p.peer_id, wait_s, waiting)
        await p2p.remove_binary_stream_handler(name)
        await p2p.add_binary_stream_handler(name, served.serve, balanced=balanced)
