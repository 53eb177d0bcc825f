"""``swarm.bounded_rpc``: a one-request RPC's request is read within a time and size bound, before its handler.

Driven with asyncio's own stream reader (fed the bytes a caller sends) and a writer that records what the
server writes, framed as hivemind frames messages (``P2P.send_protobuf``), so the cases run without a daemon.
The live version (a real averager, an attacker holding streams) is ``tests/integration/test_held_streams.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import averaging_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from p2p_diloco.swarm import bounded_rpc
from p2p_diloco.swarm.bounded_rpc import BoundedRequests

CALLER = PeerID(b"\x00" * 34)


class Recorder:
    """The part of ``asyncio.StreamWriter`` the server uses; keeps the bytes and whether it was closed."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        self.data += bytes(data)

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        self.closed = True


def frame(message: Any) -> bytes:
    """The bytes hivemind's client writes for one message (or, for an ``RPCError``, the end-of-stream)."""
    out = Recorder()
    asyncio.run(P2P.send_protobuf(message, out))  # type: ignore[arg-type]
    return bytes(out.data)


REQUEST = averaging_pb2.DownloadData(metadata=b"which chunk")
END = frame(P2P.END_OF_STREAM)


def serve(sent: bytes, *, eof: bool, handler: Any = None, wait_s: float = 5.0,
          after_start: Any = None, waiting: dict[Any, int] | None = None) -> tuple[list[Any], Recorder]:
    """Run one stream through ``BoundedRequests.serve``: the caller sends ``sent`` (then closes if ``eof``)."""
    calls: list[Any] = []

    async def echo(request: Any, context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        calls.append((request, context))
        yield averaging_pb2.DownloadData(metadata=b"first")
        yield averaging_pb2.DownloadData(metadata=b"second")

    async def run() -> Recorder:
        reader = asyncio.StreamReader()
        reader.feed_data(sent)
        if eof:
            reader.feed_eof()
        writer = Recorder()
        server = BoundedRequests("ns::RoundAverager.rpc_state_chunk", handler or echo, averaging_pb2.DownloadData,
                                 CALLER, wait_s, waiting if waiting is not None else {})
        task = asyncio.create_task(server.serve(StreamInfo(CALLER, None, "p"), reader, writer))  # type: ignore[arg-type]
        if after_start is not None:
            await after_start(reader, calls)
        await asyncio.wait_for(task, 30)
        return writer

    return calls, asyncio.run(run())


def test_one_request_and_its_end_are_answered_as_hivemind_frames_answers() -> None:
    calls, writer = serve(frame(REQUEST) + END, eof=False)
    assert [c[0] for c in calls] == [REQUEST]
    assert calls[0][1].remote_id == CALLER and calls[0][1].handle_name == "ns::RoundAverager.rpc_state_chunk"
    expected = frame(averaging_pb2.DownloadData(metadata=b"first")) + frame(averaging_pb2.DownloadData(metadata=b"second"))
    assert bytes(writer.data) == expected and writer.closed


@pytest.mark.parametrize("sent, why", [
    (P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER), "a 2^40-byte length prefix"),
    (frame(REQUEST) + frame(REQUEST) + END, "two requests"),
    (b"\x07" + frame(REQUEST), "an unknown marker"),
    (END, "no request before the end"),
    (P2P.MESSAGE_MARKER + (3).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\xff\xff\xff" + END, "undecodable"),
])
def test_a_stream_that_breaks_the_framing_is_closed_at_once_with_nothing_called(sent: bytes, why: str) -> None:
    # the caller keeps its end open: only the server's own check can end this stream before wait_s (600 s)
    calls, writer = serve(sent, eof=False, wait_s=600.0)
    assert calls == [] and writer.closed and not writer.data, why


@pytest.mark.parametrize("sent", [frame(REQUEST), b"", frame(REQUEST)[:5]])
def test_a_request_without_its_end_is_cut_off_after_the_wait(sent: bytes) -> None:
    calls, writer = serve(sent, eof=False, wait_s=0.2)
    assert calls == [] and writer.closed and not writer.data


def test_a_message_over_the_cap_is_refused_before_its_bytes_are_read() -> None:
    big = P2P.MESSAGE_MARKER + (bounded_rpc.MAX_REQUEST_BYTES + 1).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    calls, writer = serve(big, eof=False, wait_s=600.0)
    assert calls == [] and writer.closed
    at_cap = averaging_pb2.DownloadData(metadata=b"x" * (bounded_rpc.MAX_REQUEST_BYTES - 8))
    assert len(at_cap.SerializeToString()) <= bounded_rpc.MAX_REQUEST_BYTES
    calls, _ = serve(frame(at_cap) + END, eof=False)
    assert [c[0] for c in calls] == [at_cap]


def test_the_callers_close_cancels_a_running_handler() -> None:
    """``patience.JoinTiming.hold_until_follower_closes`` ends when the follower closes its join stream."""
    cancelled = asyncio.Event()

    async def holds(request: Any, context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        yield averaging_pb2.DownloadData(metadata=b"begin")
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def close_after_answer(reader: asyncio.StreamReader, calls: list[Any]) -> None:
        for _ in range(100):
            await asyncio.sleep(0)
        reader.feed_eof()

    _, writer = serve(frame(REQUEST) + END, eof=False, handler=holds, after_start=close_after_answer)
    assert cancelled.is_set() and writer.closed
    assert bytes(writer.data) == frame(averaging_pb2.DownloadData(metadata=b"begin"))


def test_a_handler_that_fails_sends_the_caller_hivemind_s_error_message() -> None:
    async def fails(request: Any, context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        yield averaging_pb2.DownloadData(metadata=b"part")
        raise RuntimeError("state changed under us")

    _, writer = serve(frame(REQUEST) + END, eof=False, handler=fails)
    expected = frame(averaging_pb2.DownloadData(metadata=b"part")) + frame(RPCError(message="state changed under us"))
    assert bytes(writer.data) == expected


def test_a_peer_with_too_many_streams_waiting_for_their_request_is_cut_off_and_the_count_is_returned() -> None:
    waiting = {CALLER: bounded_rpc.MAX_WAITING_PER_PEER}
    calls, writer = serve(frame(REQUEST) + END, eof=False, waiting=waiting)
    assert calls == [] and writer.closed and waiting == {CALLER: bounded_rpc.MAX_WAITING_PER_PEER}
    waiting = {CALLER: bounded_rpc.MAX_WAITING_PER_PEER - 1}
    calls, _ = serve(frame(REQUEST) + END, eof=False, waiting=waiting)
    assert [c[0] for c in calls] == [REQUEST] and waiting == {CALLER: bounded_rpc.MAX_WAITING_PER_PEER - 1}
    waiting = {}
    serve(frame(REQUEST), eof=False, wait_s=0.1, waiting=waiting)  # cut off: its count is returned too
    assert waiting == {}


def test_a_caller_whose_connection_resets_ends_its_stream_quietly() -> None:
    """A reset (``ConnectionResetError`` from the reader) before or after the request ends the stream, with
    nothing raised into hivemind's stream dispatcher."""
    sent = frame(REQUEST) + END

    async def run(after_request: bool) -> tuple[Recorder, bool]:
        reader = asyncio.StreamReader()
        if after_request:
            reader.feed_data(sent)
        writer = Recorder()
        running = asyncio.Event()

        async def waits(request: Any, context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
            running.set()
            await asyncio.sleep(600)
            yield averaging_pb2.DownloadData()

        server = BoundedRequests("n", waits, averaging_pb2.DownloadData, CALLER, 600.0, {})
        task = asyncio.create_task(server.serve(StreamInfo(CALLER, None, "p"), reader, writer))  # type: ignore[arg-type]
        if after_request:
            await asyncio.wait_for(running.wait(), 10)
        for _ in range(10):
            await asyncio.sleep(0)
        reader.set_exception(ConnectionResetError("reset by peer"))
        await asyncio.wait_for(task, 10)
        return writer, running.is_set()

    for after_request in (False, True):
        writer, ran = asyncio.run(run(after_request))
        assert writer.closed and ran == after_request
