"""Robust aggregation of n vectors (network-free): the plain mean, a coordinate-wise trimmed mean and
centered clipping, plus the norm-outlier screen applied before any of them.

Where they run. The swarm's reducers call :func:`aggregate` on one part of the flattened pseudo-gradient at a
time, with every accepted sender's copy of that part in hand (see ``swarm.reducer``). The math is here so it
can be tested and benchmarked without a network.

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

AGGREGATIONS = ("mean", "trimmed-mean", "centered-clip")


def norm_outliers(
    vectors: Sequence[torch.Tensor], factor: float, min_count: int = 3, weights: Sequence[float] | None = None
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
    """
    if factor <= 0:
        return []
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
    if len(stats) >= min_count:
        ordered = sorted(stats.values())
        median = ordered[(len(ordered) - 1) // 2]  # the lower median: one huge outlier cannot raise it
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
        return trimmed_mean(vectors)
    if method == "centered-clip":
        return centered_clip(vectors)
    raise ValueError(f"unknown aggregation {method!r}; choose one of {', '.join(AGGREGATIONS)}")
