"""``swarm.bounded_rpc``: a one-request RPC's request is read within a time and size bound, before its handler.

Driven with asyncio's own stream reader (fed the bytes a caller sends) and a writer that records what the
server writes, framed as hivemind frames messages (``P2P.send_protobuf``), so the cases run without a daemon.
The live versions (a real averager, an attacker holding streams) are ``tests/integration/test_held_streams.py``
and, for answers nobody reads, ``tests/integration/test_slot_holders.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from p2p_diloco.swarm import access, bounded_rpc
from p2p_diloco.swarm.access import AccessGate
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


# ------------------------------------------------------------------ answers nobody reads (issue 51, finding 2)

PART = averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=b"\x01" * (1 << 18)))
"""One part of a state chunk answer, the size ``chunk_transfer.PART_BYTES`` sends."""
STALL_S = getattr(bounded_rpc, "STALL_S", 4.0)
ASKED = frame(REQUEST) + END
FULL_CHUNK = frame(PART) * 4


class Unread(Recorder):
    """A caller that asked and never reads: every write waits for buffer space that never comes."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = asyncio.Event()

    async def drain(self) -> None:
        self.stuck.set()
        await asyncio.Event().wait()


def chunk_handler(gate: AccessGate) -> Any:
    """``AveragerProcess.state_chunk`` in small: the real gate, then a 1 MiB chunk in four parts."""
    async def handler(request: Any, context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        with gate.chunk_slot(context.remote_id) as refused:
            if refused is not None:
                return
            for _ in range(4):
                yield PART

    return handler


def peer(n: int) -> PeerID:
    return PeerID(bytes([n]) * 34)


class Donor:
    """One donor's ``rpc_state_chunk`` server on a clock the test moves, and the streams it serves."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.clock = 1000.0
        monkeypatch.setattr(bounded_rpc, "_now", lambda: self.clock, raising=False)
        self.gate = AccessGate("donor", None)
        self.server = BoundedRequests("ns::RoundAverager.rpc_state_chunk", chunk_handler(self.gate),
                                      averaging_pb2.DownloadData, CALLER, 5.0, {})
        self.held: list[tuple[asyncio.Task, Unread]] = []
        self.readers: dict[Recorder, asyncio.StreamReader] = {}

    def stream(self, who: PeerID, writer: Recorder) -> asyncio.Task:
        reader = self.readers[writer] = asyncio.StreamReader()
        reader.feed_data(ASKED)  # and keeps its end open
        return asyncio.create_task(self.server.serve(StreamInfo(who, None, "p"), reader, writer))  # type: ignore[arg-type]

    async def hold(self, identities: int, streams: int, first: int = 1) -> list[Unread]:
        """``identities`` x ``streams`` unread answers, once each one's first message waits to leave."""
        writers = []
        for n in range(first, first + identities):
            for _ in range(streams):
                writer = Unread()
                self.held.append((self.stream(peer(n), writer), writer))
                writers.append(writer)
        await asyncio.wait_for(asyncio.gather(*(w.stuck.wait() for w in writers)), 10)
        return writers

    async def honest(self) -> Recorder:
        writer = Recorder()
        await asyncio.wait_for(self.stream(peer(200), writer), 30)
        return writer

    async def queued(self) -> tuple[Recorder, asyncio.Task]:
        """An honest request, once it waits in line for a slot."""
        writer = Recorder()
        task = self.stream(peer(200), writer)
        for _ in range(1000):
            if self.server.slots.waiting:
                break
            await asyncio.sleep(0)
        return writer, task

    async def close(self) -> None:
        for task, _ in self.held:
            task.cancel()
        await asyncio.gather(*(task for task, _ in self.held), return_exceptions=True)


def test_answers_nobody_reads_cannot_hold_every_slot_from_an_honest_joiner(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 identities x 4 streams take all 16 slots and read nothing; once their messages waited ``STALL_S``, an
    honest request takes the slot of one of them and gets its whole chunk. Before: it got an empty answer
    ("busy") for as long as the holders kept reading a trickle (120 s per message)."""
    async def run() -> tuple[Recorder, list[bool], dict[str, int]]:
        donor = Donor(monkeypatch)
        try:
            unread = await donor.hold(identities=4, streams=access.MAX_CHUNK_STREAMS_PER_PEER)
            donor.clock += STALL_S + 1
            honest = await donor.honest()
            return honest, [w.closed for w in unread], dict(donor.gate._chunk_serving)
        finally:
            await donor.close()

    honest, unread, serving = asyncio.run(run())
    assert bytes(honest.data) == FULL_CHUNK and honest.closed, "the honest request was refused"
    assert sum(unread) == 1  # one holder cut for it, the other 15 untouched
    assert sum(serving.values()) == access.MAX_CHUNK_STREAMS - 1  # the honest one's slot is free again


def test_nothing_is_cut_below_capacity_and_the_most_stalled_answer_goes_first(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """A slow reader keeps its answer while slots are free; when none is, the longest-waiting answer is cut."""
    async def run() -> tuple[Recorder, list[bool], Recorder, list[bool], list[bool]]:
        donor = Donor(monkeypatch)
        try:
            older = await donor.hold(identities=3, streams=access.MAX_CHUNK_STREAMS_PER_PEER)  # 12 of 16
            donor.clock += 10 * STALL_S
            served = await donor.honest()
            before = [w.closed for w in older]
            recent = await donor.hold(identities=1, streams=access.MAX_CHUNK_STREAMS_PER_PEER, first=50)
            donor.clock += STALL_S  # all 16 stalled now, the 12 older ones longest
            newcomer = Recorder()
            await asyncio.wait_for(donor.stream(peer(51), newcomer), 30)
            return served, before, newcomer, [w.closed for w in older], [w.closed for w in recent]
        finally:
            await donor.close()

    served, before, newcomer, older, recent = asyncio.run(run())
    assert bytes(served.data) == FULL_CHUNK and not any(before)
    assert bytes(newcomer.data) == FULL_CHUNK and sum(older) == 1 and not any(recent)


def test_a_request_waits_for_a_slot_to_stall_and_a_full_donor_whose_answers_leave_in_time_cuts_nobody(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder that asks again whenever its answer is cut has all 16 answers fresh for ``STALL_S``: a request
    then waits for the first to stall instead of being refused; if none does within ``ADMIT_WAIT_S``, the gate
    refuses it and nobody is cut."""
    async def waits() -> tuple[Recorder, list[bool]]:
        donor = Donor(monkeypatch)
        try:
            unread = await donor.hold(identities=4, streams=access.MAX_CHUNK_STREAMS_PER_PEER)
            honest, task = await donor.queued()
            assert [a.peer for a in donor.server.slots.waiting] == [peer(200)]
            donor.clock += STALL_S
            await asyncio.wait_for(task, 30)
            return honest, [w.closed for w in unread]
        finally:
            await donor.close()

    honest, unread = asyncio.run(waits())
    assert bytes(honest.data) == FULL_CHUNK and sum(unread) == 1

    monkeypatch.setattr(bounded_rpc, "ADMIT_WAIT_S", 0.2, raising=False)

    async def run() -> tuple[Recorder, list[bool], Recorder]:
        donor = Donor(monkeypatch)
        try:
            unread = await donor.hold(identities=4, streams=access.MAX_CHUNK_STREAMS_PER_PEER)
            donor.clock += STALL_S / 2
            early = await donor.honest()
            donor.clock += STALL_S
            # a holder asking again takes nobody's slot: it has its 4 (the gate refuses it)
            again = Recorder()
            await asyncio.wait_for(donor.stream(peer(1), again), 30)
            return early, [w.closed for w in unread], again
        finally:
            await donor.close()

    early, unread, again = asyncio.run(run())
    assert not early.data and not again.data and not any(unread)


def test_a_slot_a_holder_frees_goes_to_the_request_waiting_before_its_next_one(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """A holder that closes a stream and asks again at once (its answers always fresh) does not get the slot
    back: the request already waiting does."""
    async def run() -> tuple[Recorder, Unread]:
        donor = Donor(monkeypatch)
        try:
            unread = await donor.hold(identities=4, streams=access.MAX_CHUNK_STREAMS_PER_PEER)
            honest, task = await donor.queued()
            slots = donor.server.slots
            donor.readers[unread[0]].feed_eof()  # the holder closes one stream and reopens it
            for _ in range(1000):
                if len(slots.answers) < access.MAX_CHUNK_STREAMS:
                    break
                await asyncio.sleep(0)
            again = Unread()
            donor.held.append((donor.stream(peer(1), again), again))
            await asyncio.wait_for(task, 30)
            return honest, again
        finally:
            await donor.close()

    honest, again = asyncio.run(run())
    assert bytes(honest.data) == FULL_CHUNK


def test_an_answer_not_read_within_its_size_at_the_floor_rate_is_cut_and_its_slot_freed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounded_rpc, "WRITE_BASE_S", 0.05)
    monkeypatch.setattr(bounded_rpc, "WRITE_FLOOR_BPS", 1 << 40)

    async def run() -> tuple[Unread, dict[str, int]]:
        donor = Donor(monkeypatch)
        writer = Unread()
        await asyncio.wait_for(donor.stream(peer(1), writer), 30)
        return writer, dict(donor.gate._chunk_serving)

    writer, serving = asyncio.run(run())
    assert writer.closed and serving == {}
    assert bounded_rpc.write_deadline_s(0) == bounded_rpc.WRITE_BASE_S
    # a 256 KiB part at the default floor rate: well under the old flat 120 s, and 4x a 4 Mbit/s relay's share
    assert 10 < bounded_rpc.WRITE_BASE_S + (1 << 18) / (8 * 1024) < 120


def test_the_slots_taken_back_are_the_gates() -> None:
    assert bounded_rpc.ANSWER_SLOTS["rpc_state_chunk"] == (access.MAX_CHUNK_STREAMS, access.MAX_CHUNK_STREAMS_PER_PEER)
