"""The round policy: what a peer does with each round, as data in and decisions out (no network).

The swarm (``peer.session``) and the simulator (``simulate.policy``) feed it the same observations and
execute the same decisions, through :class:`p2p_diloco.core.round_driver.RoundDriver`. A round, from one
peer's side (epoch ``e``: its anchors are θ(e)):

1. **Behind?** The swarm's epoch ``G`` (the largest epoch peers publish) is past ``e``: this peer missed
   round ``e``. :attr:`Action.RESYNC`: its pseudo-gradient becomes late work (origin ``e``), it downloads
   the current state, and the work is folded into a later round with staleness ``G' - e``
   (:mod:`p2p_diloco.core.delayed`). Outcome :attr:`Outcome.RESYNCED`.
2. **Minority?** A strict majority of peers published another checksum for epoch ``e``: our parameters
   drifted; :attr:`Action.RESYNC` as above.
3. **Alone.** No other live peer visible: :attr:`Action.SOLO`, apply our own pseudo-gradient (DiLoCo with
   k = 1). A peer that saw others first waits ``solo_after_s`` (a partition must not split the swarm) and
   meanwhile tries to average.
4. **Averaging.** :attr:`Action.AVERAGE` (or :attr:`Action.EAGER` with overlap): join the all-reduce of
   epoch ``e`` with the fresh work and any late work. A complete all-reduce is applied
   (:attr:`Action.APPLY`, outcome ``averaged`` or ``folded_late``); a failed or partial one never is: if the
   others advanced, :attr:`Action.RESYNC`; if nobody did, :attr:`Action.CARRY`, the peer trains on from its
   local parameters, so the next pseudo-gradient covers both phases (outcome ``skipped``).

All work not yet applied by an outer step is in one :class:`PendingWork`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from p2p_diloco.core.delayed import StalenessPolicy

logger = logging.getLogger(__name__)


class Outcome(str, enum.Enum):
    """How a round ended for one peer. The value is what logs, metrics and JSON carry."""

    AVERAGED = "averaged"
    """A complete all-reduce (or a solo round) was applied."""
    FOLDED_LATE = "folded_late"
    """As ``AVERAGED``, and this peer's late work went in."""
    RESYNCED = "resynced"
    """The peer downloaded the swarm's state; its work of the round is kept as late work."""
    SKIPPED = "skipped"
    """Nothing was applied; the peer trains on from its local parameters (no work lost)."""
    OWN_ONLY = "own_only"
    """Eager overlap: the previous round's average was not usable; the peer stepped with its own term."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def synced(self) -> bool:
        """After this outcome the peer holds the swarm's parameters of the round's new epoch."""
        return self in (Outcome.AVERAGED, Outcome.FOLDED_LATE, Outcome.RESYNCED)


class Stall(str, enum.Enum):
    """Why no round of this swarm can average, as far as a peer can tell ("" when it sees no reason); the
    swarm layer diagnoses it (``swarm.reach``) after a skipped round."""

    NONE = ""
    ALL_CLIENTS = "all_clients"
    """Every peer of the run is in client mode: nobody can lead a group or reduce a part."""
    UNREACHABLE = "unreachable"
    """This full peer announces only private addresses while the swarm is on the internet."""

    def __str__(self) -> str:
        return self.value


STALL_HINTS = {
    Stall.ALL_CLIENTS: "nobody can reduce: every peer is in client mode (see the warning for the fix)",
    Stall.UNREACHABLE: "nobody outside this network can dial this peer (see the warning for the fix)",
}


@dataclass
class RoundResult:
    """What one all-reduce produced for this peer, built where the all-reduce ends. Tensors: CPU, template
    dtypes. ``RoundAverager`` (swarm) and the simulator's in-process group both return it."""

    outcome: Outcome
    """``AVERAGED`` (every member confirmed a complete all-reduce) or ``SKIPPED`` (nothing to apply)."""
    reason: str
    """Why the round was skipped; empty when averaged."""
    epoch: int = 0
    contributors: tuple[str, ...] = ()
    """Peer ids of the members the all-reduce ran over, in the group's order; the tuples below align."""
    weights: tuple[float, ...] = ()
    stale_weights: tuple[float, ...] = ()
    stalenesses: tuple[int, ...] = ()
    refused: tuple[str, ...] = ()
    """Members of the matched group left out, each as "peer id: reason"."""
    rejected: tuple[str, ...] = ()
    """Hostile or unauthorised input rejected at receipt, as "peer id: reason"; those peers are banned."""
    with_stale: bool = False
    """The group's layout carried a stale region (somebody folded late work)."""
    late_consumed: bool = False
    """The averager scaled this peer's late work in place and the all-reduce wrote into it (the swarm's averager
    shares the caller's late-work tensors instead of copying them): whatever the outcome, those tensors no
    longer hold the late work. False where the round failed before that (no group, a refused plan), and
    always in the simulator, which reduces copies."""
    fresh_mean: list[torch.Tensor] | None = None
    """Sum w_i D_i / sum w_i over members carrying fresh work."""
    stale_term: list[torch.Tensor] | None = None
    """Sum s_j E_j / sum w_i over members carrying stale work; ``None`` when nobody in the group did."""
    allreduce_seconds: float = 0.0
    wait_seconds: float = 0.0
    """Time spent finding the group (matchmaking)."""
    due_members: int = 0
    """Peers (this one included) verified due in this round when it began; 0 when none were known."""
    cut_members: int = 0
    """Of those, how many are not in this peer's group (stragglers the window left out)."""
    cut_peers: tuple[str, ...] = ()
    """Their ids (base58), as far as they are known."""
    formed_early: bool = False
    """This peer led the group and formed it before its window ended: every due peer had joined."""
    stepped_back: bool = False
    """This peer was alone when its first window ended and let the next due peer to arrive lead
    (``swarm.quorum.EarlyAssembly``): its wait measured how early it was, not how spread the arrivals were."""
    due_arrival_s: float | None = None
    """This peer led the group: seconds from the start of its search until the last due peer that did come
    joined it (``None`` when it followed, or no due peer joined). In a round that cut due peers this is the
    one arrival sample left: ``core.deadlines`` learns the window from it."""
    left_behind: bool = False
    """The swarm moved past this round's epoch while this peer looked for a group, and the search stopped
    before any group formed (``swarm.commands.GiveUp``): nothing was averaged and nothing of this peer's was
    touched."""
    timed_out: bool = False
    """The all-reduce ran into its deadline (``allreduce_deadline_s``)."""
    window_s: float = 0.0
    """The matchmaking window this round used (``core.deadlines``); 0 where no round ran."""
    allreduce_deadline_s: float = 0.0
    """The all-reduce deadline this round used; 0 where no round ran."""
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def group_size(self) -> int:
        """Members the all-reduce ran over (0 when no group formed)."""
        return len(self.contributors)

    @property
    def averaged(self) -> bool:
        return self.outcome is Outcome.AVERAGED

    def skip(self, reason: str) -> RoundResult:
        """Turn this result into a skipped one (keeps the group's metadata for the report)."""
        self.outcome, self.reason = Outcome.SKIPPED, reason
        self.fresh_mean = self.stale_term = None
        return self


@dataclass
class LateWork:
    """A pseudo-gradient that missed its round, waiting to be folded into a later one."""

    delta: list[torch.Tensor]
    weight: float
    origin_epoch: int


@dataclass
class PendingWork:
    """All of this peer's work that no outer step has applied yet.

    Memory: ``late`` holds one model-sized fp32 copy (CPU) while set; ``carried_weight`` is a number (the work
    itself stays in the model's parameters).
    """

    late: LateWork | None = None
    """A phase's pseudo-gradient kept across a state download, folded into a later round."""
    carried_weight: float | None = None
    """``None``: the next inner phase starts from the anchors. A number: the last round applied nothing and
    the parameters hold unapplied work of this weight; training goes on from them."""

    @property
    def train_on(self) -> bool:
        return self.carried_weight is not None

    def weight_for(self, samples: float) -> float:
        """The weight of this phase's pseudo-gradient: its samples plus any carried work's."""
        return (self.carried_weight or 0.0) + float(samples)

    def carry(self, weight: float) -> None:
        self.carried_weight = weight

    def applied(self) -> None:
        """An outer step (or a state download) replaced the parameters: nothing is carried any more."""
        self.carried_weight = None

    def stash_late(self, delta: list[torch.Tensor], weight: float, origin: int) -> None:
        """Keep ``delta`` as late work; added to older late work (staleness counts from the older one)."""
        if self.late is None:
            self.late = LateWork(delta, weight, origin)
            return
        # Late again before the older late work was folded in (a peer chasing the swarm after an outage):
        # both phases' work goes in together; replacing it would lose the older phase's work.
        logger.info("Adding the work of epoch %d to the late work of epoch %d", origin, self.late.origin_epoch)
        for kept, new in zip(self.late.delta, delta, strict=True):
            kept.add_(new)
        self.late.weight += weight

    def take_late(self) -> LateWork | None:
        """Hand the late work over to the round that folds it (``core.lease.BufferLease.fold``): from here on
        only the round refers to it, and it comes back only if that round left it intact."""
        late, self.late = self.late, None
        return late

    def late_term(self, epoch: int, policy: StalenessPolicy) -> tuple[list[torch.Tensor] | None, float, int]:
        """The late work for round ``epoch`` as (delta, effective weight, staleness); dropped when too old."""
        if self.late is None:
            return None, 0.0, 0
        staleness = max(1, epoch - self.late.origin_epoch)
        factor = policy.factor(staleness)
        if factor == 0.0:
            logger.info("Dropping late work of epoch %d: %d rounds old (max %d)", self.late.origin_epoch,
                        staleness, policy.max_staleness)
            self.late = None
            return None, 0.0, 0
        return self.late.delta, factor * self.late.weight, staleness


@dataclass(frozen=True)
class Observation:
    """What the peer saw of the swarm at the end of an inner phase."""

    epoch: int
    """This peer's epoch (its anchors are θ(epoch))."""
    swarm_epoch: int | None
    """The largest epoch a live, non-client peer of this run and model publishes; None when none does."""
    peers_visible: int
    """Live peers of this run and model, this one included."""
    unseen_s: float | None = None
    """Seconds since another peer was last visible; None when none ever was."""
    minority: bool | None = None
    """A strict majority published another checksum for ``epoch``; None when not asked
    (see :meth:`RoundPolicy.wants_checksum_vote`)."""


class Action(enum.Enum):
    """What the session (or the simulator) does next."""

    RESYNC = "resync"
    """Download the swarm's state of ``Decision.min_epoch`` or newer; this phase's work becomes late work."""
    SOLO = "solo"
    """Apply our own pseudo-gradient (and late work) alone."""
    AVERAGE = "average"
    """Join the all-reduce of this epoch and wait for it."""
    EAGER = "eager"
    """Collect the previous background all-reduce, take the eager step, launch this epoch's."""
    APPLY = "apply"
    """Apply the complete all-reduce."""
    CARRY = "carry"
    """Apply nothing; train on from the local parameters, carrying the work into the next round."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    min_epoch: int = 0
    """For ``RESYNC``: the oldest state epoch worth downloading."""


@dataclass(frozen=True)
class RoundPolicy:
    """The round's decisions from observations alone; see the module docstring.

    Args:
        staleness: how late work is discounted and when it is dropped.
        solo_after_s: how long a peer that saw others carries its work before stepping alone.
        eager: the all-reduce overlaps the next inner phase (``--overlap eager``).
    """

    staleness: StalenessPolicy = field(default_factory=StalenessPolicy)
    solo_after_s: float = 0.0
    eager: bool = False

    def _behind(self, seen: Observation) -> bool:
        # Eager peers step without waiting for each other: one epoch ahead is normal there.
        slack = 1 if self.eager else 0
        return seen.swarm_epoch is not None and seen.swarm_epoch > seen.epoch + slack

    def wants_checksum_vote(self, seen: Observation) -> bool:
        """Whether :meth:`decide` needs ``seen.minority``. Eager peers differ by their own terms by design,
        so they never vote; a peer already behind resyncs anyway."""
        return not self.eager and not self._behind(seen)

    def may_go_solo(self, seen: Observation) -> bool:
        if seen.peers_visible > 1:
            return False
        if seen.unseen_s is None or seen.unseen_s >= self.solo_after_s:
            return True
        logger.info("No other peer visible for %.0f s; carrying our work for up to %.0f s before going on alone",
                    seen.unseen_s, self.solo_after_s)
        return False

    def decide(self, seen: Observation) -> Decision:
        """The round's first decision, at the end of the inner phase."""
        if self._behind(seen):
            return Decision(Action.RESYNC, f"swarm is at epoch {seen.swarm_epoch}, we are at {seen.epoch}",
                            min_epoch=seen.swarm_epoch or 0)
        if seen.minority:
            return Decision(Action.RESYNC, f"our parameters differ from the majority checksum of epoch "
                                           f"{seen.epoch}", min_epoch=seen.epoch)
        if self.may_go_solo(seen):
            return Decision(Action.SOLO, "no other peer visible: applied our own pseudo-gradient")
        return Decision(Action.EAGER if self.eager else Action.AVERAGE)

    def after_allreduce(self, epoch: int, result: RoundResult, swarm_epoch: int | None) -> Decision:
        """The decision once the blocking all-reduce returned. ``swarm_epoch`` is read after it ended."""
        if result.averaged:
            return Decision(Action.APPLY)
        if swarm_epoch is not None and swarm_epoch > epoch:
            # The others completed the round without us: our work becomes late work.
            return Decision(Action.RESYNC, result.reason, min_epoch=swarm_epoch)
        # Nobody advanced: keep training from the local parameters, so no work is lost.
        return Decision(Action.CARRY, result.reason)


@dataclass
class RoundReport:
    """What one round did, built by the round driver where the round ends; one JSON line of the run log."""

    epoch: int
    outcome: Outcome = Outcome.SKIPPED
    reason: str = ""
    fragment: int = 0
    """Streaming DiLoCo (``core.fragments``): the fragment this round synchronised; ``epoch`` is that fragment's.
    Always 0 without fragments (the whole model is fragment 0)."""
    group_size: int = 0
    contributors: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    inner_steps: int = 0
    inner_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    wait_seconds: float = 0.0
    """How long this round's matchmaking took (at most the ``matchmaking_time_s`` window when leading,
    less once every due peer joined)."""
    due_members: int = 0
    """Peers verified due in the round (signed, unexpired progress records of its epoch), this one included."""
    cut_members: int = 0
    """Due peers the round's group left out."""
    formed_early: bool = False
    """This peer led the group and formed it before the window ended, every due peer having joined."""
    stepped_back: bool = False
    """This peer arrived early, alone when its window ended, and followed the next due peer instead of leading."""
    window_s: float = 0.0
    """The matchmaking window the round used, learned from arrivals within ``--matchmaking-time-s``."""
    allreduce_deadline_s: float = 0.0
    """The all-reduce deadline the round used, learned from past all-reduces within
    ``--allreduce-timeout-s``."""
    bytes_sent: int = 0
    bytes_received: int = 0
    train_loss: float = float("nan")
    params_sha256: str = ""
    new_epoch: int = 0
    late_folded: int = 0
    """How many late contributions (any member's) this round applied."""
    rejected: list[str] = field(default_factory=list)
    """Hostile or unauthorised input rejected at receipt, as "peer id: reason"; those peers are banned."""
    stall: Stall = Stall.NONE
    """After a skipped round: why no round of this swarm can average, when the peer can tell (``swarm.reach``)."""
    rejected_records: dict[str, int] = field(default_factory=dict)
    """DHT records dropped since the last round, by kind (``swarm.signing``); ``record_bans`` lists the
    writers banned for a record they signed, as "peer id: reason"."""
    record_bans: list[str] = field(default_factory=list)
    blocked_seconds: float = 0.0
    """How long training waited for the network this round (the whole all-reduce when blocking; with eager
    overlap only the wait for the previous round's background all-reduce)."""
    overhead_seconds: float = 0.0
    """Seconds the round spent on this peer outside the inner steps and the network: pseudo-gradient, outer
    step, hashing, waiting for a checkpoint write (what grows with the model and nothing else)."""

    def __post_init__(self) -> None:
        self.outcome = Outcome(self.outcome)  # also from its value, e.g. a JSON line read back

    def absorb(self, result: RoundResult, *, rejected: bool = True) -> None:
        """Take the all-reduce's metadata (group, weights, timings, bytes) from ``result``."""
        self.group_size, self.contributors = result.group_size, list(result.contributors)
        self.weights = [w + s for w, s in zip(result.weights, result.stale_weights, strict=True)]
        self.staleness = list(result.stalenesses)
        self.allreduce_seconds, self.wait_seconds = result.allreduce_seconds, result.wait_seconds
        self.due_members, self.cut_members = result.due_members, result.cut_members
        self.formed_early, self.stepped_back = result.formed_early, result.stepped_back
        self.window_s, self.allreduce_deadline_s = result.window_s, result.allreduce_deadline_s
        self.bytes_sent, self.bytes_received = result.bytes_sent, result.bytes_received
        if rejected:
            self.rejected = list(result.rejected)

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["outcome"] = self.outcome.value
        return out


def late_folded(stalenesses: Sequence[int]) -> int:
    return sum(1 for s in stalenesses if s > 0)
