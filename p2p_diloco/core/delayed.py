"""Folding late work into the outer step: the peer-to-peer delayed rule and the server baselines.

Staleness
---------
A contribution's *staleness* ``s`` is the number of outer steps the shared parameters took
between the anchor the peer started from and the round its pseudo-gradient is applied in.
Work started from θ(t-1) and averaged in round t is fresh (``s = 0``); the same work arriving
only in round t+2 has ``s = 2``.

The peer-to-peer rule (what the swarm and the simulator both run)
----------------------------------------------------------------
A round receives fresh contributions ``i`` (weight ``w_i``) and late ones ``j`` (staleness
``s_j ≥ 1``, weight ``w_j``). With ``W_f = Σ_i w_i``::

    Δ_f   = Σ_i w_i Δ_i / W_f                         → full Nesterov step (momentum updated)
    stale = Σ_j λ(s_j) w_j Δ_j / D                    → θ ← θ − η·stale (momentum untouched)

    λ(s) = staleness_decay ** (s − 1)   for 1 ≤ s ≤ max_staleness
    λ(s) = 0 (dropped and counted)      for s > max_staleness
    D    = max(W_f, Σ_j w_j over the applied late work)

Why this rule:

* With no late work it *is* DiLoCo: the same weighted mean through the same Nesterov step,
  bit for bit, so a swarm where nobody is late trains exactly like the paper.
* Stale work never enters the momentum. Momentum re-applies a pseudo-gradient for many
  rounds (about 1/(1−μ) = 10 at μ = 0.9), and that is what makes naive asynchronous Nesterov
  worse than synchronous DiLoCo. Applying late work once, without momentum, is Delayed
  Nesterov's non-momentum term ``g/N`` with ``c = 0`` (the paper's setting); unlike the
  server version, late work is not accumulated into the next momentum update either, since
  in a swarm a round's momentum update must only see work computed from the same anchor.
* Dividing by ``W_f`` gives a late peer the share it would have had among the fresh ones
  (``w_j / W_f``, like ``g/N`` in DN), and keeps the fresh mean unchanged by late arrivals.
  When the late weight exceeds the fresh weight (nobody fresh, or a tiny fresh claim), ``D``
  becomes the late total, so no late pseudo-gradient is ever applied with a coefficient above
  λ ≤ 1: a peer cannot amplify stale work by pairing it with a tiny fresh weight.

Choosing the policy:

* ``max_staleness`` (default 4): how many rounds late work may be and still help. A
  pseudo-gradient computed ``s`` outer steps ago points at where the parameters were, not
  where they are; the DiLoCo paper lost only about 2% perplexity when dropping half of the
  outer gradients, so dropping very old work is cheap while applying it risks a wrong-way
  step. Raise it when rounds are short (small H), lower it (even to 0: drop all late work)
  when rounds are long or the outer lr is large.
* ``staleness_decay`` in (0, 1] (default 1.0): a one-round-late contribution always counts
  fully; each extra round multiplies it by the decay. Keep 1.0 with DyLU, which keeps peers
  on time so lateness is rare; use 0.5 when late peers are common and the loss jumps after
  rounds that applied late work.

Linear-sum form for the all-reduce
----------------------------------
An all-reduce averages ``G`` equal-weight tensors. Once the group has exchanged every
member's ``(weight, staleness)`` (small metadata), :func:`summarize_round` gives each peer the
same totals and :func:`contribution_scales` the factors ``(a_p, b_p)`` for its own ``Δ_p``::

    a_p = G·w_p / W_f          if fresh, else 0      → mean_p(a_p Δ_p) = Δ_f
    b_p = G·λ(s_p)·w_p / D     if late,  else 0      → mean_p(b_p Δ_p) = stale

Every member (fresh, late or dropped) takes part in the "fresh" all-reduce, sending zeros
where its factor is 0; the "stale" all-reduce is only needed when ``stats.has_stale``. The
all-reduce must average with equal weights over exactly the ``G`` peers the totals were
computed for: if a member fails mid-way the mean is over fewer peers and wrong, so such a
round must be retried or dropped, never applied.

Server-style baselines (simulator only)
---------------------------------------
:class:`NaiveAsyncNesterov` and :class:`DelayedNesterov` reproduce section 2 of Liu et al.
(arXiv 2401.09135), where a server updates θ on every push.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from p2p_diloco.core.outer import OuterOptimizer
from p2p_diloco.core.pseudograd import weighted_mean

__all__ = [
    "Contribution",
    "DelayedNesterov",
    "NaiveAsyncNesterov",
    "RoundAggregate",
    "RoundStats",
    "StalenessPolicy",
    "aggregate_round",
    "apply_round",
    "contribution_scales",
    "delayed_outer_step",
    "fold_scales",
    "group_stats",
    "summarize_round",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StalenessPolicy:
    """How much late work counts; see the module docstring for how to choose the values."""

    staleness_decay: float = 1.0
    max_staleness: int = 4

    def __post_init__(self) -> None:
        if not (math.isfinite(self.staleness_decay) and 0.0 < self.staleness_decay <= 1.0):
            raise ValueError(f"staleness_decay must be in (0, 1], got {self.staleness_decay}")
        if (
            isinstance(self.max_staleness, bool)
            or not isinstance(self.max_staleness, int)
            or self.max_staleness < 0
        ):
            raise ValueError(f"max_staleness must be an integer >= 0, got {self.max_staleness!r}")

    def factor(self, staleness: int) -> float:
        """λ(s): 1 for fresh work, ``decay**(s-1)`` for applied late work, 0 when dropped."""
        _check_staleness(staleness)
        if staleness == 0:
            return 1.0
        if staleness > self.max_staleness:
            return 0.0
        return self.staleness_decay ** (staleness - 1)


def _check_staleness(staleness: int) -> None:
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be an integer >= 0, got {staleness!r}")


def _check_weight(weight: float) -> None:
    if not (math.isfinite(weight) and weight >= 0.0):
        raise ValueError(f"contribution weight must be finite and >= 0, got {weight}")


@dataclass
class Contribution:
    """One peer's pseudo-gradient as it enters a round.

    ``weight`` is what the average weighs by (samples or tokens processed; 1.0 for uniform).
    """

    delta: Sequence[Tensor]
    weight: float
    staleness: int = 0
    peer_id: str | None = None

    def __post_init__(self) -> None:
        _check_weight(self.weight)
        _check_staleness(self.staleness)


@dataclass
class RoundStats:
    """What a round was made of; every contribution's staleness is kept, in input order."""

    n_fresh: int
    n_stale: int
    n_dropped: int
    stalenesses: list[int]
    weights: list[float]
    peer_ids: list[str | None] = field(default_factory=list)
    fresh_weight_total: float = 0.0
    late_weight_total: float = 0.0
    denominator: float = 0.0

    @property
    def group_size(self) -> int:
        return len(self.stalenesses)

    @property
    def has_fresh(self) -> bool:
        """True when the round makes a Nesterov step (some fresh work with positive weight)."""
        return self.fresh_weight_total > 0.0

    @property
    def has_stale(self) -> bool:
        """True when late work moves the parameters this round."""
        return self.late_weight_total > 0.0 and self.denominator > 0.0


@dataclass
class RoundAggregate:
    """The two aggregates of a round; None where the round has no such work."""

    fresh_mean: list[Tensor] | None
    stale_term: list[Tensor] | None
    stats: RoundStats


def summarize_round(
    weights: Sequence[float],
    stalenesses: Sequence[int],
    policy: StalenessPolicy | None = None,
    peer_ids: Sequence[str | None] | None = None,
) -> RoundStats:
    """Totals of a round from its members' metadata alone (no tensors needed).

    Every peer of an all-reduce group computes this from the same gathered metadata, so all
    of them agree on ``W_f`` and ``D``.
    """
    policy = policy or StalenessPolicy()
    if len(weights) != len(stalenesses):
        raise ValueError(f"{len(weights)} weights but {len(stalenesses)} stalenesses")
    ids = list(peer_ids) if peer_ids is not None else [None] * len(weights)
    if len(ids) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(ids)} peer ids")
    fresh_total = late_total = 0.0
    n_fresh = n_stale = n_dropped = 0
    for weight, staleness, peer_id in zip(weights, stalenesses, ids, strict=True):
        _check_weight(weight)
        _check_staleness(staleness)
        if staleness == 0:
            n_fresh += 1
            fresh_total += weight
        elif policy.factor(staleness) > 0.0:
            n_stale += 1
            late_total += weight
        else:
            n_dropped += 1
            logger.info(
                "dropping work of peer %s: %d rounds late (max %d)", peer_id, staleness, policy.max_staleness
            )
    return RoundStats(
        n_fresh=n_fresh,
        n_stale=n_stale,
        n_dropped=n_dropped,
        stalenesses=[int(s) for s in stalenesses],
        weights=[float(w) for w in weights],
        peer_ids=ids,
        fresh_weight_total=fresh_total,
        late_weight_total=late_total,
        denominator=max(fresh_total, late_total),
    )


def contribution_scales(
    weight: float, staleness: int, stats: RoundStats, policy: StalenessPolicy | None = None
) -> tuple[float, float]:
    """Factors ``(a, b)`` a peer multiplies its own Δ by before the "fresh" and "stale" all-reduces.

    With these factors, the plain mean over the ``stats.group_size`` pre-scaled tensors equals
    :func:`aggregate_round`'s fresh mean (resp. stale term); see the module docstring. This is the
    one-contribution-per-member form; :func:`fold_scales` is the same formula for a member that sends
    fresh and late work in one round (the swarm's all-reduce and the simulator's group).
    """
    policy = policy or StalenessPolicy()
    _check_weight(weight)
    if staleness == 0:
        return fold_scales(weight, 0.0, stats)
    return fold_scales(0.0, policy.factor(staleness) * weight, stats)


def fold_scales(fresh_weight: float, late_weight: float, stats: RoundStats) -> tuple[float, float]:
    """The fold scales: ``(G·w/W_f, G·λw/D)`` for a member's fresh work of weight ``fresh_weight`` and late
    work of decayed weight ``late_weight`` (``λ(s)·w``; 0 where it sends none), ``G = stats.group_size``.

    The one place the formula lives: :func:`contribution_scales` (core), the swarm's group plan
    (``swarm.group.GroupPlan.local_scales``) and the simulator's group (``simulate.swarm_mode.SimGroup``)
    all call it, so a change to how late work is weighed reaches all three at once.
    """
    _check_weight(fresh_weight)
    _check_weight(late_weight)
    group_size = stats.group_size
    fresh = group_size * fresh_weight / stats.fresh_weight_total if fresh_weight > 0 and stats.has_fresh else 0.0
    stale = group_size * late_weight / stats.denominator if late_weight > 0 and stats.has_stale else 0.0
    return fresh, stale


def group_stats(
    fresh_weights: Sequence[float],
    late_weights: Sequence[float],
    stalenesses: Sequence[int] | None = None,
    peer_ids: Sequence[str | None] | None = None,
) -> RoundStats:
    """Totals of an all-reduce group in which member ``p`` sends fresh work of weight ``fresh_weights[p]``
    and late work of decayed weight ``late_weights[p]`` (``λ(s)·w`` as :meth:`StalenessPolicy.factor`
    gives it; 0 for "none" in either list), both in the same round: ``W_f`` is the fresh total and
    ``D = max(W_f, late total)``, over the group's ``len(fresh_weights)`` members (the all-reduce's mean
    is over members, not contributions). ``stalenesses`` (each member's late work's, 0 without late work)
    are kept for reports. Inputs are checked like :func:`summarize_round`'s.
    """
    if len(fresh_weights) != len(late_weights):
        raise ValueError(f"{len(fresh_weights)} fresh weights but {len(late_weights)} late weights")
    ages = [0] * len(fresh_weights) if stalenesses is None else [int(s) for s in stalenesses]
    if len(ages) != len(fresh_weights):
        raise ValueError(f"{len(fresh_weights)} members but {len(ages)} stalenesses")
    for age in ages:
        _check_staleness(age)
    for w in (*fresh_weights, *late_weights):
        _check_weight(w)
    fresh_total = math.fsum(w for w in fresh_weights if w > 0)
    late_total = math.fsum(w for w in late_weights if w > 0)
    ids = list(peer_ids) if peer_ids is not None else [None] * len(fresh_weights)
    return RoundStats(
        n_fresh=sum(1 for w in fresh_weights if w > 0),
        n_stale=sum(1 for w in late_weights if w > 0),
        n_dropped=0,
        stalenesses=ages,
        weights=[float(w) for w in fresh_weights],
        peer_ids=ids,
        fresh_weight_total=fresh_total,
        late_weight_total=late_total,
        denominator=max(fresh_total, late_total),
    )


@torch.no_grad()
def aggregate_round(
    contributions: Sequence[Contribution], policy: StalenessPolicy | None = None
) -> RoundAggregate:
    """Compute a round's fresh mean and scaled stale term from whole contributions."""
    policy = policy or StalenessPolicy()
    stats = summarize_round(
        [c.weight for c in contributions],
        [c.staleness for c in contributions],
        policy,
        [c.peer_id for c in contributions],
    )
    fresh = [c for c in contributions if c.staleness == 0]
    # The very same weighted_mean as synchronous DiLoCo, so no-late rounds match it bit for bit.
    fresh_mean = (
        weighted_mean([c.delta for c in fresh], [c.weight for c in fresh]) if stats.has_fresh else None
    )

    stale_term = None
    if stats.has_stale:
        late = [c for c in contributions if c.staleness > 0 and policy.factor(c.staleness) > 0.0]
        reference = late[0].delta
        stale_term = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in reference]
        for contribution in late:
            coefficient = policy.factor(contribution.staleness) * contribution.weight / stats.denominator
            if coefficient == 0.0:
                continue
            if len(contribution.delta) != len(stale_term):
                raise ValueError(
                    f"late contribution of peer {contribution.peer_id} has the wrong number of tensors"
                )
            for out, d in zip(stale_term, contribution.delta, strict=True):
                if d.shape != out.shape:
                    raise ValueError(
                        f"late contribution of peer {contribution.peer_id} has a mismatched shape"
                    )
                out.add_(d.to(device=out.device, dtype=torch.float32), alpha=coefficient)
    return RoundAggregate(fresh_mean=fresh_mean, stale_term=stale_term, stats=stats)


def apply_round(outer: OuterOptimizer, aggregate: RoundAggregate) -> None:
    """Nesterov step on the fresh mean, then the momentum-free step on the stale term.

    The two updates commute (the momentum-free term neither reads nor writes the momentum),
    so the order only fixes the floating-point rounding.
    """
    if aggregate.fresh_mean is not None:
        outer.step(aggregate.fresh_mean)
    if aggregate.stale_term is not None:
        outer.apply_momentum_free(aggregate.stale_term)


def delayed_outer_step(
    outer: OuterOptimizer, contributions: Sequence[Contribution], policy: StalenessPolicy | None = None
) -> RoundStats:
    """Aggregate a round's contributions and apply them; returns the round's record."""
    aggregate = aggregate_round(contributions, policy)
    apply_round(outer, aggregate)
    return aggregate.stats


class NaiveAsyncNesterov:
    """Server baseline: every pushed pseudo-gradient goes straight through a Nesterov step.

    ``lr`` is applied per push, so with N workers the parameters move about N times as far per
    "round" as synchronous DiLoCo at the same lr; tune it (e.g. lr/N) when comparing.
    """

    def __init__(self, params: Sequence[Tensor], lr: float = 0.7, momentum: float = 0.9) -> None:
        self.outer = OuterOptimizer(params, lr=lr, momentum=momentum)
        self.num_pushes = 0

    @property
    def params(self) -> list[Tensor]:
        return self.outer.anchors

    def push(self, g: Sequence[Tensor]) -> None:
        self.outer.step(g)
        self.num_pushes += 1


class DelayedNesterov:
    """Delayed Nesterov (Liu et al., section 2): momentum is updated once every N pushes.

    On each push ``g``::

        A ← A + g
        if (t + 1) mod N == 0:  m ← β·m + A/N;  θ ← θ − ε·((1 − c·N + c)·β·m + g/N);  A ← 0
        else:                   θ ← θ − ε·(c·β·m + g/N)
        t ← t + 1

    Args:
        params: fp32 tensors updated in place (the server's θ).
        buffer_size: N; the paper sets it to the number of workers, so that with equal
            workers and ``c = 0`` N pushes add up to one synchronous DiLoCo step.
        beta: momentum decay β (0.9 as in DiLoCo).
        lr: step size ε (0.7 as in DiLoCo).
        c: momentum activation in [0, 1/N]; the paper uses 0 (momentum only at flushes).
    """

    def __init__(
        self, params: Sequence[Tensor], buffer_size: int, beta: float = 0.9, lr: float = 0.7, c: float = 0.0
    ) -> None:
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an integer >= 1, got {buffer_size!r}")
        if not (math.isfinite(beta) and 0.0 <= beta < 1.0):
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if not (math.isfinite(lr) and lr > 0.0):
            raise ValueError(f"lr must be finite and > 0, got {lr}")
        if not (math.isfinite(c) and 0.0 <= c <= 1.0 / buffer_size):
            raise ValueError(f"c must be in [0, 1/N] = [0, {1.0 / buffer_size}], got {c}")
        self.params = list(params)
        for index, p in enumerate(self.params):
            if p.dtype != torch.float32:
                raise ValueError(f"param {index} is {p.dtype}; DelayedNesterov works on torch.float32")
        self.buffer_size, self.beta, self.lr, self.c = buffer_size, float(beta), float(lr), float(c)
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.accumulator = [torch.zeros_like(p) for p in self.params]
        self.num_pushes = 0

    @torch.no_grad()
    def push(self, g: Sequence[Tensor]) -> None:
        if len(g) != len(self.params):
            raise ValueError(f"expected {len(self.params)} tensors, got {len(g)}")
        n, beta, lr, c = self.buffer_size, self.beta, self.lr, self.c
        flush = (self.num_pushes + 1) % n == 0
        for p, m, acc, grad in zip(self.params, self.momentum, self.accumulator, g, strict=True):
            if grad.shape != p.shape:
                raise ValueError(f"pushed tensor of shape {tuple(grad.shape)}, expected {tuple(p.shape)}")
            grad = grad.to(device=p.device, dtype=torch.float32)
            acc.add_(grad)
            if flush:
                m.mul_(beta).add_(acc, alpha=1.0 / n)
                p.add_(m, alpha=-lr * (1.0 - c * n + c) * beta)
                acc.zero_()
            elif c != 0.0:
                p.add_(m, alpha=-lr * c * beta)
            p.add_(grad, alpha=-lr / n)
        self.num_pushes += 1
