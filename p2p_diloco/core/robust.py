"""Robust aggregation of n vectors (network-free): the plain mean, a coordinate-wise trimmed mean and
centered clipping, plus the norm-outlier screen applied before any of them.

Where they run. The swarm's reducers call :func:`reduce_part` on one part of the pseudo-gradient at a time,
with every accepted sender's copy of that part in hand (see ``swarm.reducer``): norm screen, then
:func:`aggregate`, then the rescale to the accepted senders' weighted mean. :class:`GroupReduction` does
what every member's reducer does, in one process and without a network (pre-scaling, hivemind's split into
parts, each reducer's bans); the simulator averages through it, so its losses measure the swarm's rule.

How to choose:

- ``mean``: exact weighted average; one peer sending garbage moves the result arbitrarily far. Right for
  private swarms of trusted peers (see ``SwarmConfig.allowed_peers``).
- ``trimmed-mean``: per coordinate, drops the ``trim`` largest and smallest values and averages the rest.
  Tolerates ``trim`` Byzantine peers per coordinate; costs a little accuracy on honest data because the
  extremes of honest peers are dropped too. Needs ``n > 2 * trim``.
- ``centered-clip`` (Karimireddy et al. 2021, used by hivemind's BTARD work): starts at the coordinate-wise
  median and moves towards each vector by at most ``tau`` in L2 norm, repeated a few times. Honest vectors
  closer than ``tau`` to the centre count fully, so on clean data the result is the mean; a far-away
  attacker moves it by at most ``tau / n`` per iteration. ``tau`` defaults to the median distance of the
  vectors from the median, which adapts to the spread of honest pseudo-gradients without tuning.

Sparse parts (``core.sparse``: each sender sends the top-k of every chunk of its part). The reducer decodes a
sparse part to the dense vector it stands for, zero wherever the sender sent nothing, and every rule above
runs on those vectors unchanged: a value a sender did not send counts as that sender saying 0 (what it
contributes this round; the rest waits in its error-feedback residual). So:

- ``mean``: the weighted mean of the senders' sparse vectors, non-zero on the union of their entries.
- ``trimmed-mean``: per coordinate, the unsent zeros take part in the sort. A coordinate sent by at most
  ``trim`` senders on one side of zero is trimmed away entirely (one sender cannot place a value alone),
  a coordinate that most senders chose keeps the mean of its middle values. It is the rule's guarantee
  applied to sparse input, bought with the loss of the values only few senders chose (they return through
  those senders' residuals only if sent again, which error feedback does not do: it counts them as sent).
- ``centered-clip``: starts at the coordinate-wise median (zero on coordinates fewer than half the senders
  chose) and moves toward each sender by at most ``tau``; with honest, similar senders it returns the mean.
- The norm screen compares the senders' sparse vectors, all of which keep about ``k`` of every chunk.

All three return a vector that is zero outside the union of the senders' entries (trimming and clipping
only average or shrink what senders sent); the reducer's reply keeps that vector's own top-k of every chunk
(``core.sparse.TopKCodec.reply_codec``).

Why an open swarm with a sparse codec must not run ``mean`` (:func:`default_aggregation`). The reply keeps
only the ``k`` largest entries of each chunk of the aggregate, so under ``mean`` a sender whose parts are a few
times an honest part's norm (5x passes the 20x norm screen) places its entries at the top of every chunk and
owns the whole reply: the honest entries are dropped, credited back to their senders' residuals, and the
honest signal in the model is zero for as long as it stays (``tests/unit/test_topk_capture.py``: the reply's
cosine with the honest mean 0.007 against 0.29 clean; an inverted attacker drove it to -0.26). ``centered-clip``
bounds each sender's pull on the aggregate by ``tau`` (about the median part's norm, :func:`centered_clip`), so
a sender's share of the reply is about one honest sender's at most, however long its parts: the same test keeps
0.88x the clean agreement (0.80x inverted, 0.70x with the attacker's norm in one chunk of four), its entries
at most 16% of the reply's squared norm. ``trimmed-mean`` also resists, but on sparse input it drops the
entries few senders chose (0.84x mean's clean agreement there, 0.43x with a weaker shared direction), so it is
not the default. The other half of the default is the error-feedback decay (``OuterConfig``): see there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2p_diloco.core.bounds import FLOAT_SLACK, clip_claims, clip_to_budget, l2_norm

logger = logging.getLogger(__name__)

AGGREGATIONS = ("mean", "trimmed-mean", "centered-clip")
AGGREGATION_CHOICES = ("auto", *AGGREGATIONS)
"""What ``SwarmConfig.aggregation`` accepts: a rule, or ``auto`` (:func:`default_aggregation`)."""
PART_SIZE_BYTES = 2**19
"""hivemind's and ``SwarmConfig.part_size_bytes``' default size of one all-reduce part."""
NORM_OUTLIER_FACTOR = 20.0
"""``SwarmConfig.norm_outlier_factor``'s default."""


def screen_weights(fresh: float, late: float) -> tuple[float, float]:
    """The weights the norm screen divides one member's parts by: ``(fresh region, late-work region)``.

    Each region's part carries only that region's work (``core.delayed.fold_scales`` scales the fresh
    pseudo-gradient by the fresh weight and the late work by its own), so each is normalised by its own
    weight. Dividing both by the sum, as the screen did, shrank the statistic of every member that folded
    late work by ``(fresh / (fresh + late))**2`` (4x for one round of late work, 9x for two): a reducer that
    folded anchored the screen on its own shrunken part, and an honest groupmate's ordinary spread (3-6x
    between honest peers in the simulator, a joiner's fresh optimizer included) could cross the 20x bound. A
    live relayed run saw an honest peer banned by another in a fold round, which this is one way to. In the
    simulator (4 peers, 2 folding one round each), the largest ratio of an honest part's statistic to a
    folder's anchored median fell from 5.3x to 1.9x with these weights.

    A member without work in a region sends zeros there, which the screen skips; but a codec's error
    feedback adds the residual of earlier rounds to a zeroed fresh region, so a region without weight falls
    back to the member's total (what the screen used before). A member with no weight at all that sends data
    is flagged, as before.
    """
    total = fresh + late
    return (fresh if fresh > 0 else total, late if late > 0 else total)


def norm_statistics(vectors: Sequence[torch.Tensor], weights: Sequence[float] | None = None
                    ) -> tuple[list[int], dict[int, float]]:
    """The norm screen's statistic per vector (:func:`norm_outliers`): ``norm / weight**2`` of every non-zero
    vector with a positive weight, and the indices flagged whatever the statistics say (a non-finite norm, a
    non-zero vector under a zero weight). Reducers log it with a rejection, so that a ban can be checked."""
    norms = [float(torch.linalg.vector_norm(v.double())) for v in vectors]
    flagged = [i for i, norm in enumerate(norms) if not math.isfinite(norm)]
    stats: dict[int, float] = {}
    for i, norm in enumerate(norms):
        if i in flagged or norm == 0.0:
            continue
        weight = 1.0 if weights is None else float(weights[i])
        if weights is not None and not weight > 0:
            flagged.append(i)
            continue
        stats[i] = norm / (weight * weight)
    return flagged, stats


def norm_outliers(
    vectors: Sequence[torch.Tensor], factor: float, min_count: int = 3, weights: Sequence[float] | None = None,
    anchor: int | None = None,
) -> list[int]:
    """Indices of vectors whose (weight-normalised) L2 norm exceeds ``factor`` times the median of them.

    ``weights`` are the senders' claimed weights. The swarm pre-scales each pseudo-gradient by its weight
    share, and a peer that did more local steps moves further, so an honest part's norm grows about with
    the square of its weight; ``norm / weight**2`` compares peers that did unequal work fairly. Without
    that, a peer with 5x the steps of the others would look like a 25x outlier and be banned.

    All-zero vectors (members without work in this part, e.g. fresh peers in the late-work buffer) take no
    part: they are neither flagged nor counted in the median. A non-zero vector claiming zero weight is
    flagged. With fewer than ``min_count`` non-zero vectors nobody is flagged (with two there is no telling
    which one is off). ``factor <= 0`` disables the screen.

    ``anchor``: the index of a vector known to be honest (the reducer's own), or ``None``. The lower median
    is a head count: Sybils sending tiny parts (or claiming large weights) in a group they outnumber would
    push it down until honest parts look like outliers. An anchor's statistic is a floor for the median, so
    no vector within ``factor`` of an honest one is flagged, however many tiny ones surround it (the swarm's
    reducers ban only on this anchored screen, ``reduce_part``).
    """
    if factor <= 0:
        return []
    flagged, stats = norm_statistics(vectors, weights)
    if len(stats) >= min_count:
        ordered = sorted(stats.values())
        median = ordered[(len(ordered) - 1) // 2]  # the lower median: one huge outlier cannot raise it
        if anchor is not None and anchor in stats:
            median = max(median, stats[anchor])  # ...and Sybils cannot lower it below an honest part
        flagged += [i for i, stat in stats.items() if stat > factor * median]
    return sorted(flagged)


def trimmed_mean(vectors: Sequence[torch.Tensor], trim: int | None = None) -> torch.Tensor:
    """Coordinate-wise mean after dropping the ``trim`` largest and smallest values of each coordinate.

    ``trim`` defaults to ``floor(n / 5)`` but at least 1 once there are three vectors, so 1 attacker in 5 is
    removed; with one or two vectors nothing can be trimmed and the plain mean is returned.
    """
    n = len(vectors)
    if n == 0:
        raise ValueError("trimmed_mean needs at least one vector")
    if trim is None:
        trim = max(n // 5, 1) if n >= 3 else 0
    if trim < 0 or n <= 2 * trim:
        raise ValueError(f"cannot trim {trim} from each side of {n} vectors")
    stacked = torch.stack([v.double() for v in vectors])
    if trim == 0:
        return stacked.mean(dim=0).to(vectors[0].dtype)
    ordered = stacked.sort(dim=0).values
    return ordered[trim : n - trim].mean(dim=0).to(vectors[0].dtype)


def centered_clip(
    vectors: Sequence[torch.Tensor], tau: float | None = None, iterations: int = 10
) -> torch.Tensor:
    """Centered clipping: ``v <- v + mean_i clip_tau(x_i - v)`` from the coordinate-wise median.

    ``tau`` (L2 radius) defaults to the median distance of the vectors from the coordinate-wise median.
    A few iterations suffice: each moves ``v`` by at most ``tau``; 10 costs 10 passes over the vectors.
    """
    if not vectors:
        raise ValueError("centered_clip needs at least one vector")
    stacked = torch.stack([v.double() for v in vectors])
    center = stacked.median(dim=0).values if len(vectors) > 2 else stacked.mean(dim=0)
    if tau is None:
        distances = torch.linalg.vector_norm(stacked - center, dim=tuple(range(1, stacked.dim())))
        tau = float(distances.median())
    if not tau > 0:
        return center.to(vectors[0].dtype)
    for _ in range(iterations):
        diffs = stacked - center
        norms = torch.linalg.vector_norm(diffs, dim=tuple(range(1, stacked.dim())))
        scales = torch.clamp(tau / norms.clamp_min(1e-300), max=1.0)
        center = center + (diffs * scales.reshape(-1, *([1] * (stacked.dim() - 1)))).mean(dim=0)
    return center.to(vectors[0].dtype)


def default_aggregation(choice: str, *, open_run: bool, sparse: bool) -> str:
    """The rule ``choice`` names: itself, or for ``auto`` ``centered-clip`` in an open run (no allow-list)
    with a sparse codec, where ``mean`` lets one sender own every top-k reply (module docstring), and ``mean``
    otherwise (exact; dense codecs reply with the whole aggregate, and a private swarm trusts its members).

    Every member of a run must reduce with the same rule: peers resolving ``auto`` agree as long as they
    share ``--allowed-peers`` (given or not) and ``--compression``."""
    if choice == "auto":
        return "centered-clip" if open_run and sparse else "mean"
    if choice not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {choice!r}; choose one of {', '.join(AGGREGATION_CHOICES)}")
    return choice


def aggregate(vectors: Sequence[torch.Tensor], method: str) -> torch.Tensor:
    """Aggregate equally-weighted ``vectors`` (same shape and dtype) with ``method`` from ``AGGREGATIONS``.

    Weighted averages are expressed by pre-scaling each vector by ``n * w_k / sum w`` (as the swarm does),
    so ``mean`` of the pre-scaled vectors is exactly the weighted mean; the robust methods then treat the
    pre-scaled vectors as equals, which matches the weighted mean whenever peers' weights are similar.
    """
    if not vectors:
        raise ValueError("nothing to aggregate")
    if method == "mean":
        return torch.stack([v.double() for v in vectors]).mean(dim=0).to(vectors[0].dtype)
    if method == "trimmed-mean":
        return _on_support(vectors, trimmed_mean)
    if method == "centered-clip":
        return _on_support(vectors, centered_clip)
    raise ValueError(f"unknown aggregation {method!r}; choose one of {', '.join(AGGREGATIONS)}")


def _on_support(vectors: Sequence[torch.Tensor], rule: Callable[[Sequence[torch.Tensor]], torch.Tensor]
                ) -> torch.Tensor:
    """``rule`` run only on the coordinates some vector holds, zero elsewhere: the same result for the robust
    rules (where every vector is zero, the median, every difference from it and every trimmed mean are zero,
    and no norm changes), at a fraction of the cost on sparse parts (6% of the coordinates for 4 senders at 64
    of 4096: centered clipping's 10 passes over a part of 1M values took 4 s on a loaded 2-core host)."""
    shape, numel = vectors[0].shape, vectors[0].numel()
    flat = [v.reshape(-1) for v in vectors]
    support = torch.zeros(numel, dtype=torch.bool)
    for v in flat:
        support |= v != 0
    held = torch.nonzero(support).squeeze(1)
    if 2 * held.numel() > numel:
        return rule(vectors)
    out = torch.zeros(numel, dtype=vectors[0].dtype)
    if held.numel():
        out[held] = rule([v[held] for v in flat])
    return out.reshape(shape)


@dataclass(frozen=True)
class PartResult:
    """What one reducer makes of one part."""

    value: torch.Tensor | None
    """The reduced part; ``None`` when nothing acceptable is left (the reducer then sends zeros)."""
    outliers: tuple[int, ...]
    """Sender indices the norm screen dropped from this part (the reducer drops them from its later parts
    too, and the averager bans them for the run)."""
    fault: str | None = None
    """Why ``value`` is ``None``."""
    excluded: tuple[int, ...] = ()
    """Sender indices the norm screen left out of this part only: its part is too small
    (``MIN_BANNING_VALUES``) for its norm to say anything about the sender, so nobody is banned on it."""
    dropped: tuple[int, ...] = ()
    """Sender indices the norm screen judged on a part large enough (``MIN_BANNING_VALUES``) but did not ban:
    this reducer has no own part to measure them by, or they are not over its own part. The reducer leaves
    them out of its later parts of the round too: past its first part such a sender has spent the norm it
    announced, its later parts are scaled down to about zero and pass the screen, and counted as zeros they
    would dilute the mean. Nobody bans them for the run on this."""


MIN_BANNING_VALUES = 64
"""Fewest values a part needs for the norm screen to ban on it. The norm of a part of one value (a bias of one
value, the remainder of a tensor's split) is one coordinate of a pseudo-gradient, and a coordinate of honest
pseudo-gradients differs between peers by orders of magnitude: the screen flagged honest peers there. On a
smaller part the screen still leaves flagged values out of that part's average (a sender could put its whole
norm budget into one coordinate), but bans nobody. From 64 values up a norm concentrates (its relative spread
is about ``1/sqrt(2 * values)`` for like-distributed values), far inside the screen's factor of 20."""


def rescale_factor(sender_weights: Sequence[float], accepted: Sequence[int]) -> float | None:
    """Factor turning the aggregate of the ``accepted`` senders' pre-scaled parts into their weighted mean.

    Inputs were scaled by ``n * w_k / W`` (``swarm.group.GroupPlan.local_scales``), so the mean over the ``a``
    accepted ones, times ``(a / n) * (W / W_accepted)``, is ``sum_accepted w_k x_k / W_accepted``. ``None``
    when the accepted senders hold no weight (every sender of fresh work was rejected).
    """
    if len(accepted) == len(sender_weights):
        return 1.0
    kept = math.fsum(sender_weights[i] for i in accepted)
    if not kept > 0:
        return None
    return (len(accepted) / len(sender_weights)) * (math.fsum(sender_weights) / kept)


def reduce_part(
    parts: Mapping[int, torch.Tensor],
    sender_weights: Sequence[float],
    *,
    method: str,
    norm_factor: float,
    claimed_weights: Sequence[float] | None = None,
    own: int | None = None,
) -> PartResult:
    """One reducer's work on one part: norm screen, ``aggregate`` with ``method``, rescale.

    :param parts: sender index -> that sender's pre-scaled part, for the senders not rejected already.
    :param sender_weights: every sender's fresh weight (0 for members with only late work), indexed like
      ``parts``; their count is the group size ``n`` of the pre-scaling.
    :param norm_factor: see :func:`norm_outliers`; 0 disables the screen.
    :param claimed_weights: per sender, the weight of the work in this part (:func:`screen_weights`), for the
      norm screen (default sender_weights).
    :param own: the reducer's own sender index. A part over the median's bound is left out of this part;
      its sender is banned only when it is also over the bound of the reducer's own part (``norm_outliers``'s
      anchor): the median is whatever the group's majority, Sybils perhaps, sends, and a ban must rest on
      this peer's own evidence. Without an own part (``None``, or zeros here) nobody is banned on norms.
    """
    claimed = sender_weights if claimed_weights is None else claimed_weights
    order = sorted(parts)
    vectors, weights = [parts[i] for i in order], [claimed[i] for i in order]
    flagged = tuple(order[p] for p in norm_outliers(vectors, norm_factor, weights=weights))
    anchor = order.index(own) if own in parts and bool(parts[own].any()) else None
    judged = parts[order[0]].numel() >= MIN_BANNING_VALUES
    if anchor is not None and judged:
        # banned: over the median AND over our own part (the median alone is a head count Sybils can skew)
        outliers = tuple(order[p] for p in norm_outliers(vectors, norm_factor, weights=weights, anchor=anchor))
    else:
        # no honest yardstick, or too few values to judge a sender by: leave them out, ban only a non-zero
        # part sent under a zero weight (a contradiction, not a statistical judgement)
        outliers = tuple(i for i in flagged if not float(claimed[i]) > 0)
    rest = tuple(i for i in flagged if i not in outliers)
    dropped, excluded = (rest, ()) if judged else ((), rest)
    kept = [i for i in order if i not in flagged]
    if not kept:
        return PartResult(None, outliers, "no acceptable contribution", excluded, dropped)
    combined = aggregate([parts[i] for i in kept], method)
    scale = rescale_factor(sender_weights, kept)
    if scale is None:
        return PartResult(None, outliers, "every sender of fresh work was rejected", excluded, dropped)
    value = combined if scale == 1.0 else (combined.double() * scale).to(combined.dtype)
    return PartResult(value, outliers, excluded=excluded, dropped=dropped)


def part_size_values(part_size_bytes: int, bits_per_value: float) -> int:
    """Values per all-reduce part of fp32 tensors sent at ``bits_per_value`` on the wire (hivemind's rule)."""
    return max(1, int(part_size_bytes / (4 * (bits_per_value / 32))))


def split_parts(tensors: Sequence[torch.Tensor], values_per_part: int) -> list[torch.Tensor]:
    """hivemind's split: each tensor flattened and cut into pieces of ``values_per_part``; no part spans two
    tensors, so a model with many small tensors has many small parts."""
    return [part for t in tensors for part in t.detach().reshape(-1).split(values_per_part)]


def assign_parts(part_sizes: Sequence[int], fractions: Sequence[float]) -> list[int]:
    """The reducer (member index) of each part, as hivemind's ``TensorPartContainer`` assigns them: member
    ``r`` owns the span ``fractions[r]`` of the concatenated vector, and a part straddling two spans goes to
    the member holding most of it."""
    total = sum(part_sizes)
    pivots = (np.cumsum(fractions) / np.sum(fractions) * total).astype(np.int64)
    pivots[-1] = total
    owners, length, member = [], 0, 0
    for size in part_sizes:
        if length + size > pivots[member]:
            first, overlaps = member, [pivots[member] - length]
            while length + size > pivots[member]:
                member += 1
                overlaps.append(min(length + size, pivots[member]) - pivots[member - 1])
            owners.append(first + int(np.argmax(overlaps)))
        else:
            owners.append(member)
        length += size
    return owners


class GroupReduction:
    """A fixed group's all-reduce without a network: what the swarm's reducers compute, member by member.

    Each sender's tensors are pre-scaled by ``n * w_k / W``, split into parts as hivemind does, clipped to the
    norm the sender announces (its true norm, clipped by ``core.bounds.clip_claims`` like the swarm's), and
    each part is reduced by its owner with :func:`reduce_part`. A sender the norm screen bans is dropped from that
    reducer's later parts of the round and from all its parts in later rounds (the averager bans it for the
    run); one it judged without banning (``PartResult.dropped``), from that reducer's later parts of the round;
    other reducers keep it until their own screen catches it. Simplification: the group never changes,
    while in the swarm a peer that banned the sender also refuses to group with it when it leads matchmaking.
    Reducers own equal spans (hivemind's balance for equal bandwidths).

    :param members: group size ``n``.
    :param method: one of ``AGGREGATIONS``, or ``auto`` resolved as in an open swarm (:func:`default_aggregation`:
      the simulator's workers have no allow-list).
    :param norm_factor: ``SwarmConfig.norm_outlier_factor``; 0 disables the norm screen.
    :param values_per_part: see :func:`part_size_values`.
    :param sparse: whether the senders' tensors are top-k parts (only to resolve ``auto``).
    """

    def __init__(self, members: int, *, method: str, norm_factor: float, values_per_part: int,
                 sparse: bool = False) -> None:
        self.sparse = sparse
        method = default_aggregation(method, open_run=True, sparse=sparse)
        self.members, self.method, self.norm_factor = members, method, norm_factor
        self.values_per_part = values_per_part
        self.banned: list[dict[int, str]] = [{} for _ in range(members)]
        """Per reducer: sender index -> why its data is dropped for the rest of the run."""
        self.new_bans: list[tuple[int, int, str]] = []
        """(reducer, sender, reason) for each ban the last :meth:`reduce` made."""
        self.faults: list[str] = []
        """Parts of the last :meth:`reduce` left without any accepted sender (reduced to zeros; the swarm
        skips such a round)."""

    @torch.no_grad()
    def reduce(
        self, tensors_by_sender: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]
    ) -> list[torch.Tensor]:
        """The group's result for one round: the accepted senders' weighted mean, part by part."""
        if len(tensors_by_sender) != self.members or len(weights) != self.members:
            raise ValueError(f"need {self.members} senders and weights, got {len(tensors_by_sender)}")
        total = math.fsum(weights)
        scales = [self.members * w / total for w in weights]
        parts = [
            split_parts([t * s for t in tensors], self.values_per_part)
            for tensors, s in zip(tensors_by_sender, scales, strict=True)
        ]
        owners = assign_parts([p.numel() for p in parts[0]], [1.0] * self.members)
        claims = clip_claims([l2_norm(ts) for ts in tensors_by_sender], weights, self.norm_factor)
        spent = [[0.0] * self.members for _ in range(self.members)]  # per reducer, per sender
        for index, owner in enumerate(owners):
            for k in range(self.members):
                parts[k][index], spent[owner][k], _ = clip_to_budget(
                    parts[k][index], spent[owner][k], FLOAT_SLACK * scales[k] * claims[k]
                )
        # Within the round a reducer drops a rejected sender from its later parts, itself included; only
        # others are banned for the run (an averager never bans itself). A sender judged but not banned
        # (PartResult.dropped) is left out of the reducer's later parts of this round only.
        rejected = [dict(banned) for banned in self.banned]
        dropped: list[set[int]] = [set() for _ in range(self.members)]
        reduced, self.new_bans, self.faults = [], [], []
        for index, owner in enumerate(owners):
            result = reduce_part(
                {k: parts[k][index] for k in range(self.members)
                 if k not in rejected[owner] and k not in dropped[owner]},
                weights,
                method=self.method,
                norm_factor=self.norm_factor,
                own=owner,
            )
            for sender in result.outliers:
                rejected[owner][sender] = (
                    f"pseudo-gradient norm over {self.norm_factor:g}x the group's median"
                )
            dropped[owner].update(result.dropped)
            if result.fault is not None:
                self.faults.append(f"part {index}: {result.fault}")
            reduced.append(result.value if result.value is not None else torch.zeros_like(parts[0][index]))
        for owner, senders in enumerate(rejected):
            for sender, reason in senders.items():
                if sender != owner and sender not in self.banned[owner]:
                    self.banned[owner][sender] = reason
                    self.new_bans.append((owner, sender, reason))
                    logger.debug(
                        "Reducer %d bans sender %d for the rest of the run: %s", owner, sender, reason
                    )
        flat = iter(reduced)
        out = []
        for t in tensors_by_sender[0]:
            count = len(t.reshape(-1).split(self.values_per_part))
            out.append(torch.cat([next(flat) for _ in range(count)]).reshape(t.shape))
        return out
