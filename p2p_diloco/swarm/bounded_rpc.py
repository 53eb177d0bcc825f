"""The server side of the averager's one-request RPCs, bounded in time and size before anything else runs.

hivemind serves an RPC that takes one request and streams its answer (``rpc_join_group``, ``rpc_download_state``,
``rpc_state_chunk``) through a wrapper that reads the whole request stream before it calls the handler: the
8-byte length prefix of each message is believed as sent (``P2P.receive_raw_data`` reads that many bytes), and
the request is not handed over until the end-of-stream marker arrives. Neither read has a time limit, and both
run before the handler's own checks (allow-list, bans, per-peer stream caps). So any identity held one server
stream and one file descriptor per stream it opened, for as long as it liked (``benchmarks/held_streams.py``:
3000 streams from one identity held on a donor, about 1000 enough to exhaust a donor at a 1024 open-files limit).

``BoundedRequests.serve`` replaces that wrapper for those three handlers, on hivemind's public stream API
(``P2P.add_binary_stream_handler``) and its own message framing (``P2P.send_protobuf``). It reads exactly one
request and its end-of-stream marker, each message at most ``MAX_REQUEST_BYTES``, all within ``wait_s``, and
at most ``MAX_WAITING_PER_PEER`` streams of one peer wait for theirs; a stream that breaks any of that is
closed, with nothing called. The answer is streamed as hivemind does (an exception goes to the caller as
hivemind's ``RPCError``), each message written within :func:`write_deadline_s` (its size at a floor rate),
and the handler is cancelled as soon as the caller closes its end, as hivemind's wrapper cancels it:
``patience``'s join hold relies on that. The wire format is hivemind's, unchanged, so hivemind's own stubs call
these handlers.

Answers nobody reads (:class:`AnswerSlots`): a donor serves at most ``MAX_ANSWERS`` state chunk answers at once,
``MAX_ANSWERS_PER_PEER`` to one peer id, and identities are free, so callers that ask and never read would hold
every slot (4 identities x 4 streams, each message of an answer kept up to the write deadline) and deny every
joiner's manifests and chunks. So when every slot is taken, a new request takes the slot of the answer whose
current message has waited longest to leave, once it waited ``STALL_S`` (its caller reads slower than the
joiners sized for there), and that answer is cut; a request that finds none waits in line for one. A caller
keeps a slot only by reading it, at a 256 KiB part per ``STALL_S`` or more on every stream, so holding a
donor's slots costs real bytes of its bandwidth, not a trickle.

This is framing over hivemind's streams, not a transport of our own: the bytes still travel through its p2p
daemon. Bounding hivemind's wrapper itself would mean patching a private internal of ``P2P`` on every instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto.p2pd_pb2 import RPCError

logger = logging.getLogger(__name__)

BOUNDED_RPCS = ("rpc_join_group", "rpc_download_state", "rpc_state_chunk")
"""The averager's RPCs that take one request and stream their answer: the ones served here. The all-reduce's
``rpc_aggregate_part`` streams both ways and stays with hivemind's wrapper, which closes the stream when the
handler ends: ``AveragerProcess.aggregate_part`` ends it when no first part came within
``next_chunk_timeout_s``, and hivemind's runner bounds the later parts."""

MAX_REQUEST_BYTES = 1 << 16
"""Largest request message accepted, in bytes. The largest honest one is a join request, whose signed metadata is
capped at 8 KiB (``claims.MAX_SIGNED_GATHER_BYTES``); chunk and download requests are a few hundred bytes."""

MAX_WAITING_PER_PEER = 8
"""Streams of one peer id whose request has not arrived yet, across the three RPCs; a further one is closed at
once. An honest peer has at most a join request and a joiner's chunk requests out (``DEPTH`` 2 per worker, two
workers) to one donor, and each request arrives with its stream, so it is never near this. Identities are
free, so this alone bounds nothing; with ``wait_s`` it makes one held stream cost the attacker a connection
of its own per 8, each for at most ``wait_s``."""

WRITE_BASE_S = 10.0
"""Time any answer message has to leave this peer, whatever its size (:func:`write_deadline_s`): a join answer
or a manifest of a few bytes leaves at once unless about a megabyte of earlier answer sits unread in the
buffers before it, so 10 s covers any honest caller's scheduling hiccup and round trip."""
WRITE_FLOOR_BPS = 8 * 1024
"""Slowest rate, in bytes per second, at which an answer message must leave on top of ``WRITE_BASE_S``
(64 kbit/s: a 256 KiB part of a state chunk gets 42 s). A caller below it on one stream is cut off whether or
not anyone waits for the slot. Why this low: it applies with no contention, where cutting an honest joiner
only costs it this donor; a joiner on a 4 Mbit/s relay reading 16 streams gets 250 kbit/s each, 4x above it.
Contention is what ``STALL_S`` handles."""
STALL_S = 4.0
"""An answer whose current message has waited this long to leave may be cut for a new request when every slot
is taken (:class:`AnswerSlots`). A state chunk leaves in 256 KiB parts (``chunk_transfer.PART_BYTES``), so this
is a caller below 512 kbit/s on that stream: a joiner on a 20 Mbit/s downlink reading 16 streams at once gets
1.25 Mbit/s each (1.7 s a part), and even a slower one is cut only while its slot is wanted. It is also the
price of holding slots: 16 streams each read at 512 kbit/s, about 8 Mbit/s of the donor's uplink per donor."""
ADMIT_WAIT_S = STALL_S + 0.5
"""Longest a request that finds every slot taken waits for one to free or stall (:class:`AnswerSlots`): long
enough for any answer stalled just before it came to reach ``STALL_S``, below a joiner's wait for its first
message (``SwarmConfig.next_chunk_timeout_s``, 5 s on loopback, 30 s by default)."""
ADMIT_POLL_S = 0.1
"""How often a waiting request looks again for a free or stalled slot."""
MAX_ANSWERS = 16
"""State chunk answers served at once (``access.MAX_CHUNK_STREAMS``, which must equal it; the gate refuses
beyond it): the slots :class:`AnswerSlots` keeps for readers."""
MAX_ANSWERS_PER_PEER = 4
"""State chunk answers of one peer id at once (``access.MAX_CHUNK_STREAMS_PER_PEER``, equal): a request of a
peer that holds this many takes no slot from anyone, the gate refuses it."""
ANSWER_SLOTS = {"rpc_state_chunk": (MAX_ANSWERS, MAX_ANSWERS_PER_PEER)}
"""RPC -> (slots, slots per peer id) of the RPCs whose slots are limited and taken back from callers that do
not read (:class:`AnswerSlots`). Join answers are a few bytes and held by design (a leader holds a follower's
stream until it closes), so they are not among them."""


def write_deadline_s(size: int) -> float:
    """How long an answer message of ``size`` bytes may take to leave: ``WRITE_BASE_S`` plus its size at
    ``WRITE_FLOOR_BPS``."""
    return WRITE_BASE_S + size / WRITE_FLOOR_BPS


class RequestRefused(ValueError):
    """A request stream that broke the framing rules (too large, not a message, more than one request)."""


async def _read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One framed message: (marker, payload), its announced length checked before any payload is read."""
    marker = await reader.readexactly(1)
    if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
        raise RequestRefused(f"unknown message marker {marker!r}")
    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
    if length > MAX_REQUEST_BYTES:
        raise RequestRefused(f"a request message of {length} bytes (at most {MAX_REQUEST_BYTES})")
    return marker, await reader.readexactly(length)


async def read_single_request(reader: asyncio.StreamReader, request_type: type[Message]) -> Message:
    """Exactly one request message followed by hivemind's end-of-stream marker, or ``RequestRefused``.

    hivemind's client (its stubs' streaming call) writes the request and the marker (an error
    message, ``P2P.END_OF_STREAM``) back to back, so an honest caller's pair arrives within one round trip."""
    marker, payload = await _read_message(reader)
    if marker != P2P.MESSAGE_MARKER:
        raise RequestRefused("the stream ended before its request")
    request = request_type()
    try:
        request.ParseFromString(payload)
    except DecodeError as e:
        raise RequestRefused(f"the request does not decode: {e}") from e
    marker, _ = await _read_message(reader)
    if marker != P2P.ERROR_MARKER:
        raise RequestRefused("more than one request on a one-request stream")
    return request


Handler = Callable[[Any, P2PContext], AsyncIterator[Message]]


def _now() -> float:
    return time.monotonic()


@dataclass(eq=False)
class _Answer:
    """One answer being served: whose, its task, and since when its current message waits to leave."""

    peer: Any
    task: asyncio.Task | None = None
    writing_since: float | None = None


@dataclass
class AnswerSlots:
    """The answers of one RPC in progress, and which one a new request takes the slot of when all are taken.

    The handler's own gate (``access.AccessGate.chunk_slot``) still decides who is served; this only frees a
    slot, before the handler runs, from an answer whose caller does not read it (see the module docstring).
    A request that finds every slot taken and none stalled waits up to ``ADMIT_WAIT_S`` for one, in line: the
    oldest waiting request gets the next slot freed or stalled, and a new one waits behind it even if a slot is
    free. Why: a holder that asks again as soon as its answer is cut (or that closes and reopens its streams)
    has every answer fresh for ``STALL_S`` after, and a joiner asking then was refused; in line, the slots that
    holder frees go to the joiner first. Lives on one event loop (the averager process's).

    :param capacity: slots of the RPC (``MAX_ANSWERS``): below it nothing is cut.
    :param per_peer: a peer holding (or waiting for) this many answers already frees no slot and waits for
      none (the gate refuses it anyway).
    """

    capacity: int
    per_peer: int
    answers: set[_Answer] = field(default_factory=set)
    waiting: list[_Answer] = field(default_factory=list)
    """Requests waiting for a slot, oldest first: the oldest takes the next stalled answer's slot."""
    cut: int = 0
    """Answers cut so far for a request that needed their slot."""

    def _stalled(self) -> _Answer | None:
        """The answer whose current message has waited longest, if that is ``STALL_S`` or more."""
        now = _now()
        writing = [a for a in self.answers if a.task is not None and a.writing_since is not None]
        victim = max(writing, key=lambda a: now - a.writing_since, default=None)  # type: ignore[operator]
        return victim if victim is not None and now - victim.writing_since >= STALL_S else None  # type: ignore[operator]

    def _holds(self, peer: Any) -> int:
        return sum(a.peer == peer for a in self.answers) + sum(a.peer == peer for a in self.waiting)

    async def admit(self, answer: _Answer) -> bool:
        """Count ``answer`` in once a slot is free, after the requests waiting before it; when every slot is
        taken, cut the most stalled answer first and wait for its handler to end (so that its gate slot is free
        when ``answer``'s handler asks for it), or wait up to ``ADMIT_WAIT_S`` for one to stall, then go on (the
        gate refuses it). False: not counted (its peer holds ``per_peer`` already: the gate refuses it)."""
        if self._holds(answer.peer) >= self.per_peer:
            return False
        victim = None
        if len(self.answers) >= self.capacity or self.waiting:
            loop = asyncio.get_running_loop()
            give_up = loop.time() + ADMIT_WAIT_S
            self.waiting.append(answer)
            try:
                while True:
                    if self.waiting[0] is answer:
                        if len(self.answers) < self.capacity:
                            break
                        victim = self._stalled()
                        if victim is not None:
                            break
                    if loop.time() >= give_up:
                        break
                    await asyncio.sleep(min(ADMIT_POLL_S, max(0.0, give_up - loop.time())))
            finally:
                self.waiting.remove(answer)
        self.answers.add(answer)  # before any await: requests arriving meanwhile see the slot taken
        if victim is None or victim.task is None or len(self.answers) <= self.capacity:
            return True
        self.answers.discard(victim)
        self.cut += 1
        logger.info("Cut an answer to %s, whose reader left a message waiting %.1f s, for a request of %s "
                    "(every slot taken; %d cut so far)", victim.peer, _now() - (victim.writing_since or 0.0),
                    answer.peer, self.cut)
        victim.task.cancel()
        await asyncio.wait({victim.task}, timeout=WRITE_BASE_S)
        return True

    def release(self, answer: _Answer) -> None:
        self.answers.discard(answer)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close the stream at once, dropping what is still buffered for a caller that did not read it."""
    transport = getattr(writer, "transport", None)
    if transport is not None:
        transport.abort()
    else:
        writer.close()


class BoundedRequests:
    """Serves one averager RPC (``handler``, an async generator taking a request and a ``P2PContext``) with
    its request read bounded: see the module docstring.

    :param name: the RPC's handle name (hivemind's ``namespace::Class.rpc_name``); ``context.handle_name``.
    :param handler: the averager's bound ``rpc_*`` method.
    :param request_type: the protobuf class of its request.
    :param local_id: this peer's id, for the context.
    :param wait_s: how long a caller has, from opening the stream, to send its request and the end-of-stream
      marker. ``SwarmConfig.request_timeout_s``: a caller that cannot send a few hundred bytes within the time
      every request of the swarm gets is cut off; an honest one sends both in one write.
    :param waiting: peer id -> its streams still waiting for their request, shared by the RPCs of one averager
      (its process's event loop only); see ``MAX_WAITING_PER_PEER``.
    :param slots: the RPC's answers in progress; by default ``ANSWER_SLOTS``'s for the RPC ``name`` ends
      with (none for the others: nothing is cut for a slot).
    """

    def __init__(self, name: str, handler: Handler, request_type: type[Message], local_id: Any, wait_s: float,
                 waiting: dict[Any, int], slots: AnswerSlots | None = None):
        self.name, self.handler, self.request_type = name, handler, request_type
        self.local_id, self.wait_s, self.waiting = local_id, wait_s, waiting
        limits = ANSWER_SLOTS.get(name.rsplit(".", 1)[-1])
        self.slots = slots if slots is not None else AnswerSlots(*limits) if limits is not None else None

    async def serve(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """hivemind's stream-handler callback (``P2P.add_binary_stream_handler``): one stream, one answer."""
        complete = False
        try:
            peer = info.peer_id
            if self.waiting.get(peer, 0) >= MAX_WAITING_PER_PEER:
                logger.debug("Closed a %s stream from %s: %d streams already wait for their request",
                             self.name, peer, MAX_WAITING_PER_PEER)
                complete = True
                return
            self.waiting[peer] = self.waiting.get(peer, 0) + 1
            try:
                request = await asyncio.wait_for(read_single_request(reader, self.request_type), self.wait_s)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, RequestRefused) as e:
                timed_out = isinstance(e, asyncio.TimeoutError)
                reason = f"no complete request within {self.wait_s:.1f} s" if timed_out else str(e)
                logger.debug("Closed a %s stream from %s: %s", self.name, peer, reason)
                complete = True
                return
            finally:
                self.waiting[peer] -= 1
                if not self.waiting[peer]:
                    del self.waiting[peer]
            context = P2PContext(handle_name=self.name, local_id=self.local_id, remote_id=info.peer_id)
            entry = _Answer(peer)
            if self.slots is not None:
                await self.slots.admit(entry)
            try:
                answer = entry.task = asyncio.create_task(self._answer(request, context, writer, entry))
                closed = asyncio.create_task(reader.read(1))  # b"" when the caller closes; anything else breaks the rules
                try:
                    await asyncio.wait({answer, closed}, return_when=asyncio.FIRST_COMPLETED)
                    complete = answer.done() and not answer.cancelled() and answer.result()
                finally:
                    answer.cancel()
                    closed.cancel()
                    if closed.done() and not closed.cancelled():
                        closed.exception()  # a reset is the caller's end closing too: retrieved, not logged
                    if not answer.done():  # its handler closes (its gate slot free) before the slot is counted free
                        await asyncio.wait({answer}, timeout=WRITE_BASE_S)
            finally:
                if self.slots is not None:
                    self.slots.release(entry)
        finally:
            if complete:
                writer.close()
            else:  # cut (not read in time, its slot taken, the caller gone): nothing buffered is kept for it
                _abort(writer)

    async def _answer(self, request: Message, context: P2PContext, writer: asyncio.StreamWriter,
                      entry: _Answer) -> bool:
        """Stream the handler's answer; False when a message could not be written in time (the answer is cut).
        The handler is closed before this returns, however it ends, so what it holds (a gate slot) is free."""
        messages = self.handler(request, context)
        try:
            async for response in messages:
                entry.writing_since = _now()
                try:
                    await asyncio.wait_for(P2P.send_protobuf(response, writer), write_deadline_s(response.ByteSize()))
                except Exception:  # noqa: BLE001 - the caller closed, broke or stopped reading: its side reports it
                    logger.debug("A %s answer to %s was not written", self.name, context.remote_id, exc_info=True)
                    return False
                entry.writing_since = None
        except Exception as e:  # noqa: BLE001 - as hivemind's wrapper: logged, and the caller gets the message
            logger.warning("Handler %s failed with the exception:", self.name, exc_info=True)
            error = RPCError(message=str(e))
            with suppress(Exception):
                await asyncio.wait_for(P2P.send_protobuf(error, writer), write_deadline_s(error.ByteSize()))
        finally:
            with suppress(Exception):
                await messages.aclose()  # type: ignore[attr-defined]
        return True
