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
hivemind's ``RPCError``), each message written within ``WRITE_S``, and the handler is cancelled as soon as the
caller closes its end, as hivemind's wrapper cancels it: ``patience``'s join hold relies on that. The wire format is hivemind's, unchanged, so hivemind's own stubs call these handlers.

This is framing over hivemind's streams, not a transport of our own: the bytes still travel through its p2p
daemon. Bounding hivemind's wrapper itself would mean patching a private internal of ``P2P`` on every instance.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import closing, suppress
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

WRITE_S = 120.0
"""Longest time one answer message may take to leave this peer. The largest is a 1 MiB state chunk: 120 s is
about 70 kbit/s, far below any uplink that can serve state; a caller that stops reading is cut off after it."""


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
    """

    def __init__(self, name: str, handler: Handler, request_type: type[Message], local_id: Any, wait_s: float,
                 waiting: dict[Any, int]):
        self.name, self.handler, self.request_type = name, handler, request_type
        self.local_id, self.wait_s, self.waiting = local_id, wait_s, waiting

    async def serve(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """hivemind's stream-handler callback (``P2P.add_binary_stream_handler``): one stream, one answer."""
        with closing(writer):
            peer = info.peer_id
            if self.waiting.get(peer, 0) >= MAX_WAITING_PER_PEER:
                logger.debug("Closed a %s stream from %s: %d streams already wait for their request",
                             self.name, peer, MAX_WAITING_PER_PEER)
                return
            self.waiting[peer] = self.waiting.get(peer, 0) + 1
            try:
                request = await asyncio.wait_for(read_single_request(reader, self.request_type), self.wait_s)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, RequestRefused) as e:
                timed_out = isinstance(e, asyncio.TimeoutError)
                reason = f"no complete request within {self.wait_s:.1f} s" if timed_out else str(e)
                logger.debug("Closed a %s stream from %s: %s", self.name, peer, reason)
                return
            finally:
                self.waiting[peer] -= 1
                if not self.waiting[peer]:
                    del self.waiting[peer]
            context = P2PContext(handle_name=self.name, local_id=self.local_id, remote_id=info.peer_id)
            answer = asyncio.create_task(self._answer(request, context, writer))
            closed = asyncio.create_task(reader.read(1))  # b"" when the caller closes; anything else breaks the rules
            try:
                await asyncio.wait({answer, closed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                answer.cancel()
                closed.cancel()
                if closed.done() and not closed.cancelled():
                    closed.exception()  # a reset is the caller's end closing too: retrieved, not logged

    async def _answer(self, request: Message, context: P2PContext, writer: asyncio.StreamWriter) -> None:
        try:
            async for response in self.handler(request, context):
                try:
                    await asyncio.wait_for(P2P.send_protobuf(response, writer), WRITE_S)
                except Exception:  # noqa: BLE001 - the caller closed, broke or stopped reading: its side reports it
                    logger.debug("A %s answer to %s was not written", self.name, context.remote_id, exc_info=True)
                    return
        except Exception as e:  # noqa: BLE001 - as hivemind's wrapper: logged, and the caller gets the message
            logger.warning("Handler %s failed with the exception:", self.name, exc_info=True)
            with suppress(Exception):
                await asyncio.wait_for(P2P.send_protobuf(RPCError(message=str(e)), writer), WRITE_S)
