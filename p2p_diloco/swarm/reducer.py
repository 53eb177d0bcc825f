"""The reducer's side of the all-reduce: every received part is checked at the point of receipt, and the
accepted parts are combined with the run's aggregation rule (``core.robust``).

hivemind's ``TensorPartReducer`` adds each sender's part into a running sum as it arrives and trusts it
blindly: one NaN, one wrong-shaped part or one huge vector spoils the average for the whole group. This
reducer keeps every sender's copy of the current part (one part of ``part_size_bytes`` per sender, freed once
the part is reduced) and only when all have arrived:

1. drops parts that were rejected on arrival (wrong shape or dtype, NaN or infinite values, or a sender
   banned earlier in this run), and scales a sender's parts down where, summed over this reducer's span,
   they would exceed the norm it announced (``core.bounds``: so its groupmates can bound our output);
2. drops parts whose weight-normalised L2 norm is more than ``norm_factor`` times the median
   (``core.robust.norm_outliers``); the sender is rejected for the run only when its part is also that far
   above our own part, and has at least ``core.robust.MIN_BANNING_VALUES`` values; a sender dropped from a
   part that large without a ban is left out of this reducer's later parts of the round
   (``core.robust.PartResult.dropped``);
3. combines the rest with ``mean``, ``trimmed-mean`` or ``centered-clip``, and rescales so that the result is
   the weighted mean over the accepted senders (``core.robust.reduce_part`` does 2 and 3).

A rejected sender is not cut off: it keeps streaming and receives the same averaged bytes as everyone else,
so every member (even a buggy one) ends the round with identical values; its data just is not in them.
Rejections are reported back to the averager, which bans the sender for the rest of the run.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence

import torch
from hivemind.averaging.partition import BannedException, TensorPartReducer

from p2p_diloco.core.bounds import clip_to_budget
from p2p_diloco.core.robust import PartResult, default_aggregation, norm_statistics, reduce_part

logger = logging.getLogger(__name__)


def check_part(part: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> str | None:
    """Why a received part is unacceptable, or ``None``."""
    if tuple(part.shape) != tuple(shape):
        return f"part of shape {tuple(part.shape)} where {tuple(shape)} was expected"
    if part.dtype != dtype:
        return f"part of dtype {part.dtype} where {dtype} was expected"
    if not bool(torch.isfinite(part).all()):
        return "part holds NaN or infinite values"
    return None


class RobustPartReducer(TensorPartReducer):
    """``TensorPartReducer`` with validation at receipt, norm screening and a robust aggregation rule.

    :param part_shapes: shapes of the parts this peer reduces (from hivemind's partitioning).
    :param part_dtype: the dtype every part must arrive in (that of our own input parts).
    :param sender_ids: base58 ids of the senders, in hivemind's sender order.
    :param sender_weights: each sender's fresh weight in the plan (0 for members with only stale work); the
      pre-scaled inputs are renormalised by the accepted ones (``core.robust.rescale_factor``).
    :param screen_weights: per sender, the weights the norm screen divides its fresh and late-work parts by
      (``core.robust.screen_weights``); default: ``sender_weights`` for both.
    :param method: one of ``core.robust.AGGREGATIONS``, or ``auto``: resolved as for an open run
      (``core.robust.default_aggregation``; the caller resolves it with ``SwarmConfig.aggregation_for``).
    :param sparse: whether the parts are top-k parts (only to resolve ``auto``).
    :param norm_factor: ``SwarmConfig.norm_outlier_factor``; 0 disables the norm screen.
    :param banned: senders banned earlier in this run; all their parts are dropped.
    :param limits: per sender, the L2 norm its fresh and stale parts may reach together
      (``GroupPlan.sender_limits``); ``None`` clips nothing.
    :param regions: per part, 0 when it belongs to a fresh tensor and 1 for a stale one (needed with ``limits``;
      without it every part counts as fresh for the norm screen).
    :param own: our own sender index: our part anchors the norm screen (``core.robust.reduce_part``).
    """

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        part_dtype: torch.dtype,
        sender_ids: Sequence[str],
        sender_weights: Sequence[float],
        *,
        screen_weights: Sequence[tuple[float, float]] | None = None,
        method: str,
        norm_factor: float,
        banned: frozenset[str] = frozenset(),
        limits: Sequence[tuple[float, float]] | None = None,
        regions: Sequence[int] = (),
        own: int | None = None,
        sparse: bool = False,
    ):
        if len(sender_ids) != len(sender_weights):
            raise ValueError("one weight per sender is needed")
        if limits is not None and (len(limits) != len(sender_ids) or len(regions) != len(part_shapes)):
            raise ValueError("limits need one entry per sender and regions one per part")
        if regions and len(regions) != len(part_shapes):
            raise ValueError("regions need one entry per part")
        if screen_weights is not None and len(screen_weights) != len(sender_ids):
            raise ValueError("screen_weights need one entry per sender")
        self.limits, self.regions = limits, tuple(regions)
        self._spent = [[0.0, 0.0] for _ in sender_ids]  # squared norm accepted so far, per sender and region
        self.clipped: set[str] = set()
        """Senders whose parts were scaled down to their announced norm in this round."""
        self.part_dtype = part_dtype
        self.sender_ids = tuple(sender_ids)
        self.sender_weights = tuple(float(w) for w in sender_weights)
        # What the norm screen divides each sender's parts by, per region (core.robust.screen_weights).
        self.screen_weights = tuple((float(f), float(s)) for f, s in screen_weights) if screen_weights is not None \
            else tuple((w, w) for w in self.sender_weights)
        if method == "auto":
            method = default_aggregation(method, open_run=True, sparse=sparse)
        self.method, self.norm_factor, self.own = method, norm_factor, own
        self.rejections: dict[int, str] = {
            i: "banned earlier in this run" for i, peer in enumerate(sender_ids) if peer in banned
        }
        self.reduce_faults: list[str] = []
        self.dropped: set[int] = set()
        """Senders left out of this reducer's later parts of the round without a ban (``PartResult.dropped``)."""
        self._received: dict[int, torch.Tensor] = {}
        super().__init__(part_shapes, len(sender_ids))

    def reset_accumulators(self) -> None:
        if self.current_part_index >= self.num_parts - 1:
            self.finalize()
            return
        self.current_part_index += 1
        self.current_part_accumulated_from = 0
        self.current_part_future = asyncio.Future()
        self.accumulator = None  # hivemind's finalize() deletes it; parts are kept in _received instead
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
        if sender_index not in self.rejections:
            # Whatever happens here, the part must be counted below: a part left uncounted would hold up the
            # reduction of this part (and the whole all-reduce) for every sender until allreduce_timeout_s.
            # A failure of our own check is a fault (the round is skipped), not the sender's: no ban.
            try:
                problem = check_part(tensor_part, self.part_shapes[part_index], self.part_dtype)
                if problem is None:
                    self._received[sender_index] = self._within_limit(sender_index, part_index, tensor_part)
                else:
                    self.rejections[sender_index] = problem
            except Exception as e:
                logger.exception("Could not check part %d of sender %d", part_index, sender_index)
                self.reduce_faults.append(f"part {part_index} of sender {sender_index} could not be checked: {e!r}")
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await future

    def _within_limit(self, sender_index: int, part_index: int, part: torch.Tensor) -> torch.Tensor:
        if self.limits is None:
            return part
        region = self.regions[part_index]
        part, self._spent[sender_index][region], clipped = clip_to_budget(
            part, self._spent[sender_index][region], self.limits[sender_index][region]
        )
        if clipped and self.sender_ids[sender_index] not in self.clipped:
            self.clipped.add(self.sender_ids[sender_index])
            logger.info("Scaled %s's parts down to the norm it announced", self.sender_ids[sender_index])
        return part

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        accepted = {i: t for i, t in self._received.items() if i not in self.rejections and i not in self.dropped}
        # The same function the simulator reduces with (core.robust.GroupReduction), so its losses are ours.
        try:
            result = reduce_part(accepted, self.sender_weights, method=self.method, norm_factor=self.norm_factor,
                                 claimed_weights=self._part_screen_weights(), own=self.own)
        except Exception as e:  # the part must still complete (as a fault, which makes the round skip)
            logger.exception("Could not reduce part %d", self.current_part_index)
            result = PartResult(None, (), f"reduction failed: {e!r}")
        for index in result.outliers:
            self.rejections[index] = f"pseudo-gradient norm over {self.norm_factor:g}x the group's median"
        if result.outliers:
            self._log_screen(accepted, result.outliers)
        self.dropped.update(result.dropped)
        if result.fault is not None:
            self.reduce_faults.append(f"part {self.current_part_index}: {result.fault}")
        value = result.value
        if value is None:
            value = torch.zeros(self.part_shapes[self.current_part_index], dtype=self.part_dtype)
        self.current_part_future.set_result(value)
        self._received = {}
        self.reset_accumulators()

    def _part_screen_weights(self) -> list[float]:
        """Each sender's weight for the norm screen of the current part: that of the part's region."""
        region = self.regions[self.current_part_index] if self.regions else 0
        return [weights[region] for weights in self.screen_weights]

    def _log_screen(self, accepted: dict[int, torch.Tensor], outliers: tuple[int, ...]) -> None:
        """Log the norm screen's statistics of a part that cost senders their place (and perhaps a ban), so that
        a rejection can be checked afterwards. Never raises: the part must still complete."""
        try:
            order = sorted(accepted)
            weights = self._part_screen_weights()
            _, stats = norm_statistics([accepted[i] for i in order], [weights[i] for i in order])
            logger.warning("Part %d (%d values, %s region): rejected %s on the norm screen; norm per claimed weight "
                           "squared by sender: %s", self.current_part_index,
                           accepted[order[0]].numel() if order else 0,
                           "late-work" if self.regions and self.regions[self.current_part_index] else "fresh",
                           [self.sender_ids[i] for i in outliers],
                           {self.sender_ids[order[k]]: f"{v:.3g}" for k, v in sorted(stats.items())})
        except Exception:  # noqa: BLE001 - a log line, never the round
            logger.debug("Could not log the norm screen of part %d", self.current_part_index, exc_info=True)

    def rejected(self) -> dict[str, str]:
        """``{sender id: reason}`` for every sender whose data this reducer dropped."""
        return {self.sender_ids[i]: reason for i, reason in sorted(self.rejections.items())}
