"""The averager process's side of ``RoundAverager``: :class:`AveragerProcess`, made in that process only.

hivemind's ``DecentralizedAverager`` is a ``multiprocessing.Process``: its RPC handlers, its overrides and the
commands of the training process (``swarm.commands``) run in the background process, on one event loop. Every
one of those ``RoundAverager`` hooks hands its work to the one ``AveragerProcess`` that ``RoundAverager.run``
makes there, first thing, so the training process holds none (its ``RoundAverager._process`` is ``None``), and
what runs where shows in the types:

- rounds (``commands.Step``, ``commands.GiveUp``): ``round_process.RoundProcess``;
- who may talk to this peer (the join, all-reduce and chunk handlers, ``commands.Ban``):
  ``access.AccessGate``;
- state chunks served to joiners (``rpc_state_chunk``): ``chunk_transfer.ChunkServer``; fetched from donors
  (``commands.FetchManifests``, ``commands.FetchChunks``): ``chunk_transfer.ChunkFetcher``.

Each helper gets its state when it is made here; what it needs of hivemind's averager comes through the
callables and the ``round_process.HivemindSide`` given to it, never through a shared ``self``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, ClassVar

import torch
from hivemind.averaging.control import StepControl
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import achain, as_aiter

from p2p_diloco.swarm import commands
from p2p_diloco.swarm.access import AccessGate, epoch_mismatch
from p2p_diloco.swarm.buffer_layout import BufferLayout
from p2p_diloco.swarm.chunk_transfer import ChunkFetcher, ChunkServer, ServingCounters
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.patience import JoinTiming
from p2p_diloco.swarm.quorum import EarlyAssembly
from p2p_diloco.swarm.round_process import HivemindSide, RoundProcess
from p2p_diloco.swarm.runner import FaultHook

logger = logging.getLogger(__name__)

MAX_PART_STREAMS_PER_PEER = 8
"""How many all-reduce streams (``rpc_aggregate_part``) one peer may hold open to this one at once. An honest
member opens two per round (its parts, the completion check), the last round's may still be closing, and with
fragments a second round may be in flight: 6 at most. Each stream beyond is refused at once, so one identity
cannot pile up handlers that each wait ``next_chunk_timeout_s`` for a first part."""


class StreamCap:
    """Counts the open streams of each peer and refuses those beyond ``limit`` (:meth:`slot`)."""

    def __init__(self, limit: int = MAX_PART_STREAMS_PER_PEER) -> None:
        self.limit = limit
        self.open: dict[str, int] = {}
        """Peer id -> its streams open now (peers with none are not kept)."""

    @contextlib.contextmanager
    def slot(self, peer: str) -> Iterator[str | None]:
        """Hold one of ``peer``'s slots while the block runs; yields why it is refused, or ``None``."""
        count = self.open.get(peer, 0)
        if count >= self.limit:
            yield f"{count} all-reduce streams already open (at most {self.limit} per peer)"
            return
        self.open[peer] = count + 1
        try:
            yield None
        finally:
            left = self.open.get(peer, 1) - 1
            if left > 0:
                self.open[peer] = left
            else:
                self.open.pop(peer, None)


class AveragerProcess:
    """What the averager process keeps and does for ``RoundAverager`` (the module docstring).

    :param cfg: the swarm's settings.
    :param own_id: this peer's base58 id.
    :param layout: the pseudo-gradient's layout in the shared buffer (the whole model's, or per fragment).
    :param allowed: a private swarm's members (``None``: anyone).
    :param tolerance: the codec's norm tolerances (``averager.codec_tolerance``).
    :param counters: the serving counters shared with the training process.
    :param host_state: hivemind's fetch of the served state from the training process.
    :param sharing: whether this peer shares state now.
    :param stub: hivemind's stub of a donor's averager servicer (base58 id), on this process's ``P2P``.
    :param fault_hook: test-only, see ``runner.FaultHook``.
    """

    COMMANDS: ClassVar[dict[type, str]] = {
        commands.Step: "_step",
        commands.GiveUp: "_give_up",
        commands.Ban: "_ban",
        commands.FetchManifests: "_fetch_manifests",
        commands.FetchChunks: "_fetch_chunks",
    }
    """The one table of what the training process may ask of the averager process (``swarm.commands``): the
    command's type -> the method of this class that runs it, with the command's fields as its keyword arguments
    (``commands.Step`` also gets hivemind's side of the round)."""

    def __init__(self, cfg: SwarmConfig, own_id: str, layout: BufferLayout,
                 allowed: frozenset[str] | None, tolerance: float | None, counters: ServingCounters,
                 host_state: Callable[[], Awaitable[tuple[Any, Any, Any]]], sharing: Callable[[], bool],
                 stub: Callable[[str], Any], fault_hook: FaultHook):
        self.cfg = cfg
        self.gate = AccessGate(own_id, allowed)
        self.join_timing = JoinTiming(cfg.request_timeout_s)
        self.early = EarlyAssembly(cfg.min_group_size)
        self.rounds = RoundProcess(cfg, layout, self.gate, self.join_timing, self.early, tolerance, fault_hook)
        self.chunks = ChunkServer(counters, host_state, sharing, fault_hook)
        self.fetcher = ChunkFetcher(stub, cfg.next_chunk_timeout_s)
        self.part_streams = StreamCap()
        """Open ``rpc_aggregate_part`` streams per peer (:meth:`aggregate_part`)."""
        self._running: set[asyncio.Task[Any]] = set()
        """The tasks of the commands running now (``run_command``), held until each ends."""

    async def run_command(self, command: commands.Command, side: Callable[[], HivemindSide]) -> None:
        """Run one command from the training process; ``side`` reads hivemind's side of a round.

        The command's task is held here while it runs. hivemind's loop starts each command with
        ``asyncio.create_task`` and keeps no reference to it, and asyncio holds tasks only weakly: a round
        whose chain of awaits reached the loop only through futures nobody else holds (a DHT call's
        ``MPFuture``, which hivemind also holds weakly) was garbage that the cycle collector could take at any
        moment. It did, as a round was being given up: "Task was destroyed but it is pending!" for the
        round, its search and its declarations; the search's context could not close ("aclose(): asynchronous
        generator is already running") and kept hivemind's search lock, so this peer never declared or looked
        for a group again. In a CI rehearsal and in 1 of 9 local runs of the relay-capture tests that peer was
        cut from every round for the rest of the run, each time catching up and searching alone."""
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
        try:
            handler = getattr(self, self.COMMANDS[type(command)])
            kwargs = {f.name: getattr(command, f.name) for f in dataclasses.fields(command)}
            if isinstance(command, commands.Step):
                kwargs["side"] = side()
            await handler(**kwargs)
        finally:
            if task is not None:
                self._running.discard(task)

    async def _step(self, side: HivemindSide, step: StepControl, future_for_init: MPFuture, due: tuple[str, ...],
                    allreduce_timeout: float, stale: list[torch.Tensor] | None, step_back: bool,
                    epoch: int | None, fragment: int) -> None:
        await self.rounds.step(side, step=step, future_for_init=future_for_init, due=due,
                               allreduce_timeout=allreduce_timeout, stale=stale, step_back=step_back, epoch=epoch,
                               fragment=fragment)

    async def _give_up(self, future: MPFuture) -> None:
        future.set_result(self.rounds.search.request())

    async def _ban(self, peer_id: str, reason: str, future: MPFuture) -> None:
        self.gate.ban({peer_id: reason})
        future.set_result(None)

    async def _fetch_manifests(self, peers: list[str], timeout: float, max_bytes: int, base: str | None,
                               future: MPFuture) -> None:
        await self.fetcher.fetch_manifests(peers, timeout, max_bytes, base, future)

    async def _fetch_chunks(self, peers: list[str], sha: str, dest: list[torch.Tensor], n_params: int,
                            digests: bytes, have: list[int], partial: str | None, timeout: float,
                            future: MPFuture) -> None:
        await self.fetcher.fetch_chunks(peers, sha, dest, n_params, digests, have, partial, timeout, future)

    # ------------------------------------------------------------------ RPC handlers

    async def join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext, matchmaking: Any,
                         hivemind_join: Callable[..., AsyncIterator[averaging_pb2.MessageFromLeader]]
                         ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking (``hivemind_join``), closed to peers that are not allowed or banned, and to
        followers of another epoch; a follower that began the all-reduce keeps its stream until it closes it."""
        reason = self.gate.refuse(context.remote_id)
        if reason is not None:
            logger.warning("Refused to group with %s: %s", context.remote_id, reason)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        mismatch = epoch_mismatch(request.gather, matchmaking)
        if mismatch is not None:
            logger.info("Not grouping with %s: %s", context.remote_id, mismatch)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_KEY)
            return
        began = False
        with self.join_timing.leader_view(request) as view:
            async for response in hivemind_join(view, context):
                if response.code == averaging_pb2.ACCEPTED:
                    self.early.follower_joined()
                began = response.code == averaging_pb2.BEGIN_ALLREDUCE
                yield response
        if began:  # hivemind's handler is done (the follower is no longer pending): keep its stream open
            await self.join_timing.hold_until_follower_closes()

    async def aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext,
                             hivemind_part: Callable[..., AsyncIterator[averaging_pb2.AveragingData]]
                             ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's part exchange (``hivemind_part``), closed to peers that are not allowed (banned ones are
        the reducer's), to a peer's streams beyond ``MAX_PART_STREAMS_PER_PEER`` open at once, and ended when
        no first part comes within ``next_chunk_timeout_s``."""
        reason = self.gate.refuse_parts(context.remote_id)
        if reason is not None:
            logger.warning("Refused all-reduce data from %s: %s", context.remote_id, reason)
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        with self.part_streams.slot(context.remote_id.to_base58()) as refused:
            if refused is not None:
                logger.info("Refused all-reduce data from %s: %s", context.remote_id, refused)  # a flood: no warnings
                yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            # hivemind's handler awaits the first part without a limit (its runner bounds the later ones by the
            # sender timeout): a stream held open without one ends here, with the handler, after the same wait.
            wait_s = self.cfg.next_chunk_timeout_s
            try:
                first = await asyncio.wait_for(anext(stream), wait_s)
            except (asyncio.TimeoutError, StopAsyncIteration):
                logger.debug("Closed an all-reduce stream from %s: no part within %.1f s", context.remote_id,
                             wait_s)
                return
            async for message in hivemind_part(achain(as_aiter(first), stream), context):
                yield message

    async def state_chunk(self, request: averaging_pb2.DownloadData, context: P2PContext
                          ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """A state chunk or manifest (``chunk_transfer.ChunkServer``), closed to peers that are not allowed or
        banned, and bounded per peer and in all (``access.AccessGate.chunk_slot``): a refused joiner gets an
        empty answer and fetches from its other donors."""
        with self.gate.chunk_slot(context.remote_id) as refused:
            if refused is not None:
                log = logger.info if refused.startswith("busy") else logger.warning
                log("Refused a state chunk to %s: %s", context.remote_id, refused)
                return
            async for message in self.chunks.serve(request):
                yield message
