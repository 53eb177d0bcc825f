"""The completion check: after the all-reduce, every member learns whether every other member saw it complete
and received the same averages, so an equivocating reducer is caught and named.

A reducer is just another peer. An honest one (``runner.CountingAllReduceRunner``) serializes each averaged
part once and sends the same bytes to every member, so every honest member ends with the same values. A
hostile one can send different values to different members (equivocation), each within every bound a member
can check on its own. So each member hashes, per reducer, the averaged parts it used (``runner.digests``), and
the check exchanges three things per member ("block"):

- its **status**: 1 when its own view of the all-reduce was complete, 0 otherwise;
- as a reducer, the digest of the averages it **sent** (its own view of its span);
- the digest of **every** reducer's averages it **received** (one hash over the per-reducer digests).

Who delivers a block matters: whoever reduces it could rewrite it. So the check is a tiny all-reduce with its
own layout (``CheckLayout``): one range per reducer of the first all-reduce, holding that reducer's block and a
copy of every client's block, reduced by ``OwnerPickReducer``, which takes each position only from the member
that owns it (never a sum that other senders, or a weight they choose, could steer). A reducer's block thus
reaches every member exactly as that reducer wrote it; a client's block reaches every member through every
reducer, and copies that differ count as a failure.

A member then decides (``judge``):

- any status below one, a copy mismatch or a malformed block: the round is not confirmed (as before);
- reducer ``r`` reported sending averages whose digest differs from what ``r`` sent *this* member: ``r``
  equivocated, on evidence from its own two authenticated streams; the round fails and ``r`` is named in
  ``equivocators``, for the caller to ban (only when this member's own view was complete);
- another member's received-digest differs from ours: someone saw other averages (or that member misreports);
  the round fails, naming the member, and nobody is banned: this peer cannot tell which of them lies.

Why honest members stay identical: every honest reducer delivers its own block, and every honest member's
received-digest reaches every other honest member untouched (a full member's through itself, a client's at
least through each honest reducer, and any rewritten copy is a mismatch). So if two honest members received
different averages, each honest member sees a digest unlike its own and skips the round; none applies an
average that another honest member did not also get. Outcomes can still differ when the check itself fails
for some members only (as with any agreement over an unreliable network), never toward accepting a partial
or equivocated average. A hostile member can always make the round fail (it can also just report
"incomplete"); it cannot make an honest member apply a partial average or get an honest reducer banned.

Cost: one sha256 pass over the averaged parts as they arrive (wire bytes: 1-4 per parameter with the run's
codec), in executor threads beside the network; about 0.4-0.5 GB/s per core measured on the 2-core test
machine, so a few seconds per round at 1B parameters, once per round, off the training thread. The check
itself moves ``33 * (1 + clients)`` floats per reducer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import NoCompression
from hivemind.p2p import PeerID

from p2p_diloco.swarm.reducer import check_part

if TYPE_CHECKING:
    from p2p_diloco.swarm.runner import CountingAllReduceRunner, RunnerFactory

logger = logging.getLogger(__name__)

STATUS_SUFFIX = b".done"
"""Group id suffix of the completion check that follows each all-reduce."""
DIGEST_VALUES = 16
"""A sha256 digest travels as 16 values of 16 bits each: exact in float32, whatever the arithmetic."""
BLOCK = 1 + 2 * DIGEST_VALUES
"""One member's block: status, digest of the averages it sent (reducers), digest of all it received."""


def digest_values(digest: bytes) -> torch.Tensor:
    """``digest`` (32 bytes) as ``DIGEST_VALUES`` float32 values, each an integer in [0, 65535]."""
    if len(digest) != 2 * DIGEST_VALUES:
        raise ValueError(f"a digest has {2 * DIGEST_VALUES} bytes, got {len(digest)}")
    return torch.tensor([int.from_bytes(digest[i:i + 2], "big") for i in range(0, len(digest), 2)],
                        dtype=torch.float32)


def values_digest(values: torch.Tensor) -> bytes | None:
    """The digest that ``values`` encode, or ``None`` when they are not integers in [0, 65535]."""
    if values.numel() != DIGEST_VALUES or not bool(torch.isfinite(values).all()):
        return None
    chunks = values.double().tolist()
    if any(c != math.floor(c) or not 0 <= c <= 0xFFFF for c in chunks):
        return None
    return b"".join(int(c).to_bytes(2, "big") for c in chunks)


def received_digest(digests: Sequence[bytes]) -> bytes:
    """One hash over the per-reducer digests of what a member received, in the group's order."""
    return hashlib.sha256(b"".join(digests)).digest()


@dataclass(frozen=True)
class CheckLayout:
    """Where each member's block lies in the check's vector (see the module docstring).

    :param members: group size.
    :param reducers: indices of the members that reduced a span of the first all-reduce, in order; each owns
      one range of the check: its own block, then a copy of every client's block.
    """

    members: int
    reducers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.reducers or any(not 0 <= r < self.members for r in self.reducers):
            raise ValueError("the check needs at least one reducer, each a member of the group")

    @property
    def clients(self) -> tuple[int, ...]:
        return tuple(m for m in range(self.members) if m not in self.reducers)

    @property
    def range_size(self) -> int:
        return BLOCK * (1 + len(self.clients))

    def owners(self, reducer: int) -> torch.Tensor:
        """The member owning each position of ``reducer``'s range."""
        return torch.tensor([reducer, *self.clients]).repeat_interleave(BLOCK)

    def fractions(self) -> tuple[float, ...]:
        """hivemind's ``peer_fractions`` for the check: one range per reducer, nothing for the others."""
        return tuple(float(self.range_size) if m in self.reducers else 0.0 for m in range(self.members))

    def tensors(self, me: int, block: torch.Tensor) -> list[torch.Tensor]:
        """This member's input: its ``block`` wherever it owns positions, zeros elsewhere."""
        ranges = [torch.zeros(self.range_size) for _ in self.reducers]
        for reducer, values in zip(self.reducers, ranges, strict=True):
            owners = self.owners(reducer)
            mine = (owners == me).nonzero().flatten()
            for start in mine[::BLOCK].tolist():
                values[start:start + BLOCK] = block
        return ranges

    def blocks(self, ranges: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per member, every copy of its block found in the check's output."""
        copies: list[list[torch.Tensor]] = [[] for _ in range(self.members)]
        for reducer, values in zip(self.reducers, ranges, strict=True):
            for slot, owner in enumerate((reducer, *self.clients)):
                copies[owner].append(values[slot * BLOCK:(slot + 1) * BLOCK])
        return copies


def make_block(complete: bool, sent: bytes | None, received: bytes) -> torch.Tensor:
    """A member's block: its status, the digest of what it sent as a reducer (zeros if none), and the
    digest of everything it received."""
    sent_values = torch.zeros(DIGEST_VALUES) if sent is None else digest_values(sent)
    return torch.cat([torch.tensor([1.0 if complete else 0.0]), sent_values, digest_values(received)])


class OwnerPickReducer(TensorPartReducer):
    """The check's reducer: each position of the averaged part is the value its owner sent, nothing else.

    Senders' weights and values at positions they do not own are ignored, so no sender can steer another
    member's block; a position whose owner sent nothing acceptable is NaN (read as a failure).

    :param part_shapes: this reducer's parts (hivemind's partition of its range, in order).
    :param owners: the owning member of each position of this reducer's range.
    :param sender_members: the member index of each sender, in hivemind's sender order.
    """

    def __init__(self, part_shapes: Sequence[torch.Size], owners: torch.Tensor, sender_members: Sequence[int]):
        if sum(math.prod(shape) for shape in part_shapes) != owners.numel():
            raise ValueError("this reducer's parts do not cover exactly its range of the completion check")
        self.sender_members = tuple(sender_members)
        self.rejections: dict[int, str] = {}
        self._owners = list(owners.split([math.prod(shape) for shape in part_shapes])) if part_shapes else []
        self._received: dict[int, torch.Tensor] = {}
        super().__init__(part_shapes, len(self.sender_members))

    def reset_accumulators(self) -> None:
        if self.current_part_index >= self.num_parts - 1:
            self.finalize()
            return
        self.current_part_index += 1
        self.current_part_accumulated_from = 0
        self.current_part_future = asyncio.Future()
        self.accumulator = None  # hivemind's finalize() deletes it
        self.num_current_senders = sum(
            self.current_part_index < failed_index for failed_index in self.sender_failed_after
        )
        self._received = {}

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """hivemind's contract: wait for parts ``< part_index``, add ours, return the reduced part."""
        if not 0 <= sender_index < self.num_senders or not 0 <= part_index < self.num_parts:
            raise BannedException(f"sender {sender_index} sent part {part_index} out of range")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise BannedException("the reducer finished before this part arrived")
        if self.finished.is_set():
            # finalize() cancelled the current part's future: counting this part would await it, or call
            # set_result on it as the part's last sender (InvalidStateError out of the round)
            raise BannedException("the reducer finished before this part arrived")
        if self.sender_failed_after[sender_index] != math.inf:
            raise BannedException(f"sender {sender_index} was banned in background")
        if part_index != self.current_part_index:
            raise BannedException(f"sender {sender_index} sent part {part_index} twice")
        future = self.current_part_future
        if sender_index not in self.rejections and check_part(
            tensor_part, self.part_shapes[part_index], torch.float32
        ) is None:
            self._received[sender_index] = tensor_part
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await future

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        owners = self._owners[self.current_part_index]
        value = torch.full(self.part_shapes[self.current_part_index], math.nan)
        for sender, part in self._received.items():
            mask = owners == self.sender_members[sender]
            value[mask] = part[mask]
        self.current_part_future.set_result(value)
        self._received = {}
        self.reset_accumulators()


@dataclass(frozen=True)
class Confirmation:
    """What the completion check decided for this member."""

    confirmed: bool
    detail: str = ""
    """Why it is not confirmed (empty when confirmed)."""
    equivocators: dict[str, str] = field(default_factory=dict)
    """``{reducer id: reason}`` for reducers caught sending this member other averages than they reported
    sending; the caller bans them."""


def judge(
    layout: CheckLayout, me: int, ranges: Sequence[torch.Tensor], peer_ids: Sequence[str],
    digests: Sequence[bytes], complete: bool,
) -> Confirmation:
    """This member's verdict from the check's output ``ranges`` (see the module docstring). ``digests``: per
    member of the group, the digest of that reducer's averages as this member used them."""
    ours = received_digest(digests)
    incomplete: list[str] = []
    disagree: list[str] = []
    equivocators: dict[str, str] = {}
    for member, copies in enumerate(layout.blocks(ranges)):
        name = peer_ids[member]
        block = copies[0]
        if any(not torch.equal(copy, block) for copy in copies[1:]):
            incomplete.append(f"{name} (its report differs between reducers)")
            continue
        if float(block[0]) != 1.0:
            incomplete.append(name)
            continue
        sent = values_digest(block[1:1 + DIGEST_VALUES])
        received = values_digest(block[1 + DIGEST_VALUES:])
        if received is None or (member in layout.reducers and sent is None):
            incomplete.append(f"{name} (malformed report)")
            continue
        if member in layout.reducers and sent != digests[member]:
            disagree.append(f"reducer {name} sent this peer other averages than it reported sending")
            if complete and member != me:
                equivocators[name] = "reducer sent different averages to different members (equivocation)"
        elif member != me and received != ours:
            disagree.append(f"{name} received other averages than this peer")
    if incomplete:
        return Confirmation(False, f"{len(incomplete)} member(s) did not complete the all-reduce: "
                            + ", ".join(incomplete), equivocators)
    if disagree:
        return Confirmation(False, "members received different averages: " + "; ".join(disagree), equivocators)
    return Confirmation(True)


async def confirm_complete(
    make_runner: RunnerFactory, complete: bool, peer_ids: Sequence[PeerID], me: PeerID,
    main: CountingAllReduceRunner,
) -> Confirmation:
    """The completion check after ``main``, the round's all-reduce, in the same group (never raises)."""
    from p2p_diloco.swarm.runner import run_allreduce

    names = [peer.to_base58() for peer in peer_ids]
    my_index = list(peer_ids).index(me)
    try:
        digests = main.digests()
        layout = CheckLayout(len(peer_ids), tuple(
            i for i, parts in enumerate(main.tensor_part_container.num_parts_by_peer) if parts > 0))
        block = make_block(complete, digests[my_index] if my_index in layout.reducers else None,
                           received_digest(digests))
        ranges = layout.tensors(my_index, block)
        runner = make_runner(
            ranges, STATUS_SUFFIX, compression=NoCompression(), peer_fractions=layout.fractions(),
            part_size_bytes=4 * layout.range_size, part_reducer=_owner_pick(layout),
        )
    except Exception as e:  # our own failure: no confirmation, nobody blamed
        logger.exception("Could not start the completion check")
        return Confirmation(False, f"completion check could not start: {e!r}")
    faults = await run_allreduce(runner, ranges)
    if faults:
        return Confirmation(False, "completion check incomplete: " + "; ".join(faults))
    verdict = judge(layout, my_index, ranges, names, digests, complete)
    for reducer, reason in verdict.equivocators.items():
        logger.warning("Reducer %s: %s", reducer, reason)
    return verdict


def _owner_pick(layout: CheckLayout) -> Callable[[Any], TensorPartReducer]:
    def make(runner: Any) -> TensorPartReducer:
        me = runner.ordered_peer_ids.index(runner.peer_id)
        shapes = tuple(part.shape for part in runner.parts_for_local_averaging)
        owners = layout.owners(me) if me in layout.reducers else torch.zeros(0, dtype=torch.long)
        members = [runner.ordered_peer_ids.index(peer) for peer in runner.sender_peer_ids]
        return OwnerPickReducer(shapes, owners, members)

    return make
