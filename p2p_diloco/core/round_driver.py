"""Executes the round policy (:mod:`p2p_diloco.core.rounds`) against a :class:`RoundPort`.

The port is the world one peer talks to: the real swarm (``peer.session.SwarmSession``) or the simulator's
in-process group (``simulate.policy``). The driver owns the peer's :class:`PendingWork` and changes only
the :class:`OuterState` and the model's parameters; everything network-bound goes through the port::

    driver = RoundDriver(state, params, RoundPolicy(...), port, peer_id)
    driver.begin()                      # params = anchors, unless the last round carried its work
    ... inner steps on params ...
    report = driver.end(samples, RoundReport(epoch=state.epoch, ...), inner_seconds)

With ``--overlap eager`` (see :mod:`p2p_diloco.core.eager`) the all-reduce of epoch ``e`` runs in the background
during the next inner phase; the outer step uses the complete average of epoch ``e - 1`` (outcome
``averaged``) or, when that one was late, failed or partial, the own term only (outcome ``own_only``). A
state download or a solo round resets the eager state.

A fragment of Streaming DiLoCo with ``--fragment-delay`` τ > 0 (:mod:`p2p_diloco.core.fragments`) runs a round in
three parts, so that its all-reduce overlaps the next τ inner steps::

    flight = driver.open(samples, report, inner_seconds, delta)   # at the sync step: the work and its buffers
    driver.exchange(flight)             # the decision and the all-reduce: any thread, while training goes on
    report = driver.land(flight)        # at the merge step, on the training thread: the outer step, or not

:meth:`RoundDriver.end` is the three at once. The division is by what each part touches: ``exchange`` reads the
swarm and the port's verdicts and sends this round's buffers, and changes neither the outer state nor the
parameters; ``land`` alone changes them (outer step and α-merge, a catch-up, a solo step), so a round's outcome
is applied only once it is complete, on the thread that trains, and never half.

A blocking round's buffers come from the port as a :class:`~p2p_diloco.core.lease.BufferLease` (the swarm's
shared averaging buffer) or are the driver's own; the driver moves the lease through its states (Δ writable,
in flight, mean readable, served, released) and the port touches the buffers only through it. The round that
folds late work takes it over from :class:`PendingWork` and gives it back only when it left it intact.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from p2p_diloco.core.delayed import Contribution, RoundAggregate, aggregate_round, summarize_round
from p2p_diloco.core.lease import BufferLease, LeaseError
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.pseudograd import pseudo_gradient
from p2p_diloco.core.rounds import (
    Action,
    Decision,
    Observation,
    Outcome,
    PendingWork,
    RoundPolicy,
    RoundReport,
    RoundResult,
    late_folded,
)

logger = logging.getLogger(__name__)


@dataclass
class Collected:
    """What an eager peer found for the background all-reduce of the previous round."""

    result: RoundResult | None
    """The complete round's result, or None when there is nothing to apply."""
    reason: str
    """Why there is nothing to apply (empty when ``result`` is set)."""
    waited_s: float
    """How long the caller was blocked waiting for it."""
    folded_stale: bool = False
    """The round carried this peer's late work, and it went in."""


@dataclass
class InFlight:
    """One round between :meth:`RoundDriver.open` and :meth:`RoundDriver.land` (module docstring): owned by the
    driver, filled by ``exchange``, spent by ``land``."""

    report: RoundReport
    weight: float
    """The round's fresh weight (samples plus any carried work)."""
    lease: BufferLease
    inner_seconds: float
    given: bool
    """The pseudo-gradient was taken by the caller (Streaming DiLoCo): its buffers are released after landing."""
    decision: Decision | None = None
    """The policy's first decision (``None`` until ``exchange`` ran)."""
    peers_visible: int = 0
    stale: list[torch.Tensor] | None = None
    """Late work this round folds (its delta), if any."""
    result: RoundResult | None = None
    """The all-reduce's result (``Action.AVERAGE``)."""
    after: Decision | None = None
    """The policy's decision once the all-reduce returned."""
    exchange_s: float = 0.0
    """Seconds ``exchange`` took (what a blocking round waits)."""
    landed: bool = False


class RoundPort(Protocol):
    """The world a round talks to. Every method is bounded in time and never raises for network trouble."""

    def observe(self, epoch: int) -> Observation:
        """The swarm's epoch, the peers visible and the solo timer (``minority`` left None)."""

    def in_minority(self, epoch: int) -> bool:
        """A strict majority published another checksum for ``epoch`` than our anchors'."""

    def swarm_epoch(self) -> int | None:
        """The swarm's epoch now (read again after a failed all-reduce)."""

    def averaging(self, epoch: int) -> None:
        """About to average (status for listeners)."""

    def before_allreduce(self) -> None:
        """Right before this peer's work is sent (fault injection point)."""

    def average(self, lease: BufferLease, weight: float, staleness: int, epoch: int,
                stale_weight: float) -> RoundResult:
        """One blocking all-reduce of epoch ``epoch`` over ``lease.in_flight()``: the fresh work and any late work
        the round folds (``staleness`` old, of weight ``stale_weight``). ``RoundResult.late_consumed``: the
        round wrote into the late work."""

    def resync(self, min_epoch: int) -> bool:
        """Download and load the swarm's verified state of ``min_epoch`` or newer into the outer state and
        the parameters; False (nothing changed) when no donor answered."""

    def published(self, epoch: int, update: RoundAggregate | None = None) -> None:
        """The anchors of ``epoch`` are new: serve them (and publish their checksum where peers vote).
        ``update``: the swarm round's aggregate that led here, whose tensors stay untouched until the next
        lease is released: a port may serve it to joiners one round behind."""

    def collect(self, epoch: int, timeout: float) -> Collected:
        """Eager only: the background all-reduce of ``epoch``, waiting at most ``timeout`` s."""

    def launch(self, delta: Sequence[torch.Tensor], weight: float, staleness: int, epoch: int,
               stale: Sequence[torch.Tensor] | None, stale_weight: float) -> bool:
        """Eager only: start the all-reduce of ``epoch`` in the background; False if the last one still runs."""

    def discard(self, why: str) -> None:
        """Eager only: forget the background round's result (it belongs to a state we left)."""

    def lease(self) -> BufferLease | None:
        """A lease over the buffers to write this round's pseudo-gradient into so that :meth:`average` sends it
        without a copy (the swarm's shared averaging buffer, ``shared=True``), or None for buffers of the
        driver's own. The driver releases the previous round's lease before it asks for the next."""

    def withdraw(self) -> None:
        """The anchors are about to change: stop serving them (and let a checkpoint being written from them
        finish first)."""


def own_share(result: RoundResult, peer_id: str) -> float:
    """This peer's weight fraction in ``result``'s fresh mean (the eager rule's own-term factor)."""
    index = result.contributors.index(peer_id)
    total = sum(result.weights)
    return result.weights[index] / total if total > 0 else 1.0 / max(1, result.group_size)


def group_average(result: RoundResult) -> list[torch.Tensor]:
    """The round's full aggregate Δ(t-1): the fresh mean plus any folded late work's term."""
    if result.stale_term is None:
        return list(result.fresh_mean or [])
    return [f + s for f, s in zip(result.fresh_mean or [], result.stale_term, strict=True)]


class RoundDriver:
    """Turns an inner phase into an outer step by the policy's decisions; see the module docstring.

    Args:
        state: this peer's anchors, outer optimizer and epoch.
        params: the model's live parameters; written in place.
        policy: the round policy.
        port: the swarm or the simulator.
        peer_id: this peer's id as the port's results name it.
        matchmaking_time_s: an eager peer waits at least this long for the previous round.
        merge_alpha: α of Streaming DiLoCo's merge (``core.fragments``): an applied outer step leaves the
            parameters at α·local + (1 − α)·anchors; 0 (plain DiLoCo) sets them to the anchors.
    """

    def __init__(self, state: OuterState, params: Sequence[torch.Tensor], policy: RoundPolicy, port: RoundPort,
                 peer_id: str, matchmaking_time_s: float = 0.0, merge_alpha: float = 0.0) -> None:
        self.state, self.params, self.policy, self.port = state, list(params), policy, port
        self.peer_id = peer_id
        self.matchmaking_time_s = matchmaking_time_s
        self.pending = PendingWork()
        self.merge_alpha = merge_alpha
        self.lease: BufferLease | None = None
        """The last round's buffers, until the next round takes a lease (a served update lives there)."""

    def begin(self) -> None:
        """Start the inner phase from the anchors (unless the last round carried its work: then train on)."""
        if not self.pending.train_on:
            self.state.begin(self.params)

    def new_state(self) -> None:
        """The outer state was replaced (a download): nothing carried, no eager history, no background round."""
        self.pending.applied()
        self.state.eager.reset()
        if self.policy.eager:
            self.port.discard("this peer downloaded a new state since")

    def restart(self) -> None:
        """This peer's process died and came back (the simulator's dropped worker): the work of the round, carried
        work and late work died with it. Load the swarm's newest state, or start again from the own anchors."""
        self.pending = PendingWork()
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self.port.resync(0):
            self.new_state()
        else:
            self.state.begin(self.params)

    def end(self, samples: float, report: RoundReport, inner_seconds: float,
            delta: list[torch.Tensor] | None = None) -> RoundReport:
        """Run the round's decisions; fills ``report`` (outcome, group, timings, new epoch) and returns it.

        ``delta``: the pseudo-gradient taken earlier (Streaming DiLoCo takes it at the fragment's sync step and
        ends the round τ steps later, ``core.fragments``); by default it is taken now. The same as
        :meth:`open`, :meth:`exchange` and :meth:`land` in a row."""
        flight = self.open(samples, report, inner_seconds, delta)
        self.exchange(flight)
        return self.land(flight)

    def open(self, samples: float, report: RoundReport, inner_seconds: float,
             delta: list[torch.Tensor] | None = None) -> InFlight:
        """Begin a round over ``samples`` of work (the module docstring): its weight and its buffers, holding
        ``delta`` or the pseudo-gradient taken now. Changes nothing else."""
        weight = self.pending.weight_for(samples)
        lease = self._take_lease(delta)
        return InFlight(report, weight, lease, inner_seconds, given=delta is not None)

    def exchange(self, flight: InFlight) -> None:
        """The round's decision and, when it is to average, its all-reduce: bounded in time, never raises, and
        changes neither the outer state nor the parameters (the late work it folds is the round's from here on).
        May run on another thread than the one that trains, between :meth:`open` and :meth:`land`."""
        try:
            epoch = self.state.epoch
            seen = self.port.observe(epoch)
            if self.policy.wants_checksum_vote(seen):
                seen = dataclasses.replace(seen, minority=self.port.in_minority(epoch))
            flight.peers_visible = seen.peers_visible
            flight.decision = self.policy.decide(seen)
            if flight.decision.action is Action.AVERAGE:
                started = time.monotonic()
                self._allreduce(flight)
                flight.exchange_s = time.monotonic() - started
        except LeaseError:
            raise  # a buffer used out of turn: a bug here, not trouble on the network
        except Exception as e:  # noqa: BLE001 - a port broke its contract: the round is carried, never applied
            logger.warning("The round of epoch %d failed before its outcome: %r", self.state.epoch, e)
            flight.decision, flight.result, flight.after = Decision(Action.CARRY, f"the round raised {e!r}"), None, None

    def land(self, flight: InFlight) -> RoundReport:
        """Act on what :meth:`exchange` found, on the training thread: the outer step and merge, a catch-up, a solo
        step, or the work carried. Fills and returns the round's report."""
        if flight.landed:
            raise RuntimeError("this round has landed already")
        flight.landed = True
        report, lease, weight = flight.report, flight.lease, flight.weight
        decision = flight.decision or Decision(Action.CARRY, "the round's exchange did not run")
        if decision.action is Action.RESYNC:
            report.outcome, report.reason = self._catch_up(lease, weight, decision.min_epoch), decision.reason
        elif decision.action is Action.SOLO:
            self._solo(lease.delta(), weight, report, decision.reason)
        elif decision.action is Action.EAGER:
            self._eager(lease.delta(), weight, report, flight.inner_seconds, flight.peers_visible)
        elif decision.action is Action.AVERAGE:
            started = time.monotonic()
            self._land_average(flight)
            report.blocked_seconds = flight.exchange_s + time.monotonic() - started
        else:
            self.pending.carry(weight)
            report.outcome, report.reason = Outcome.SKIPPED, decision.reason
        report.new_epoch = self.state.epoch
        if flight.given and self.lease is lease:
            # Taken earlier by the caller (Streaming DiLoCo): these buffers serve nothing after the round (the
            # update served to joiners lives in a port's lease), so they are not kept until this driver's next
            # round; F fragments' drivers keeping theirs would hold a whole model's worth (4 bytes per parameter,
            # measured at 150m) for the run.
            self.lease.release()
            self.lease = None
        return report

    def _take_lease(self, delta: list[torch.Tensor] | None) -> BufferLease:
        """This round's buffers, holding its pseudo-gradient: the last round's lease is released first (the
        port stops serving its update from them), then the port's shared buffers are written in place (no copy
        on the way to the all-reduce), or new tensors are the driver's own (eager rounds: the state's reused
        buffer may still be referenced by the overlap; or ``delta`` was taken earlier)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if delta is not None:
            self.lease = BufferLease(delta)
            return self.lease
        lease = None if self.policy.eager else self.port.lease()
        if lease is not None:
            self.state.pseudo_gradient(self.params, out=lease.delta())
        else:
            lease = BufferLease(pseudo_gradient(self.state.anchors, self.params))
        self.lease = lease
        return lease

    # ------------------------------------------------------------------ actions

    def _allreduce(self, flight: InFlight) -> None:
        """``exchange``'s all-reduce: send the lease's work (and any late work, handed over to the round) and take
        the policy's decision on the result. Touches the driver's pending late work, never the outer state."""
        epoch, lease = self.state.epoch, flight.lease
        flight.stale, stale_weight, staleness = self.pending.late_term(epoch, self.policy.staleness)
        late = self.pending.take_late() if flight.stale is not None else None
        if late is not None:
            lease.fold(late)  # the round owns it now: the averager process may scale it in place
        self.port.averaging(epoch)
        self.port.before_allreduce()
        lease.send()
        result = flight.result = self.port.average(lease, flight.weight, staleness, epoch, stale_weight)
        back = lease.returned(result.averaged, late_intact=not result.late_consumed)
        if back is not None:
            self.pending.late = back  # the round failed before it touched the late work
        elif late is not None and not result.averaged:
            # The round failed after the averager had scaled the late work and the all-reduce had written part
            # of the group's values into it, in place: what is left is neither our work nor the group's.
            # Carrying it into the next fold (or adding a resync's work to it) would apply a corrupted update;
            # it stays with the spent round, and one phase of late work is lost.
            logger.warning("Dropping the late work of epoch %d: the round that folded it failed midway (%s)",
                           late.origin_epoch, result.reason)
        swarm_epoch = None if result.averaged else self.port.swarm_epoch()
        flight.after = self.policy.after_allreduce(epoch, result, swarm_epoch)

    def _land_average(self, flight: InFlight) -> None:
        """``land`` for a round that averaged (or tried to): apply the group's mean, carry, or catch up."""
        report, lease, result, after = flight.report, flight.lease, flight.result, flight.after
        if result is None or after is None:
            raise RuntimeError("a round to average landed before its exchange")
        report.reason = result.reason
        report.absorb(result)
        if after.action is Action.RESYNC:
            report.outcome = self._catch_up(lease, flight.weight, after.min_epoch)
            return
        if after.action is Action.CARRY:
            self.pending.carry(flight.weight)
            report.outcome = Outcome.SKIPPED
            return
        stats = summarize_round([w or s for w, s in zip(result.weights, result.stale_weights, strict=True)],
                                list(result.stalenesses), self.policy.staleness, list(result.contributors))
        # The swarm's mean is a view of the lease's buffers (READABLE now, SERVED once applied, until released).
        self._apply(RoundAggregate(result.fresh_mean, result.stale_term, stats), from_swarm=True, lease=lease)
        report.late_folded = late_folded(result.stalenesses)
        report.outcome = Outcome.FOLDED_LATE if flight.stale is not None else Outcome.AVERAGED

    def _solo(self, delta: list[torch.Tensor], weight: float, report: RoundReport, reason: str) -> None:
        stale, stale_weight, staleness = self.pending.late_term(self.state.epoch, self.policy.staleness)
        contributions = [Contribution(delta, weight, 0, self.peer_id)]
        if stale is not None:
            contributions.append(Contribution(stale, stale_weight, staleness, self.peer_id))
        self._apply(aggregate_round(contributions, self.policy.staleness))
        report.group_size, report.contributors = 1, [self.peer_id]
        report.weights, report.staleness = [c.weight for c in contributions], [c.staleness for c in contributions]
        report.outcome = Outcome.FOLDED_LATE if stale is not None else Outcome.AVERAGED
        report.reason = reason
        report.late_folded = int(stale is not None)
        self.pending.late = None
        if self.policy.eager:
            # Any background round belongs to the group we no longer average with.
            self.port.discard("this peer applied a solo round since")
            self.state.eager.reset()

    def _eager(self, delta: list[torch.Tensor], weight: float, report: RoundReport, inner_seconds: float,
               peers_visible: int) -> None:
        epoch = self.state.epoch
        self.port.averaging(epoch)
        # Wait for the previous round at most one inner phase, and never less than the matchmaking window:
        # its group forms once every due peer joined, but waits up to that window for a straggler.
        got = self.port.collect(epoch - 1, max(inner_seconds, self.matchmaking_time_s))
        report.blocked_seconds = got.waited_s
        if got.folded_stale:
            self.pending.late = None
        self.port.before_allreduce()
        stale, stale_weight, staleness = self.pending.late_term(epoch, self.policy.staleness)
        result = got.result
        share = own_share(result, self.peer_id) if result is not None else 0.0
        self.port.withdraw()
        if result is not None and self.state.eager.has_previous and share > 0.0:
            self.state.apply_eager(delta, group_average(result), result.group_size, self.params, own_share=share)
            report.outcome = Outcome.FOLDED_LATE if got.folded_stale else Outcome.AVERAGED
            report.absorb(result, rejected=False)
            report.late_folded = late_folded(result.stalenesses)
        else:
            # Δ(t-1) unknown: the eager rule with Δ(t-1) = 0, i.e. this peer's own share of its fresh work.
            self.state.apply_eager(delta, None, max(1, peers_visible), self.params)
            report.outcome = Outcome.OWN_ONLY
            report.reason = got.reason if result is None else "no own term stored for the previous round"
        self.pending.applied()
        self.port.published(self.state.epoch)
        # Launch last: serving the new state talks to the averager process over the same pipe as the round's
        # start, and a multiprocessing pipe must not be written from two threads at once.
        if not self.port.launch(delta, weight, staleness, epoch, stale, stale_weight):
            report.reason = (report.reason + "; " if report.reason else "") + (
                f"the work of epoch {epoch} was not sent: the previous all-reduce still runs")

    def _apply(self, aggregate: RoundAggregate, from_swarm: bool = False, lease: BufferLease | None = None) -> None:
        """The outer step; ``from_swarm``: the aggregate is the swarm round's, every member applies the same
        one, so the port may serve it (a joiner one round behind applies it instead of downloading again) until
        the round's ``lease`` is released."""
        self.port.withdraw()
        self.state.apply(aggregate, self.params, keep_local=self.merge_alpha)
        self.pending.applied()
        if from_swarm and lease is not None:
            lease.serve()
        self.port.published(self.state.epoch, aggregate if from_swarm else None)

    def _catch_up(self, lease: BufferLease, weight: float, min_epoch: int) -> Outcome:
        """Load the swarm's state and keep this round's work as late work; ``SKIPPED`` if no donor answered.

        Without a donor (a partition, every donor busy) nothing is stashed: the peer trains on from its own
        parameters, so the next pseudo-gradient covers this round too and a long outage loses no work.
        Stashing first would restart every round from the old anchors and keep only the last one's work.
        """
        origin = self.state.epoch
        # Anchors minus params again rather than ``delta``: delta may live in the averager's buffer, which a
        # failed all-reduce overwrote; the parameters still hold this phase's (and any carried) work. It goes
        # into that idle buffer while the download runs (the downloaded state does not meet a fourth
        # model-sized tensor there), and is copied out once the state is loaded.
        late = (self.state.pseudo_gradient(self.params, out=lease.delta()) if lease.shared
                else pseudo_gradient(self.state.anchors, self.params))
        if not self.port.resync(min_epoch):
            self.pending.carry(weight)
            return Outcome.SKIPPED
        self.new_state()
        self.pending.stash_late([t.clone() for t in late] if lease.shared else late, weight, origin)
        return Outcome.RESYNCED

