"""The round policy and its driver, every branch, against a scripted fake port (no network, no processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from p2p_diloco.core.delayed import StalenessPolicy
from p2p_diloco.core.lease import BufferLease
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.round_driver import Collected, RoundDriver
from p2p_diloco.core.rounds import (
    Action,
    Observation,
    Outcome,
    PendingWork,
    RoundPolicy,
    RoundReport,
    RoundResult,
)

ME = "me"


# ------------------------------------------------------------------ the pure policy


def seen(epoch: int = 3, swarm: int | None = 3, peers: int = 3, unseen: float | None = 0.0,
         minority: bool | None = False) -> Observation:
    return Observation(epoch, swarm, peers, unseen_s=unseen, minority=minority)


def test_behind_resyncs_to_the_swarms_epoch_and_skips_the_vote() -> None:
    policy = RoundPolicy()
    decision = policy.decide(seen(swarm=5))
    assert decision.action is Action.RESYNC and decision.min_epoch == 5 and "epoch 5" in decision.reason
    assert not policy.wants_checksum_vote(seen(swarm=5))
    assert policy.wants_checksum_vote(seen(swarm=3))


def test_eager_peers_tolerate_one_epoch_ahead_and_never_vote() -> None:
    policy = RoundPolicy(eager=True)
    assert policy.decide(seen(swarm=4)).action is Action.EAGER
    assert policy.decide(seen(swarm=5)).action is Action.RESYNC
    assert not policy.wants_checksum_vote(seen())


def test_minority_resyncs_to_our_own_epoch() -> None:
    decision = RoundPolicy().decide(seen(minority=True))
    assert decision.action is Action.RESYNC and decision.min_epoch == 3 and "checksum" in decision.reason


@pytest.mark.parametrize("unseen, action", [(None, Action.SOLO), (10.0, Action.AVERAGE), (60.0, Action.SOLO)])
def test_solo_only_alone_and_after_the_solo_timer(unseen: float | None, action: Action) -> None:
    policy = RoundPolicy(solo_after_s=30.0)
    assert policy.decide(seen(peers=1, unseen=unseen)).action is action
    assert policy.decide(seen(peers=2, unseen=unseen)).action is Action.AVERAGE


def test_after_allreduce_applies_resyncs_or_carries() -> None:
    policy = RoundPolicy()
    done = RoundResult(Outcome.AVERAGED, "", 3)
    failed = RoundResult(Outcome.SKIPPED, "no group formed", 3)
    assert policy.after_allreduce(3, done, None).action is Action.APPLY
    again = policy.after_allreduce(3, failed, 4)
    assert again.action is Action.RESYNC and again.min_epoch == 4
    for swarm in (None, 3):
        carry = policy.after_allreduce(3, failed, swarm)
        assert carry.action is Action.CARRY and carry.reason == "no group formed"


def test_pending_work_merges_late_work_and_drops_it_when_too_old() -> None:
    policy = StalenessPolicy(staleness_decay=0.5, max_staleness=2)
    pending = PendingWork()
    assert pending.late_term(5, policy) == (None, 0.0, 0) and pending.weight_for(4) == 4.0
    pending.stash_late([torch.ones(2)], 4.0, origin=3)
    pending.stash_late([torch.ones(2)], 2.0, origin=4)
    delta, weight, staleness = pending.late_term(5, policy)
    assert staleness == 2 and weight == pytest.approx(6.0 * policy.factor(2)) and delta[0].tolist() == [2.0, 2.0]
    assert pending.late_term(6, policy) == (None, 0.0, 0) and pending.late is None
    pending.carry(7.0)
    assert pending.train_on and pending.weight_for(3) == 10.0
    pending.applied()
    assert not pending.train_on


def test_outcome_reads_as_its_value() -> None:
    assert f"{Outcome.FOLDED_LATE}" == "folded_late" and str(Outcome.OWN_ONLY) == "own_only"
    assert {o for o in Outcome if o.synced} == {Outcome.AVERAGED, Outcome.FOLDED_LATE, Outcome.RESYNCED}
    assert RoundReport(epoch=1, outcome=Outcome.RESYNCED).as_dict()["outcome"] == "resynced"


# ------------------------------------------------------------------ the driver against a fake port


@dataclass
class FakePort:
    """Scripted answers; records what the driver asked for."""

    swarm: int | None = None
    peers: int = 3
    minority: bool = False
    results: list[RoundResult] = field(default_factory=list)
    swarm_after: int | None = None
    donor: tuple[list[torch.Tensor], int] | None = None
    collected: Collected | None = None
    state: OuterState | None = None
    params: list[torch.Tensor] = field(default_factory=list)
    calls: list[tuple] = field(default_factory=list)
    buffers: list[torch.Tensor] | None = None
    """What ``delta_buffers`` offers (the swarm's shared averaging buffer); None: the driver's own."""
    garble: bool = False
    """A failed all-reduce that leaves garbage in the offered buffer."""
    shares_late: bool = False
    """Like the swarm's averager: a round whose group formed scales the late work in place and writes the
    group's values into it (``RoundResult.late_consumed``)."""
    sent: list = field(default_factory=list)

    def observe(self, epoch: int) -> Observation:
        return Observation(epoch, self.swarm, self.peers, unseen_s=0.0)

    def in_minority(self, epoch: int) -> bool:
        self.calls.append(("vote", epoch))
        return self.minority

    def swarm_epoch(self) -> int | None:
        return self.swarm_after

    def averaging(self, epoch: int) -> None:
        pass

    def before_allreduce(self) -> None:
        self.calls.append(("before_allreduce",))

    def average(self, lease, weight, staleness, epoch, stale_weight) -> RoundResult:
        delta, stale = lease.in_flight()
        self.calls.append(("average", epoch, weight, staleness, None if stale is None else stale[0].clone(),
                           stale_weight))
        self.sent.append(delta)
        if self.garble and self.buffers is not None:
            self.buffers[0].fill_(123.0)
        result = self.results.pop(0)
        if self.shares_late and stale is not None and result.late_consumed:
            for t in stale:
                t.mul_(0.5).add_(77.0)  # scaled, then partly the group's values: neither ours nor theirs
        return result

    def resync(self, min_epoch: int) -> bool:
        self.calls.append(("resync", min_epoch))
        if self.donor is None:
            return False
        tensors, epoch = self.donor
        self.state.load_state_tensors({f"param.{i}": t.clone() for i, t in enumerate(tensors)}, epoch)
        self.state.begin(self.params)
        return True

    def published(self, epoch: int, update: object = None) -> None:
        self.calls.append(("published", epoch))

    def collect(self, epoch: int, timeout: float) -> Collected:
        self.calls.append(("collect", epoch))
        return self.collected or Collected(None, "nothing launched", 0.0)

    def launch(self, delta, weight, staleness, epoch, stale, stale_weight) -> bool:
        self.calls.append(("launch", epoch, weight))
        return True

    def discard(self, why: str) -> None:
        self.calls.append(("discard", why))

    def lease(self) -> BufferLease | None:
        return None if self.buffers is None else BufferLease(self.buffers, shared=True)

    def withdraw(self) -> None:
        self.calls.append(("withdraw",))


def make(port: FakePort, *, eager: bool = False, solo_after_s: float = 0.0) -> tuple[RoundDriver, list[torch.Tensor]]:
    params = [torch.zeros(4)]
    # Plain SGD with lr 1: the outer step subtracts the averaged pseudo-gradient exactly.
    state = OuterState(params, lr=1.0, momentum=0.0)
    port.state, port.params = state, params
    policy = RoundPolicy(StalenessPolicy(staleness_decay=1.0, max_staleness=4), solo_after_s, eager)
    return RoundDriver(state, params, policy, port, ME), params


def last_average(port: FakePort) -> tuple:
    return [c for c in port.calls if c[0] == "average"][-1]


def train(driver: RoundDriver, params: list[torch.Tensor], step: float) -> None:
    driver.begin()
    params[0].add_(step)  # the "inner phase": delta = anchors - params = -step


def averaged(epoch: int, fresh: float, weights=(4.0, 4.0), stale_term: float | None = None,
             stalenesses=(0, 0)) -> RoundResult:
    return RoundResult(Outcome.AVERAGED, "", epoch, contributors=(ME, "other"), weights=weights,
                       stale_weights=(0.0, 0.0), stalenesses=stalenesses, fresh_mean=[torch.full((4,), fresh)],
                       stale_term=None if stale_term is None else [torch.full((4,), stale_term)],
                       with_stale=stale_term is not None)


def test_a_complete_allreduce_is_applied_and_published() -> None:
    port = FakePort(swarm=0, results=[averaged(0, -2.0)])
    driver, params = make(port)
    train(driver, params, 1.0)
    report = driver.end(4, RoundReport(epoch=0), 1.0)
    assert report.outcome is Outcome.AVERAGED and report.new_epoch == 1 and report.group_size == 2
    assert params[0].tolist() == [2.0] * 4 and driver.state.epoch == 1
    assert ("vote", 0) in port.calls and ("published", 1) in port.calls
    assert port.calls.index(("before_allreduce",)) < [c[0] for c in port.calls].index("average")


def test_a_failed_round_nobody_finished_carries_the_work_into_the_next() -> None:
    port = FakePort(swarm=0, results=[RoundResult(Outcome.SKIPPED, "no group formed", 0), averaged(0, -2.0)])
    driver, params = make(port)
    train(driver, params, 1.0)
    report = driver.end(4, RoundReport(epoch=0), 1.0)
    assert report.outcome is Outcome.SKIPPED and report.reason == "no group formed" and driver.state.epoch == 0
    assert driver.pending.train_on and driver.pending.carried_weight == 4.0
    train(driver, params, 1.0)  # trains on: the params keep the first phase's work
    assert params[0].tolist() == [2.0] * 4
    report = driver.end(4, RoundReport(epoch=0), 1.0)
    assert report.outcome is Outcome.AVERAGED and last_average(port)[2] == 8.0  # weight: both phases
    assert not driver.pending.train_on


def test_a_round_the_others_finished_resyncs_and_folds_our_work_late() -> None:
    donor = ([torch.full((4,), 5.0)], 1)
    port = FakePort(swarm=0, swarm_after=1, donor=donor,
                    results=[RoundResult(Outcome.SKIPPED, "partial all-reduce", 0),
                             averaged(1, -1.0, stale_term=-0.5, stalenesses=(0, 1))])
    driver, params = make(port)
    train(driver, params, 1.0)
    report = driver.end(4, RoundReport(epoch=0), 1.0)
    assert report.outcome is Outcome.RESYNCED and driver.state.epoch == 1 and params[0].tolist() == [5.0] * 4
    assert driver.pending.late is not None and driver.pending.late.origin_epoch == 0
    port.swarm = 1
    train(driver, params, 1.0)
    report = driver.end(4, RoundReport(epoch=1), 1.0)
    _, epoch, weight, staleness, stale, stale_weight = last_average(port)
    assert (epoch, staleness, stale_weight) == (1, 1, 4.0) and stale.tolist() == [-1.0] * 4
    assert report.outcome is Outcome.FOLDED_LATE and report.late_folded == 1 and driver.pending.late is None
    assert params[0].tolist() == [6.5] * 4  # 5 - (-1) - (-0.5)


def _late_then_fold(port: FakePort) -> tuple[RoundDriver, list[torch.Tensor]]:
    """A peer that missed epoch 0 (its work, -1 per value, kept as late work) and now folds it in epoch 1."""
    driver, params = make(port)
    train(driver, params, 1.0)
    assert driver.end(4, RoundReport(epoch=0), 1.0).outcome is Outcome.RESYNCED
    port.swarm = 1
    train(driver, params, 1.0)
    return driver, params


def test_late_work_a_failed_fold_round_wrote_into_is_dropped_not_folded_later() -> None:
    # the fold round's group formed, the all-reduce wrote into the late work, then failed; nobody advanced
    failed = RoundResult(Outcome.SKIPPED, "partial all-reduce", 1, late_consumed=True)
    port = FakePort(swarm=0, swarm_after=1, donor=([torch.full((4,), 5.0)], 1), shares_late=True,
                    results=[RoundResult(Outcome.SKIPPED, "partial all-reduce", 0), failed])
    driver, params = _late_then_fold(port)
    port.swarm_after = None
    report = driver.end(4, RoundReport(epoch=1), 1.0)
    assert report.outcome is Outcome.SKIPPED and driver.pending.train_on
    assert driver.pending.late is None  # before: kept, holding 0.5 * late + 77, folded into the next round
    port.results.append(averaged(1, -2.0))
    train(driver, params, 1.0)
    driver.end(4, RoundReport(epoch=1), 1.0)
    assert last_average(port)[4] is None  # nothing corrupted went on the wire


def test_late_work_survives_a_fold_round_that_failed_before_touching_it() -> None:
    port = FakePort(swarm=0, swarm_after=1, donor=([torch.full((4,), 5.0)], 1), shares_late=True,
                    results=[RoundResult(Outcome.SKIPPED, "partial all-reduce", 0),
                             RoundResult(Outcome.SKIPPED, "no group formed", 1),
                             averaged(1, -1.0, stale_term=-0.5, stalenesses=(0, 1))])
    driver, params = _late_then_fold(port)
    port.swarm_after = None
    assert driver.end(4, RoundReport(epoch=1), 1.0).outcome is Outcome.SKIPPED
    assert driver.pending.late is not None and driver.pending.late.delta[0].tolist() == [-1.0] * 4
    train(driver, params, 1.0)
    assert driver.end(4, RoundReport(epoch=1), 1.0).outcome is Outcome.FOLDED_LATE
    assert last_average(port)[4].tolist() == [-1.0] * 4


def test_without_a_donor_the_work_is_carried_not_stashed() -> None:
    port = FakePort(swarm=2)  # behind, and nobody serves the state
    driver, params = make(port)
    train(driver, params, 1.0)
    report = driver.end(4, RoundReport(epoch=0), 1.0)
    assert report.outcome is Outcome.SKIPPED and ("resync", 2) in port.calls and ("vote", 0) not in port.calls
    assert driver.pending.late is None and driver.pending.carried_weight == 4.0


def test_drifted_parameters_resync_to_our_epoch() -> None:
    port = FakePort(swarm=0, minority=True, donor=([torch.full((4,), 3.0)], 0))
    driver, params = make(port)
    train(driver, params, 1.0)
    report = driver.end(4, RoundReport(epoch=0), 1.0)
    assert report.outcome is Outcome.RESYNCED and ("resync", 0) in port.calls and "checksum" in report.reason


def test_alone_applies_its_own_work_and_late_work() -> None:
    port = FakePort(swarm=0, peers=1)
    driver, params = make(port)
    driver.pending.stash_late([torch.full((4,), -1.0)], 4.0, origin=-1)
    train(driver, params, 1.0)
    report = driver.end(4, RoundReport(epoch=0), 1.0)
    assert report.outcome is Outcome.FOLDED_LATE and report.group_size == 1 and report.staleness == [0, 1]
    assert driver.state.epoch == 1 and driver.pending.late is None and params[0].tolist() == [2.0] * 4
    assert not any(c[0] == "average" for c in port.calls)


def test_eager_without_a_usable_previous_round_steps_with_its_own_term_and_launches() -> None:
    port = FakePort(swarm=0, peers=2)
    driver, params = make(port, eager=True)
    train(driver, params, 1.0)
    report = driver.end(4, RoundReport(epoch=0), 1.0)
    assert report.outcome is Outcome.OWN_ONLY and report.reason == "nothing launched"
    assert params[0].tolist() == [0.5] * 4  # own share of the own term: 1 / peers visible
    assert ("collect", -1) in port.calls and ("launch", 0, 4.0) in port.calls
    assert ("vote", 0) not in port.calls


def test_eager_with_the_previous_complete_round_takes_the_eager_step() -> None:
    port = FakePort(swarm=1, peers=2)
    driver, params = make(port, eager=True)
    train(driver, params, 1.0)
    driver.end(4, RoundReport(epoch=0), 1.0)  # own only; stores the own term
    port.collected = Collected(averaged(0, -1.5, weights=(4.0, 4.0)), "", 0.2, folded_stale=False)
    train(driver, params, 1.0)
    report = driver.end(4, RoundReport(epoch=1), 1.0)
    assert report.outcome is Outcome.AVERAGED and report.blocked_seconds == 0.2 and report.group_size == 2
    # Δ̃ = Δ(t-1) + (Δ_m(t) − Δ_m(t-1)) * share = -1.5 + (-1 - -1) * 0.5
    assert params[0].tolist() == [0.5 + 1.5] * 4


def test_a_solo_round_resets_the_eager_state() -> None:
    port = FakePort(swarm=0, peers=1)
    driver, params = make(port, eager=True)
    driver.state.eager._prev_own = [torch.ones(4)]
    train(driver, params, 1.0)
    assert driver.end(4, RoundReport(epoch=0), 1.0).outcome is Outcome.AVERAGED
    assert not driver.state.eager.has_previous and any(c[0] == "discard" for c in port.calls)


def test_the_pseudo_gradient_goes_straight_into_the_ports_buffer_and_the_anchors_are_withdrawn_first() -> None:
    shared = [torch.zeros(4)]
    port = FakePort(swarm=0, results=[averaged(0, -2.0)], buffers=shared)
    driver, params = make(port)
    train(driver, params, 1.0)
    driver.end(4, RoundReport(epoch=0), 1.0)
    assert port.sent[0] is shared or port.sent[0][0] is shared[0]  # no copy on the way to the all-reduce
    assert shared[0].tolist() == [-1.0] * 4  # anchors (0) - params (1)
    names = [c[0] for c in port.calls]
    assert names.index("withdraw") < names.index("published")


def test_late_work_after_a_failed_allreduce_is_recomputed_not_read_from_the_garbled_buffer() -> None:
    shared = [torch.zeros(4)]
    failed = RoundResult(Outcome.SKIPPED, "partial all-reduce", 0)
    port = FakePort(swarm=0, results=[failed], buffers=shared, garble=True, swarm_after=3,
                    donor=([torch.full((4,), 7.0)], 3))
    driver, params = make(port)
    train(driver, params, 1.0)
    report = driver.end(4, RoundReport(epoch=0), 1.0)
    assert report.outcome is Outcome.RESYNCED
    assert driver.pending.late is not None and driver.pending.late.delta[0].tolist() == [-1.0] * 4
    assert driver.pending.late.delta[0].data_ptr() != shared[0].data_ptr()  # its own copy: the buffer is reused


def test_a_restarted_peer_forgets_its_work_and_loads_the_swarms_state_or_its_own_anchors() -> None:
    port = FakePort(swarm=0, donor=([torch.full((4,), 5.0)], 3))
    driver, params = make(port)
    driver.pending.stash_late([torch.ones(4)], 4.0, origin=0)
    driver.pending.carry(2.0)
    params[0].add_(1.0)
    driver.restart()
    assert driver.pending.late is None and not driver.pending.train_on
    assert driver.state.epoch == 3 and params[0].tolist() == [5.0] * 4 and ("resync", 0) in port.calls
    port.donor = None  # nobody serves: start again from the own anchors
    params[0].add_(1.0)
    driver.pending.carry(2.0)
    driver.restart()
    assert not driver.pending.train_on and driver.state.epoch == 3 and params[0].tolist() == [5.0] * 4
