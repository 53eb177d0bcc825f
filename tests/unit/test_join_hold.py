"""A leader keeps a follower's join stream open after BEGIN_ALLREDUCE until the follower closes it
(``swarm/patience.py``: closed right behind that message, the p2p daemon could reset the stream with the message
still in flight, and the follower searched on while the leader counted it in)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from tests.averager_process import process_for_tests

CONTEXT = SimpleNamespace(remote_id=PeerID(b"\x02" * 34))


class _Matchmaking:
    """hivemind's side of ``rpc_join_group``: the messages its leader sends one follower, in order."""

    def __init__(self, codes: list[int]):
        self.codes = codes

    async def rpc_join_group(self, request, context):  # noqa: ANN001, ANN202 - hivemind's signature
        for code in self.codes:
            yield averaging_pb2.MessageFromLeader(code=code)


def _join(codes: list[int], hold_s: float) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
    """The join handler of a leader that is not searching (no epoch check), holding for ``hold_s``."""
    process = process_for_tests(request_timeout_s=hold_s / 2, matchmaking_time_s=max(1.0, hold_s),
                                matchmaking_timeout_s=max(2.0, 2 * hold_s), min_group_size=3)
    return process.join_group(_request(), CONTEXT, None, _Matchmaking(codes).rpc_join_group)


def _request() -> averaging_pb2.JoinRequest:
    return averaging_pb2.JoinRequest(expiration=1e12, gather=b"meta", schema_hash=b"s")


def test_the_stream_stays_open_after_begin_allreduce_until_the_follower_closes_it() -> None:
    async def scenario() -> tuple[list[int], bool, bool]:
        stream = _join([averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE], hold_s=60.0)
        codes = [(await anext(stream)).code, (await anext(stream)).code]
        rest = asyncio.ensure_future(anext(stream))
        for _ in range(20):  # let the handler run as far as it can: it must stop at the hold
            await asyncio.sleep(0)
        held = not rest.done()
        rest.cancel()  # the follower closed its end: hivemind's stream handler cancels the handler task
        await asyncio.wait({rest})
        return codes, held, rest.cancelled()

    codes, held, closed = asyncio.run(scenario())
    assert codes == [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE]
    assert held, "the leader closed the stream right behind BEGIN_ALLREDUCE"
    assert closed


def test_the_hold_is_bounded_and_only_follows_begin_allreduce() -> None:
    async def messages(codes: list[int], hold_s: float) -> list[int]:
        return [m.code async for m in _join(codes, hold_s)]

    async def scenario() -> tuple[list[int], list[int]]:
        # a follower that died never closes: the stream ends after hold_s (0.2 s here) all the same
        begun = await asyncio.wait_for(messages([averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE], 0.2), 30)
        # a disbanded group ends at once, even with a long hold: the follower reads that message and moves on
        disbanded = await asyncio.wait_for(messages([averaging_pb2.ACCEPTED, averaging_pb2.GROUP_DISBANDED], 60), 30)
        return begun, disbanded

    begun, disbanded = asyncio.run(scenario())
    assert begun == [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE]
    assert disbanded == [averaging_pb2.ACCEPTED, averaging_pb2.GROUP_DISBANDED]
