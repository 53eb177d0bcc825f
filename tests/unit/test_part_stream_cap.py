"""One peer's all-reduce streams are capped (issue 51, finding 5d): ``rpc_aggregate_part`` refuses a peer's
streams beyond ``MAX_PART_STREAMS_PER_PEER`` at once, through the averager process's own handler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from p2p_diloco.swarm.access import AccessGate
from p2p_diloco.swarm.averager_process import MAX_PART_STREAMS_PER_PEER, AveragerProcess, StreamCap


def _peer(seed: int) -> PeerID:
    return PeerID(bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20]) + bytes([seed]) * 32)


def _process() -> AveragerProcess:
    process = object.__new__(AveragerProcess)  # only what aggregate_part uses
    process.gate = AccessGate(_peer(0).to_base58(), None)
    process.cfg = SimpleNamespace(next_chunk_timeout_s=3600.0)
    process.part_streams = StreamCap()
    return process


async def _echo(stream: AsyncIterator[averaging_pb2.AveragingData], _context: P2PContext
                ) -> AsyncIterator[averaging_pb2.AveragingData]:
    async for message in stream:
        yield message


class HeldStream:
    """A sender's stream that sends its first part only when released."""

    def __init__(self) -> None:
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[averaging_pb2.AveragingData]:
        self.entered.set()
        await self.release.wait()
        yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING)


async def _serve(process: AveragerProcess, peer: PeerID, stream: HeldStream) -> list[int]:
    context = P2PContext("aggregate", _peer(0), peer)
    return [m.code async for m in process.aggregate_part(stream.__aiter__(), context, _echo)]


def test_a_peer_beyond_its_stream_cap_is_refused_at_once_and_others_are_not() -> None:
    async def scenario() -> None:
        process, attacker, honest = _process(), _peer(1), _peer(2)
        held = [HeldStream() for _ in range(MAX_PART_STREAMS_PER_PEER)]
        tasks = [asyncio.create_task(_serve(process, attacker, s)) for s in held]
        await asyncio.gather(*(s.entered.wait() for s in held))
        assert process.part_streams.open == {attacker.to_base58(): MAX_PART_STREAMS_PER_PEER}
        extra = HeldStream()
        assert await _serve(process, attacker, extra) == [averaging_pb2.PROTOCOL_VIOLATION]
        assert not extra.entered.is_set()  # refused before reading anything
        other = HeldStream()
        other.release.set()
        assert await _serve(process, honest, other) == [averaging_pb2.PART_FOR_AVERAGING]
        held[0].release.set()
        assert await tasks[0] == [averaging_pb2.PART_FOR_AVERAGING]
        again = HeldStream()
        again.release.set()
        assert await _serve(process, attacker, again) == [averaging_pb2.PART_FOR_AVERAGING]  # a slot came free
        for s in held[1:]:
            s.release.set()
        await asyncio.gather(*tasks)
        assert process.part_streams.open == {}

    asyncio.run(asyncio.wait_for(scenario(), 60))  # bounded: a stream refused too late would hang here


def test_a_slot_is_given_back_when_the_stream_is_cut() -> None:
    async def scenario() -> None:
        process, peer = _process(), _peer(3)
        held = HeldStream()
        task = asyncio.create_task(_serve(process, peer, held))
        await held.entered.wait()
        assert process.part_streams.open == {peer.to_base58(): 1}
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert process.part_streams.open == {}

    asyncio.run(asyncio.wait_for(scenario(), 60))  # bounded: a stream refused too late would hang here
