"""Who may talk to this peer's averager: access control for private swarms and bans of hostile peers.

hivemind's authorizer covers only the DHT; averaging and state download are separate RPCs served by the
averager process. ``AccessControlMixin`` (mixed into ``RoundAverager``) checks ``context.remote_id`` at the
start of each of them against ``SwarmConfig.allowed_peers`` and against the peers banned in this run.
Matchmaking and planning check the same list (``group.plan_group``), and joiners skip donors outside it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, get_type_hints  # noqa: UP035 - hivemind detects streaming RPCs by typing's alias only

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter

from p2p_diloco.swarm.bounded_rpc import BOUNDED_RPCS, BoundedRequests
from p2p_diloco.swarm.claims import unsigned_payload
from p2p_diloco.swarm.group import decode_gather
from p2p_diloco.swarm.patience import JoinTiming
from p2p_diloco.swarm.quorum import EarlyAssembly

logger = logging.getLogger(__name__)


MAX_STATE_DOWNLOADS = 4
"""State downloads this peer serves at once. Each streams the whole model (at 1B parameters, 4 GB of
parameters plus 4 GB of momentum) through this peer's upload and CPU; beyond it a joiner is refused and tries
its next donor. One per peer: a second concurrent download by the same id is refused."""


MAX_CHUNK_STREAMS = 16
"""State chunk requests this peer serves at once (``rpc_state_chunk``): four joiners' worth at ``DEPTH`` 2 from
each of two workers. A chunk is 1 MiB, so this bounds the serving side's buffers to 16 MiB; beyond it a joiner
is refused and its chunks go to its other donors."""
MAX_CHUNK_STREAMS_PER_PEER = 4
"""Chunk requests served to one peer id at once: a joiner keeps ``DEPTH`` (2) out per donor; twice that leaves
room for a stream that is closing on this side while the joiner's next request arrives."""


def rpc_handle_name(namespace: str | None, servicer: str, rpc: str) -> str:
    """The protocol name an RPC is served under, as hivemind's ``ServicerBase`` names it (the tripwire test
    checks it against hivemind's own rule): its stubs call that name."""
    return f"{servicer}.{rpc}" if namespace is None else f"{namespace}::{servicer}.{rpc}"


class AccessControlMixin:
    """Checks on the averager's RPC handlers; ``_allowed`` (``None``: anyone) and ``_banned`` are set by the
    averager before its process starts."""

    _allowed: frozenset[str] | None = None
    _serving: dict[str, int] | None = None
    """Peer id -> state downloads being served to it (the averager process's event loop only)."""
    _chunk_serving: dict[str, int] | None = None
    """Peer id -> state chunk requests being served to it (the averager process's event loop only)."""
    _banned: dict[str, str]
    _join_timing: JoinTiming
    _early: EarlyAssembly
    peer_id: PeerID
    request_wait_s: float = 5.0
    """How long a caller of a one-request RPC has to send its request (``bounded_rpc``); the averager sets it to
    ``SwarmConfig.request_timeout_s``."""
    first_part_wait_s: float = 30.0
    """How long a sender's all-reduce stream may wait for its first part; the averager sets it to
    ``SwarmConfig.next_chunk_timeout_s``, the wait hivemind's runner allows for every later part."""

    async def add_p2p_handlers(self, p2p: P2P, wrapper: Any = None, *, namespace: str | None = None,
                               balanced: bool = False) -> None:
        """hivemind's registration of every ``rpc_*`` handler, then the one-request ones moved to
        ``bounded_rpc.BoundedRequests``: hivemind's wrapper would wait without limit for their requests, before
        any check here runs. The daemon takes one handler per protocol, so each is removed and added again;
        this runs once, when the averager process starts, before matchmaking exists or any state is served."""
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)  # type: ignore[misc]
        waiting: dict[Any, int] = {}
        for rpc in BOUNDED_RPCS:
            name = rpc_handle_name(namespace, type(self).__name__, rpc)
            method = getattr(self if wrapper is None else wrapper, rpc)
            request_type = get_type_hints(getattr(type(self), rpc))["request"]  # as hivemind reads it
            served = BoundedRequests(name, method, request_type, p2p.peer_id, self.request_wait_s, waiting)
            await p2p.remove_binary_stream_handler(name)
            await p2p.add_binary_stream_handler(name, served.serve, balanced=balanced)

    def _ban(self, rejected: dict[str, str]) -> list[str]:
        """Ban every rejected peer for the rest of the run; return them as "peer id: reason"."""
        for peer, reason in rejected.items():
            if peer not in self._banned and peer != self.peer_id.to_base58():
                logger.warning("Banning %s for the rest of the run: %s", peer, reason)
                self._banned[peer] = reason
        return [f"{peer}: {reason}" for peer, reason in rejected.items()]

    def _refuse(self, peer: PeerID) -> str | None:
        """Why an RPC from ``peer`` is refused (not an allowed peer, banned), or ``None``."""
        name = peer.to_base58()
        if self._allowed is not None and name not in self._allowed:
            return "not in allowed_peers"
        if name in self._banned:
            return f"banned: {self._banned[name]}"
        return None

    def _guard_leaders(self) -> None:
        """Never ask a banned or not-allowed peer to lead our group.

        Without this a banned peer that declares itself a leader draws honest followers into a group they
        then refuse to average with, and they skip the round: a cheap way for a hostile peer to stall the
        swarm. hivemind's averager builds its ``Matchmaking`` inside its process's main coroutine, with no
        hook to customise it, so this wraps that instance's join request once, from the first round's step.
        """
        matchmaking = getattr(self, "_matchmaking", None)
        if matchmaking is None or getattr(matchmaking, "_leaders_guarded", False):
            return
        request = matchmaking._request_join_group

        async def guarded(leader: PeerID) -> Any:
            reason = self._refuse(leader)
            if reason is not None:
                logger.info("Not asking %s to lead our group: %s", leader, reason)
                return None
            return await request(leader)

        matchmaking._request_join_group = guarded
        matchmaking._leaders_guarded = True

    def _epoch_mismatch(self, gather: bytes) -> str | None:
        """Why a follower of another epoch cannot join our group, or ``None``.

        Peers at different epochs could only form a group that refuses them afterwards (``plan_group``), and
        that round is lost for every member. A peer that fell behind (a joiner whose download outlasted the
        round, a peer back from a partition) must not take the others' round with it: it is turned away here,
        finds no group, and catches up on its own.
        """
        control = getattr(getattr(self, "_matchmaking", None), "step_control", None)
        if control is None:
            return None  # not looking for a group: hivemind's own answer follows
        try:
            theirs = decode_gather(unsigned_payload(gather))[2].epoch  # checked again, signed, in plan_group
            ours = decode_gather(unsigned_payload(control.data_for_gather))[2].epoch
        except ValueError:
            return None  # malformed metadata is refused, with its reason, by plan_group
        return None if theirs == ours else f"its epoch {theirs} differs from ours {ours}"

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking, closed to peers that are not allowed or banned."""
        reason = self._refuse(context.remote_id)
        if reason is not None:
            logger.warning("Refused to group with %s: %s", context.remote_id, reason)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        mismatch = self._epoch_mismatch(request.gather)
        if mismatch is not None:
            logger.info("Not grouping with %s: %s", context.remote_id, mismatch)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_KEY)
            return
        began = False
        with self._join_timing.leader_view(request) as view:
            async for response in super().rpc_join_group(view, context):  # type: ignore[misc]
                if response.code == averaging_pb2.ACCEPTED:
                    self._early.follower_joined()
                began = response.code == averaging_pb2.BEGIN_ALLREDUCE
                yield response
        if began:  # hivemind's handler is done (the follower is no longer pending): keep its stream open
            await self._join_timing.hold_until_follower_closes()

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's part exchange, closed to peers that are not allowed (banned ones are handled by the
        reducer, which drops their data but still answers, so the group's results stay identical)."""
        if self._allowed is not None and context.remote_id.to_base58() not in self._allowed:
            logger.warning("Refused all-reduce data from %s: not in allowed_peers", context.remote_id)
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        # hivemind's handler awaits the first part without a limit (its runner bounds the later ones by the
        # sender timeout): a stream held open without one ends here, with the handler, after the same wait.
        try:
            first = await asyncio.wait_for(anext(stream), self.first_part_wait_s)
        except (asyncio.TimeoutError, StopAsyncIteration):
            logger.debug("Closed an all-reduce stream from %s: no part within %.1f s", context.remote_id,
                         self.first_part_wait_s)
            return
        parts = achain(as_aiter(first), stream)
        async for message in super().rpc_aggregate_part(parts, context):  # type: ignore[misc]
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's state download, closed to peers that are not allowed or banned, at most one per peer and
        ``MAX_STATE_DOWNLOADS`` at once (a refused joiner gets an empty answer and asks its next donor)."""
        reason = self._refuse(context.remote_id)
        peer = context.remote_id.to_base58()
        serving = self._serving = self._serving if self._serving is not None else {}
        if reason is None and peer in serving:
            reason = "it is already downloading our state"
        if reason is None and sum(serving.values()) >= MAX_STATE_DOWNLOADS:
            reason = f"{MAX_STATE_DOWNLOADS} downloads are being served already"
        if reason is not None:
            logger.warning("Refused a state download by %s: %s", context.remote_id, reason)
            return
        serving[peer] = 1
        try:
            async for message in super().rpc_download_state(request, context):  # type: ignore[misc]
                yield message
        finally:
            serving.pop(peer, None)


    async def rpc_state_chunk(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """A state chunk or manifest (``swarm.chunk_transfer``), closed to peers that are not allowed or banned,
        at most ``MAX_CHUNK_STREAMS_PER_PEER`` per peer and ``MAX_CHUNK_STREAMS`` at once (a refused joiner
        gets an empty answer and fetches from its other donors)."""
        reason = self._refuse(context.remote_id)
        peer = context.remote_id.to_base58()
        serving = self._chunk_serving = self._chunk_serving if self._chunk_serving is not None else {}
        if reason is not None:
            logger.warning("Refused a state chunk to %s: %s", context.remote_id, reason)
            return
        if serving.get(peer, 0) >= MAX_CHUNK_STREAMS_PER_PEER or sum(serving.values()) >= MAX_CHUNK_STREAMS:
            logger.info("Refused a state chunk to %s: busy (%d chunk requests served)", context.remote_id,
                        sum(serving.values()))
            return
        serving[peer] = serving.get(peer, 0) + 1
        try:
            async for message in super().rpc_state_chunk(request, context):  # type: ignore[misc]
                yield message
        finally:
            serving[peer] -= 1
            if not serving[peer]:
                del serving[peer]
