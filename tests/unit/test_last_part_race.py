"""A reducer's last averaged part and the runner's registry slot, in-process, ordered by events (issue 55, 4).

1. The last-message race: the reducer read a sender's ``RECEIVED_ALL`` acknowledgement through hivemind's
   ``aiter_with_timeout(stream, sender_timeout)``, so its wait began as soon as the sender's last part was read,
   while that part still waited for the group's slower senders. Past ``sender_timeout`` the read timed out (and
   closed the sender's stream), and the reducer ended its reply stream right behind its last averaged part,
   which the p2p daemon can then drop (``runner.RECEIVED_ALL``). Here the sender_timeout of hivemind's reads
   expires at a moment the test chooses (an event, no clock): after the sender's last part arrived, before the
   slower sender's.
2. The runner's slot: hivemind's ``rpc_aggregate_part`` awaits the group's runner future unshielded, so one
   sender's handler cancelled while it waited (its sender died) cancelled the future, and every other sender's
   handler waiting on it ended in ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from hivemind.averaging import allreduce
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter

from p2p_diloco.swarm import registry
from p2p_diloco.swarm.runner import RECEIVED_ALL, ByteCounter, CountingAllReduceRunner, accumulate

pytestmark = pytest.mark.timeout(60)

ME, SENDER = PeerID(b"\x00\x04aaaa"), PeerID(b"\x00\x04bbbb")
GROUP = b"group-id"


@dataclass
class _Sender:
    """The sender's side of the stream: its one part, then its acknowledgement once ``ack`` is set."""

    ack: asyncio.Event = field(default_factory=asyncio.Event)
    ack_read: bool = False
    read_cancelled: bool = False

    async def stream(self) -> AsyncIterator[averaging_pb2.AveragingData]:
        yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=GROUP, weight=1.0,
                                          tensor_part=serialize_torch_tensor(torch.full((8,), 3.0)))
        try:
            await self.ack.wait()
        except asyncio.CancelledError:
            self.read_cancelled = True  # hivemind's timeout closed the stream
            raise
        self.ack_read = True
        yield averaging_pb2.AveragingData(code=RECEIVED_ALL)


@contextmanager
def _sender_timeout_expires_on(expired: asyncio.Event) -> Iterator[None]:
    """hivemind's per-read ``sender_timeout`` as an event: a read still waiting when ``expired`` is set fails
    with ``TimeoutError`` and is cancelled, as ``asyncio.wait_for`` does when the time is up."""

    async def aiter_with_timeout(iterable: Any, timeout: float | None) -> AsyncIterator[Any]:
        iterator = iterable.__aiter__()
        while True:
            read = asyncio.ensure_future(iterator.__anext__())
            expiry = asyncio.ensure_future(expired.wait())
            await asyncio.wait({read, expiry}, return_when=asyncio.FIRST_COMPLETED)
            expiry.cancel()
            if not read.done():
                read.cancel()
                await asyncio.wait({read})
                raise TimeoutError
            try:
                item = read.result()
            except StopAsyncIteration:
                return
            yield item

    with mock.patch.object(allreduce, "aiter_with_timeout", aiter_with_timeout):
        yield


def _reducer_of_two(sender_timeout: float = 60.0) -> CountingAllReduceRunner:
    """This peer reduces the whole (one-part) vector; SENDER is a client-mode member sending its part."""
    return CountingAllReduceRunner(
        p2p=SimpleNamespace(peer_id=ME), servicer_type=AllReduceRunner, prefix=None, group_id=GROUP,
        tensors=[torch.ones(8)], ordered_peer_ids=[ME, SENDER], peer_fractions=(1.0, 0.0), weight=1.0,
        counter=ByteCounter(), sender_timeout=sender_timeout, reducer_timeout=2 * sender_timeout,
    )


def test_hivemind_still_reads_and_waits_as_these_tests_model_it() -> None:
    # the first test replaces aiter_with_timeout there to expire the sender timeout at a chosen moment
    assert "aiter_with_timeout(" in inspect.getsource(AllReduceRunner.rpc_aggregate_part)
    # registry.RunnerSlot shields exactly this wait
    assert "await future" in inspect.getsource(DecentralizedAverager.rpc_aggregate_part)


def test_the_last_averaged_part_goes_out_before_the_acknowledgement_wait_begins() -> None:
    """The sender's last part arrives, the slower member's part comes more than ``sender_timeout`` later: the
    reducer still ends its reply stream only after reading the sender's acknowledgement of the last part.
    Before the fix it ended right behind that part (the acknowledgement's read had timed out and closed the
    stream while the part waited), so the daemon could drop it."""

    async def run() -> tuple[_Sender, list[int], list[int], CountingAllReduceRunner]:
        runner = _reducer_of_two()
        reducer = runner.tensor_part_reducer
        sender, expired, counted = _Sender(), asyncio.Event(), asyncio.Event()
        original = reducer.accumulate_part

        async def accumulate_part(index: int, part: int, tensor: torch.Tensor, weight: float = 1.0) -> Any:
            if index == 1:
                counted.set()  # the sender's last part reached the reducer, which waits for ours
            return await original(index, part, tensor, weight=weight)

        reducer.accumulate_part = accumulate_part  # type: ignore[method-assign]
        with _sender_timeout_expires_on(expired):
            handler = runner.rpc_aggregate_part(sender.stream(), SimpleNamespace(remote_id=SENDER))
            first = asyncio.ensure_future(anext(handler))
            await counted.wait()
            expired.set()  # sender_timeout passes while the part waits for the slower member (us)
            await accumulate(reducer, 0, 0, torch.full((8,), 1.0), 1.0)
            reply = await first
            sender.ack.set()  # the sender got the last part and acknowledges it
            rest = [m.code async for m in handler]
        return sender, [reply.code], rest, runner

    sender, replies, rest, runner = asyncio.run(run())
    assert replies == [averaging_pb2.AVERAGED_PART] and rest == []
    assert not sender.read_cancelled, "the acknowledgement's read timed out before the last part was sent"
    assert sender.ack_read, "the reducer ended its reply stream without reading the acknowledgement"
    assert not runner.banned_senders and runner.tensor_part_reducer.num_parts_received == [1, 1]


def test_a_sender_that_never_acknowledges_costs_one_sender_timeout_after_the_last_part() -> None:
    async def run() -> tuple[list[int], CountingAllReduceRunner]:
        runner = _reducer_of_two(sender_timeout=0.05)
        handler = runner.rpc_aggregate_part(_Sender().stream(), SimpleNamespace(remote_id=SENDER))
        first = asyncio.ensure_future(anext(handler))
        await accumulate(runner.tensor_part_reducer, 0, 0, torch.full((8,), 1.0), 1.0)
        return [(await first).code, *[m.code async for m in handler]], runner

    codes, runner = asyncio.run(run())
    assert codes == [averaging_pb2.AVERAGED_PART]  # then ended, without a ban: every part went back
    assert not runner.banned_senders


class _OnePart:
    """A sender's stream of one first part; ``read`` is set as hivemind takes it, and hivemind's handler then
    awaits the group's runner before this test runs again."""

    def __init__(self, read: asyncio.Event):
        self.read, self.sent = read, False

    def __aiter__(self) -> _OnePart:
        return self

    async def __anext__(self) -> averaging_pb2.AveragingData:
        if self.sent:
            raise StopAsyncIteration
        self.sent = True
        self.read.set()
        return averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=GROUP)


class _Runner:
    async def rpc_aggregate_part(self, stream: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for _ in stream:
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)


def test_a_sender_cancelled_while_the_runner_is_built_leaves_the_other_senders_waiting() -> None:
    """Two senders' first parts wait in hivemind's handler for the runner; one sender dies (its handler is
    cancelled). The other is served once the runner is set; before the fix it ended in ``CancelledError``."""

    async def run() -> tuple[list[int], bool, list[int]]:
        groups: dict[bytes, Any] = {}
        averager = SimpleNamespace(_running_groups=groups, _pending_groups_registered=asyncio.Event())
        waiting = [asyncio.Event(), asyncio.Event()]

        async def handler(index: int) -> list[int]:
            messages = DecentralizedAverager.rpc_aggregate_part(
                averager, _OnePart(waiting[index]), None)  # type: ignore[arg-type]
            return [m.code async for m in messages]

        with registry.registered(groups, averager._pending_groups_registered,
                                 GroupInfo(group_id=GROUP, peer_ids=(), gathered=())):
            dying, live = asyncio.ensure_future(handler(0)), asyncio.ensure_future(handler(1))
            await asyncio.gather(waiting[0].wait(), waiting[1].wait())
            dying.cancel()
            await asyncio.wait({dying})
            registry.set_runner(groups, GROUP, _Runner())
            served = await live
            later = await handler(0)  # a sender arriving after the runner was set
        return served, dying.cancelled(), later

    served, died, later = asyncio.run(run())
    assert died and served == [averaging_pb2.AVERAGED_PART] and later == [averaging_pb2.AVERAGED_PART]


def test_the_registry_still_ends_the_waiters_of_a_group_that_did_not_run() -> None:
    async def run() -> bool:
        groups: dict[bytes, Any] = {}
        slot_taken = asyncio.Event()
        with registry.registered(groups, asyncio.Event(), GroupInfo(group_id=GROUP, peer_ids=(), gathered=())):
            async def wait_for_runner() -> Any:
                slot = groups[GROUP]
                slot_taken.set()
                return await slot

            waiter = asyncio.ensure_future(wait_for_runner())
            await slot_taken.wait()
        await asyncio.wait({waiter})
        return waiter.cancelled()

    assert asyncio.run(run())


def test_a_part_counted_once_and_its_stream_read_no_further_than_the_reducers_parts() -> None:
    """A sender that sends more parts than this reducer holds: the extra is never handed to the reducer."""

    async def run() -> tuple[list[int], CountingAllReduceRunner]:
        runner = _reducer_of_two(sender_timeout=0.05)
        part = serialize_torch_tensor(torch.full((8,), 3.0))
        stream = as_aiter(averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=GROUP,
                                                      weight=1.0, tensor_part=part),
                          averaging_pb2.AveragingData(weight=1.0, tensor_part=part))
        handler = runner.rpc_aggregate_part(stream, SimpleNamespace(remote_id=SENDER))
        first = asyncio.ensure_future(anext(handler))
        await accumulate(runner.tensor_part_reducer, 0, 0, torch.full((8,), 1.0), 1.0)
        return [(await first).code, *[m.code async for m in handler]], runner

    codes, runner = asyncio.run(run())
    assert codes == [averaging_pb2.AVERAGED_PART]
    assert runner.tensor_part_reducer.num_parts_received == [1, 1] and not runner.banned_senders
