"""hivemind's butterfly all-reduce, made bitwise-reproducible and instrumented (bytes, faults, test hook).

Why bitwise identical results. hivemind's reducers send each sender the DIFFERENCE between the averaged part
and that sender's own part, which the sender adds back; ``x + (avg - x)`` rounds differently for different
``x``, so peers end up with averages that differ in the last bits, parameters drift apart and per-epoch
checksums never agree. Here a reducer serializes each averaged part once (with the run's codec) and sends the
same bytes to every sender, and uses the decoded bytes for its own share too: every member of the group
gets exactly the same values.

Why fault detection is needed. When a groupmate fails mid-way, hivemind's ``AllReduceRunner`` does not fail:
a reducer that loses a sender bans it and averages each remaining part over the senders it still has, and a
sender whose reducer vanished keeps its OWN values for that reducer's parts. The result is a silently partial
average (hivemind only logs "received 66.7% results"). ``CountingAllReduceRunner.faults()`` reports what this
peer can see of that; what it cannot see (another reducer's part being partial) is settled by the group's
completion check (``completion.py``), which also compares what each member received (``digests``), so a
reducer that sends members different averages is caught.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID, StubBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import amap_in_executor, as_aiter, azip

from p2p_diloco.swarm.reducer import RobustPartReducer
from p2p_diloco.swarm.verify import AverageCheck, part_regions

logger = logging.getLogger(__name__)

MAX_WIRE_BYTES_PER_VALUE = 8
"""A received part may carry at most this many bytes per value it declares (plus ``_WIRE_SLACK_BYTES``):
every codec of the project sends 4 or fewer (float32 plain, with a header and per-block scales for the
quantised ones), so this only refuses padding and lies about the shape."""
_WIRE_SLACK_BYTES = 4096


def wire_part_problem(part: runtime_pb2.Tensor, shape: Sequence[int], compression_type: int | None,
                      dtype: torch.dtype | None = None) -> str | None:
    """Why a serialized part must not be decoded, judged on its protobuf fields alone, or ``None``.

    The sender picks the compression and the shape a part claims; decoding first would let it make this peer
    allocate and compute what it chose (a float16 or 8-bit claim decodes to 2-4x its bytes, a shape to any
    size). So the part must name the group's compression (``compression_type``, ``None``: any, for
    hivemind's adaptive compressions), exactly the expected ``shape``, and a buffer no longer than
    ``MAX_WIRE_BYTES_PER_VALUE`` bytes per value. It must not set ``requires_grad``: hivemind's deserializer
    would hand the flag on, and a decoded part with autograd state turns every tensor it reaches non-leaf.
    """
    if part.requires_grad:
        return "part carries autograd state (requires_grad), which no peer sends"
    if compression_type is not None and part.compression != compression_type:
        return f"part compressed as type {part.compression}, the group uses type {compression_type}"
    if dtype is not None and part.dtype != str(dtype).removeprefix("torch."):
        return f"part of dtype {part.dtype[:16]!r}, expected {dtype}"
    declared = tuple(part.size)
    if declared != tuple(shape):
        return f"part declares shape {declared[:8]}, expected {tuple(shape)}"
    limit = math.prod(shape) * MAX_WIRE_BYTES_PER_VALUE + _WIRE_SLACK_BYTES
    if len(part.buffer) > limit:
        return f"part of {len(part.buffer)} bytes for {math.prod(shape)} values (at most {limit})"
    return None


def decode_part(part: runtime_pb2.Tensor, shape: Sequence[int], compression_type: int | None,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, str | None]:
    """A sender's serialized part, decoded, or an empty tensor and why it was refused: on its protobuf fields
    (:func:`wire_part_problem`) or by its decoder (our codecs raise ``ValueError`` naming the fault, e.g. a
    sparse part's repeated index: ``core.sparse.SparsePartError``). Nothing of a refused part is used."""
    problem = wire_part_problem(part, shape, compression_type, dtype)
    if problem is not None:
        return torch.empty(0), f"refused on the wire: {problem}"
    try:
        return deserialize_torch_tensor(part), None
    except Exception as e:  # noqa: BLE001 - hivemind's decoders raise TypeError, RuntimeError on hostile bytes
        return torch.empty(0), f"rejected by its decoder: {type(e).__name__}: {e}"


FaultHook = Callable[[str], "bool | float | None"]
"""Called inside the averager process at named stages: "allreduce_begin", "corrupt_input" (returning a number
multiplies this member's pre-scaled input by it, NaN fills it with NaN: a Byzantine sender), "announce" (on
the host, without firing: the same factor, applied to the announced norms), "corrupt_output" (returning a
number multiplies the averaged parts this member sends as a reducer: a hostile reducer), "equivocate"
(the same, but only for the last other sender: an equivocating reducer), "part_sent"
(after the first part went to a remote reducer) and "confirm" (returning ``False`` there makes this member
report an incomplete all-reduce), and "assemble" (a leader, right before it forms its group). Tests use it
to kill or sabotage a peer at a precise moment; production code leaves it ``None``."""


def no_faults(stage: str) -> None:
    """The production fault hook: no stage does anything."""
    return None

RECEIVED_ALL = averaging_pb2.AVERAGED_PART
"""Code of the message a sender appends to its input stream once it holds every averaged part of that reducer.

Why: a reducer that ends its reply stream right after its last part closes the stream while that part may
still sit in the p2p daemon's buffers, and the daemon can then reset the stream and drop it; the sender sees
the stream end one part short (hivemind: "sent 9 parts, but we expected 10"), about once in 30-40 rounds on
our testbed. Waiting for this acknowledgement before ending the reply means the reducer never closes first.
A sender that never acknowledges (an older version, or one that died) costs the reducer ``sender_timeout``,
nothing else: its parts were all reduced."""


@dataclass
class ByteCounter:
    """Serialized protobuf payload bytes of all-reduce messages.

    Counts ``ByteSize()`` of every message this peer hands to or receives from the p2p daemon, i.e. the
    tensor parts after compression plus a few bytes of protobuf fields. libp2p framing, encryption, yamux and
    TCP/IP headers come on top (a few percent) and are not counted.
    """

    sent: int = 0
    received: int = 0


@dataclass
class _Replies:
    """The averaged parts one reducer sent back to us so far."""

    expected: int
    received: int = 0
    shapes: tuple[tuple[int, ...], ...] = ()
    """The shapes of that reducer's parts, in order (empty: not checked)."""
    compression_type: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once all ``expected`` parts arrived or the reply stream ended (see RECEIVED_ALL)."""
    digest: Any = field(default_factory=hashlib.sha256)
    """Hash of the averaged parts received so far, as sent (see ``completion``)."""


async def _hash_part(digest: Any, part: runtime_pb2.Tensor) -> None:
    """Add one serialized averaged part to ``digest`` (hashlib releases the GIL: hashed in a thread)."""
    header = f"{part.compression}|{part.dtype}|{tuple(part.size)}|{len(part.buffer)}|".encode()
    await asyncio.get_running_loop().run_in_executor(None, lambda: (digest.update(header),
                                                                     digest.update(part.buffer)))


async def _count_received(
    stream: AsyncIterator[Any], counter: ByteCounter, replies: _Replies | None = None
) -> AsyncIterator[Any]:
    """Count bytes, and averaged parts into ``replies``."""
    try:
        async for message in stream:
            counter.received += message.ByteSize()
            if replies is not None and message.code == averaging_pb2.AVERAGED_PART:
                if replies.received < len(replies.shapes):
                    problem = wire_part_problem(message.tensor_part, replies.shapes[replies.received],
                                                replies.compression_type)
                    if problem is not None:
                        raise ValueError(f"reducer's averaged part {replies.received}: {problem}")
                elif replies.shapes:
                    raise ValueError(f"reducer sent more than the {len(replies.shapes)} expected parts")
                await _hash_part(replies.digest, message.tensor_part)
                replies.received += 1
                if replies.received >= replies.expected:
                    replies.done.set()
            yield message
    finally:
        if replies is not None:
            replies.done.set()


async def accumulate(
    reducer: TensorPartReducer, sender_index: int, part_index: int, part: torch.Tensor, weight: float
) -> torch.Tensor:
    """``reducer.accumulate_part``, shielded from the cancellation of the sender's task.

    Why: every sender of a part awaits the same future of the reducer, and a task cancelled while awaiting a
    future cancels that future too. A sender whose stream dies mid-part (its peer was killed, the connection
    reset) has its handler task cancelled; unshielded, that cancels the part's future, the next arrival's
    ``set_result`` fails, and the reducer waits on that part for every other sender until
    ``allreduce_timeout_s``. hivemind's own reducer has the same flaw, so both go through here.
    """
    task = asyncio.ensure_future(reducer.accumulate_part(sender_index, part_index, part, weight=weight))
    task.add_done_callback(lambda done: done.cancelled() or done.exception())  # nobody may be left to ask
    return await asyncio.shield(task)


async def _numbered(stream: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    index = 0
    async for item in stream:
        yield index, item
        index += 1


class _SenderInputs:
    """One sender's input stream as a reducer reads it: its parts (:meth:`parts`), then, once every averaged
    part went back, its ``RECEIVED_ALL`` acknowledgement (:meth:`acknowledgement`).

    Why two reads: hivemind reads a sender's stream through ``aiter_with_timeout(..., sender_timeout)``, which
    bounds each read, and whose timeout closes the stream for good. Read there, the acknowledgement's wait
    began when the sender's last part was read, long before the reply it acknowledges, while that part waited
    for the group's slower senders; past ``sender_timeout`` (a slow or relayed groupmate) the read timed out,
    the reducer ended its reply stream right behind its last averaged part, and that part could be lost in
    the p2p daemon (see ``RECEIVED_ALL``). So :meth:`parts` ends after the reducer's ``num_parts`` parts
    without reading on, and the acknowledgement is read after the last reply went out, within its own
    ``sender_timeout``. Nothing past a sender's ``num_parts`` parts reaches the reducer.
    """

    def __init__(self, stream: AsyncIterator[Any], num_parts: int):
        self._stream, self._num_parts = stream, num_parts
        self.acknowledged = False

    async def parts(self) -> AsyncIterator[Any]:
        """The sender's messages up to its ``num_parts``-th, or to its acknowledgement if that comes first."""
        count = 0
        async for message in self._stream:
            if message.code == RECEIVED_ALL:
                self.acknowledged = True
                return
            yield message
            count += 1
            if count >= self._num_parts:
                return

    async def acknowledgement(self, timeout: float | None) -> None:
        """Wait for the sender's acknowledgement (or the end of its stream, or whatever it sends next), at most
        ``timeout`` seconds; never raises. A sender that never acknowledges costs this wait, nothing else."""
        if self.acknowledged:
            return
        try:
            await asyncio.wait_for(anext(self._stream), timeout)
        except (StopAsyncIteration, asyncio.TimeoutError, TimeoutError):
            return
        except Exception as e:  # noqa: BLE001 - every part went back: a broken stream now changes nothing
            logger.debug("A sender's stream failed after its last averaged part: %r", e)


class _CountingStub:
    """Wraps a hivemind stub so the averaged parts a reducer sends back to us are counted."""

    def __init__(self, stub: StubBase, counter: ByteCounter, replies: _Replies):
        self._stub, self._counter, self._replies = stub, counter, replies

    async def rpc_aggregate_part(
        self, requests: AsyncIterator[averaging_pb2.AveragingData]
    ) -> AsyncIterator[Any]:
        stream = await self._stub.rpc_aggregate_part(requests)
        return _count_received(stream, self._counter, self._replies)


class CountingAllReduceRunner(AllReduceRunner):
    """``AllReduceRunner`` whose output is the averaged tensors themselves (not deltas), identical on every
    member; it also counts wire bytes, reports faults and calls an optional fault hook.

    Memory: besides hivemind's buffers, a reducer keeps the serialized averages of its share (about 1/n of
    the vector after compression) until the runner is dropped.
    """

    def __init__(
        self,
        *,
        counter: ByteCounter,
        fault_hook: FaultHook = no_faults,
        robust: dict[str, Any] | None = None,
        bounds: tuple[float, float] | None = None,
        fresh_tensors: int = 0,
        part_reducer: Callable[[CountingAllReduceRunner], TensorPartReducer] | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        my_index = self.ordered_peer_ids.index(self.peer_id)
        if part_reducer is not None:  # e.g. the completion check's (see completion.OwnerPickReducer)
            self.tensor_part_reducer.finished.set()
            self.tensor_part_reducer = part_reducer(self)
        elif robust is not None:
            # replace hivemind's trusting reducer before any part can arrive (nothing awaited since __init__)
            self.tensor_part_reducer.finished.set()  # retire it silently
            parts = self.parts_for_local_averaging
            self.tensor_part_reducer = RobustPartReducer(
                tuple(part.shape for part in parts),
                parts[0].dtype if parts else torch.float32,
                [peer.to_base58() for peer in self.sender_peer_ids],
                regions=part_regions(self.tensor_part_container, my_index, fresh_tensors),
                own=self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None,
                **robust,
            )
        self._check: AverageCheck | None = None
        if bounds is not None:
            self._check = AverageCheck(
                self.tensor_part_container,
                [p.to_base58() for p in self.ordered_peer_ids],
                my_index,
                bounds,
                fresh_tensors,
            )
            self._check.install()
        self._counter = counter
        self._fault_hook = fault_hook
        self._remote_parts_sent = 0
        # hivemind keeps (part, CompressionInfo) pairs here; the infos let the averaged part be compressed
        # exactly as the input parts were
        self._my_part_infos = tuple(
            info for _, info in self.tensor_part_container._input_parts_by_peer[my_index]
        )
        # What each reducer's parts must look like on the wire, fixed before any arrives (wire_part_problem).
        self._part_shapes = tuple(
            tuple(tuple(part.shape) for part, _ in parts) for parts in self.tensor_part_container._input_parts_by_peer
        )
        self._compression_type = getattr(self.tensor_part_container.compression, "compression_type", None)
        self._averaged_parts: dict[int, asyncio.Future[runtime_pb2.Tensor]] = {}
        self._replies: dict[int, _Replies] = {}  # per reducer index
        self._own_digest = hashlib.sha256()  # of the averages our reducer sent (see completion)
        others = [i for i, peer in enumerate(self.sender_peer_ids) if peer != self.peer_id]
        self._equivocation_target = others[-1] if others else -1  # test-only, see FaultHook "equivocate"
        self._reducer_failures: dict[PeerID, str] = {}

    def should_delay_results(self, peer_id: PeerID) -> bool:
        """Never: a client-mode sender reads its averages while it still sends, as every sender does here.

        hivemind makes a client (a peer with no share to reduce) read its averages only after it has sent
        all its parts, and its reducers answer only after the client's input stream ended. Our senders end
        that stream only after the reducer's last average arrived (see ``RECEIVED_ALL``), so with the delay a
        client and its reducers would wait for each other until ``allreduce_timeout_s``. Every member runs
        this runner, so both sides agree on it.
        """
        return False

    def _serialized_average(self, part_index: int, averaged_part: Any) -> asyncio.Future[runtime_pb2.Tensor]:
        """The one serialization of averaged part ``part_index`` that every sender (and we) receive."""
        future = self._averaged_parts.get(part_index)
        if future is None:
            compression = self.tensor_part_container.compression
            info = self._my_part_infos[part_index]
            factor = self._fault_hook("corrupt_output")
            if isinstance(factor, float):
                averaged_part = averaged_part * factor
            future = asyncio.get_running_loop().run_in_executor(
                None, lambda: compress_average(compression, averaged_part, info)
            )
            self._averaged_parts[part_index] = future
        return future

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        if peer_id != self.peer_id:
            try:
                return await super()._communicate_with_peer(peer_id)
            except Exception as e:  # hivemind logs it at DEBUG only; faults() names the reducer and why
                replies = self._replies_from(self.ordered_peer_ids.index(peer_id))
                self._reducer_failures[peer_id] = f"{e!r} with {replies.received} of {replies.expected} parts back"
                raise
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        compression = self.tensor_part_container.compression
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            if getattr(compression, "sparse", False):  # our own part is sent as top-k too (hivemind_codecs)
                info = self._my_part_infos[part_index]
                tensor_part = await asyncio.get_running_loop().run_in_executor(
                    None, lambda part=tensor_part, info=info: compression.own_part(part, info))
            averaged_part = await accumulate(
                self.tensor_part_reducer, sender_index, part_index, tensor_part, self.weight
            )
            serialized = await self._serialized_average(part_index, averaged_part)
            await _hash_part(self._own_digest, serialized)
            self.tensor_part_container.register_processed_part(
                peer_index, part_index, deserialize_torch_tensor(serialized)
            )

    async def _equivocated(self, part_index: int, averaged_part: torch.Tensor,
                           serialized: runtime_pb2.Tensor) -> runtime_pb2.Tensor:
        """Test-only: what an equivocating reducer sends its last other sender instead (FaultHook)."""
        factor = self._fault_hook("equivocate")
        if not isinstance(factor, float):
            return serialized
        info, compression = self._my_part_infos[part_index], self.tensor_part_container.compression
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: compress_average(compression, averaged_part * factor, info))

    def digests(self) -> list[bytes]:
        """Per member of the group, the sha256 of the averaged parts this peer got from it as a reducer (ours:
        those we sent); ``sha256(b"")`` for members that reduce nothing. Read once the all-reduce ended."""
        return [self._own_digest.digest() if peer == self.peer_id else self._replies_from(i).digest.digest()
                for i, peer in enumerate(self.ordered_peer_ids)]

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # hivemind's version, replying with the shared serialized average instead of a per-sender delta
        part_index = 0
        try:
            async for tensor_part, weight, problem in amap_in_executor(
                self._decode_input,
                _numbered(stream),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if problem is not None:
                    # Not decoded. Still counted, as every rejected part is (the reducer's contract), so the
                    # group's other senders are not held up; the averager bans the sender for the run.
                    logger.warning("Refused part %d of %s: %s", part_index,
                                   self.sender_peer_ids[sender_index], problem)
                    rejections = getattr(self.tensor_part_reducer, "rejections", None)
                    if rejections is None:
                        break  # hivemind's trusting reducer: drop the sender instead
                    rejections.setdefault(sender_index, problem)
                try:
                    averaged_part = await accumulate(
                        self.tensor_part_reducer, sender_index, part_index, tensor_part, weight
                    )
                except BannedException:
                    break
                serialized = await self._serialized_average(part_index, averaged_part)
                if sender_index == self._equivocation_target:
                    serialized = await self._equivocated(part_index, averaged_part, serialized)
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _decode_input(self, numbered: tuple[int, Any]) -> tuple[torch.Tensor, float, str | None]:
        """A sender's part ``(index, message)``, checked on the wire (``wire_part_problem``), then decoded; a
        refused part becomes an empty tensor and the reason (runs in an executor thread)."""
        index, message = numbered
        parts = self.parts_for_local_averaging
        if index >= len(parts):
            return torch.empty(0), 0.0, f"part {index} past the {len(parts)} this peer reduces"
        part, problem = decode_part(message.tensor_part, tuple(parts[index].shape), self._compression_type,
                                    parts[index].dtype)
        return part, float(message.weight), None if problem is None else f"part {index} {problem}"

    def _replies_from(self, reducer_index: int) -> _Replies:
        replies = self._replies.get(reducer_index)
        if replies is None:
            replies = _Replies(self.tensor_part_container.num_parts_by_peer[reducer_index],
                               shapes=self._part_shapes[reducer_index], compression_type=self._compression_type)
            self._replies[reducer_index] = replies
        return replies

    def _get_peer_stub(self, peer: PeerID) -> StubBase:
        replies = self._replies_from(self.ordered_peer_ids.index(peer))
        return _CountingStub(super()._get_peer_stub(peer), self._counter, replies)  # type: ignore[return-value]

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._counter.sent += message.ByteSize()
            yield message
            self._remote_parts_sent += 1
            if self._remote_parts_sent == 1:
                self._fault_hook("part_sent")
        # Keep the stream open until the reducer's last part is here, then say so (see RECEIVED_ALL). If its
        # reply stream fails instead, the event is set too and the reducer gets an acknowledgement it ignores.
        await self._replies_from(peer_index).done.wait()
        ack = averaging_pb2.AveragingData(code=RECEIVED_ALL)
        self._counter.sent += ack.ByteSize()
        yield ack

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler of a sender's stream, which ends only after the sender acknowledged our last
        averaged part (or ``sender_timeout`` after we sent it): see ``_SenderInputs``."""
        inputs = _SenderInputs(_count_received(stream, self._counter), self.tensor_part_reducer.num_parts)
        replied = 0
        async for message in super().rpc_aggregate_part(inputs.parts(), context):
            self._counter.sent += message.ByteSize()
            replied += message.code == averaging_pb2.AVERAGED_PART
            yield message
        if 0 < replied == self.tensor_part_reducer.num_parts:
            await inputs.acknowledgement(self.sender_timeout)

    def faults(self) -> list[str]:
        """Reasons why this peer's result may be a partial average; empty when everything it saw completed.

        Checks: senders banned from the parts this peer reduced (their data is missing from those parts),
        values that fell back to our own because their reducer failed, and the runner ending with an error.
        """
        reasons = list(getattr(self.tensor_part_reducer, "reduce_faults", []))
        if self._check is not None:
            reasons += [f"{peer[-8:]}: {reason}" for peer, reason in self._check.failed.items()]
        if self.banned_senders:
            names = ", ".join(sorted(peer.to_base58()[-8:] for peer in self.banned_senders))
            reasons.append(
                f"{len(self.banned_senders)} sender(s) failed while we reduced our part (...{names})"
            )
        failed = self.tensor_part_container.failed_size
        if failed:
            why = "; ".join(f"...{peer.to_base58()[-8:]}: {reason}" for peer, reason in self._reducer_failures.items())
            reasons.append(
                f"{failed} of {self.tensor_part_container.total_size} values were not averaged (a reducer failed"
                + (f": {why})" if why else ")")
            )
        future = self._future
        if not future.done():
            reasons.append("all-reduce did not finish")
        elif future.cancelled():
            reasons.append("all-reduce was cancelled")
        elif future.exception() is not None:
            reasons.append(f"all-reduce failed: {future.exception()!r}")
        return reasons

    def progress(self) -> str:
        """Where this runner stands, for the log of a round that ran out of time: which part our reducer
        waits for and who sent what, and how many averaged parts came back from each reducer."""
        reducer, container = self.tensor_part_reducer, self.tensor_part_container
        senders = ", ".join(
            f"{peer.to_base58()[-8:]}:{received}" + ("" if failed == float("inf") else f"(banned@{failed})")
            for peer, received, failed in zip(
                self.sender_peer_ids, reducer.num_parts_received, reducer.sender_failed_after, strict=True
            )
        )
        outputs = ", ".join(
            f"{peer.to_base58()[-8:]}:{done}/{expected}"
            for peer, done, expected in zip(
                self.ordered_peer_ids, container._outputs_registered_by_peer, container.num_parts_by_peer,
                strict=True,
            )
        )
        return (
            f"runner {self.group_id.hex()[-12:]}: reducer at part {reducer.current_part_index}/{reducer.num_parts}"
            f" with {reducer.current_part_accumulated_from}/{reducer.num_current_senders} senders in"
            f" (parts received per sender {senders}); averages back per reducer {outputs}"
        )

    def rejected(self) -> dict[str, str]:
        """``{peer id: reason}`` for senders whose data this peer's reducer dropped (see ``reducer``) and
        reducers whose averages failed our check (see ``verify``)."""
        reducer = self.tensor_part_reducer
        found = reducer.rejected() if isinstance(reducer, RobustPartReducer) else {}
        return found | (self._check.failed if self._check is not None else {})


def compress_average(compression: Any, averaged_part: torch.Tensor, info: Any) -> runtime_pb2.Tensor:
    """The one serialization of a reducer's averaged part: our codecs' reply encoding (``compress_average``,
    the sparse codecs' top-k of the aggregate, never error feedback), else the compression itself (hivemind's)."""
    reply = getattr(compression, "compress_average", None)
    if reply is not None:
        return reply(averaged_part, info)
    return compression.compress(averaged_part, info, allow_inplace=False)


class RunnerFactory(Protocol):
    def __call__(
        self, tensors: Sequence[torch.Tensor], suffix: bytes, **overrides: Any
    ) -> CountingAllReduceRunner:
        """A runner over ``tensors`` in the round's group, under the group id plus ``suffix``."""


async def run_allreduce(runner: CountingAllReduceRunner, tensors: Sequence[torch.Tensor]) -> list[str]:
    """Run ``runner``, overwrite ``tensors`` with the averages, and return the faults this peer saw."""
    try:
        async for tensor, averaged in azip(as_aiter(*tensors), runner):
            with torch.no_grad():  # the shared buffers stay leaves whatever reached the runner
                tensor.copy_(averaged.detach())
    except Exception as e:
        return [f"all-reduce failed: {e!r}", *runner.faults()]
    return runner.faults()
