"""Buffer leases (``core.lease``): every state and every wrong access; and the late-work path through a port
that shares memory with another process the way the swarm's averager does."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field

import pytest
import torch

from p2p_diloco.core.delayed import StalenessPolicy
from p2p_diloco.core.lease import BufferLease, LeaseError, LeaseState
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.round_driver import Collected, RoundDriver
from p2p_diloco.core.rounds import LateWork, Observation, Outcome, RoundPolicy, RoundReport, RoundResult

ME = "me"


# ------------------------------------------------------------------ the state machine


def test_a_lease_walks_writable_in_flight_readable_served_released() -> None:
    released: list[int] = []
    lease = BufferLease([torch.zeros(3)], shared=True, on_release=lambda: released.append(1))
    lease.delta()[0].fill_(2.0)
    lease.send()
    assert lease.state is LeaseState.IN_FLIGHT and lease.in_flight()[0][0].tolist() == [2.0] * 3
    assert lease.returned(averaged=True, late_intact=True) is None
    assert lease.state is LeaseState.READABLE and lease.mean()[0].tolist() == [2.0] * 3
    lease.serve()
    assert lease.mean()[0].tolist() == [2.0] * 3  # served: still readable
    lease.release()
    lease.release()  # idempotent: the port's part runs once
    assert lease.state is LeaseState.RELEASED and released == [1]


@pytest.mark.parametrize("state, access, needs", [
    ("in flight", lambda lease: lease.delta(), "delta writable"),
    ("in flight", lambda lease: lease.mean(), "mean readable or served"),
    ("in flight", lambda lease: lease.send(), "delta writable"),
    ("delta writable", lambda lease: lease.in_flight(), "in flight"),
    ("delta writable", lambda lease: lease.mean(), "mean readable"),
    ("delta writable", lambda lease: lease.serve(), "mean readable"),
    ("delta writable", lambda lease: lease.returned(True, True), "in flight"),
    ("mean readable", lambda lease: lease.delta(), "delta writable"),
    ("served", lambda lease: lease.delta(), "delta writable"),
    ("served", lambda lease: lease.fold(LateWork([torch.ones(3)], 1.0, 0)), "delta writable"),
    ("released", lambda lease: lease.mean(), "mean readable"),
    ("released", lambda lease: lease.delta(), "delta writable"),
])
def test_a_buffer_in_the_wrong_state_is_neither_written_nor_read(state: str, access, needs: str) -> None:
    lease = BufferLease([torch.zeros(3)])
    steps = {"delta writable": [], "in flight": ["send"], "mean readable": ["send", "ok"],
             "served": ["send", "ok", "serve"], "released": ["release"]}[state]
    for step in steps:
        if step == "send":
            lease.send()
        elif step == "ok":
            lease.returned(averaged=True, late_intact=True)
        elif step == "serve":
            lease.serve()
        else:
            lease.release()
    with pytest.raises(LeaseError, match=f"buffers are {state} \\(needs {needs}"):
        access(lease)


def test_a_failed_round_hands_the_buffers_back_writable_and_the_late_work_only_if_untouched() -> None:
    late = LateWork([torch.ones(3)], 2.0, origin_epoch=4)
    lease = BufferLease([torch.zeros(3)])
    lease.fold(late)
    with pytest.raises(LeaseError, match="already folds"):
        lease.fold(late)
    lease.send()
    assert lease.in_flight()[1] is late.delta
    assert lease.returned(averaged=False, late_intact=True) is late
    assert lease.state is LeaseState.WRITABLE and not lease.folds_late
    lease.fold(late)
    lease.send()
    assert lease.returned(averaged=False, late_intact=False) is None  # written into: spent with the round
    lease.fold(late)
    lease.send()
    assert lease.returned(averaged=True, late_intact=True) is None  # folded into the group's terms


def test_late_work_of_another_layout_is_refused() -> None:
    with pytest.raises(LeaseError, match="late work holds 2 tensors, the round's buffers 1"):
        BufferLease([torch.zeros(3)]).fold(LateWork([torch.ones(3), torch.ones(3)], 1.0, 0))


# ------------------------------------------------------------------ the late-work path, memory shared across processes


def _allreduce_in_place(late: list[torch.Tensor], fresh: list[torch.Tensor]) -> None:
    """The averager process's part of a fold round whose group formed: the late work is scaled in place and the
    all-reduce writes part of the group's values into it and into the fresh buffer, then the round fails."""
    for t in late:
        t.mul_(0.5).add_(77.0)
    for t in fresh:
        t.fill_(123.0)


@dataclass
class SharedMemoryPort:
    """A ``RoundPort`` that shares the round's memory with another process as ``swarm.averager`` does: the fresh
    buffers are shared memory it leases out, and the late work of a fold round is moved to shared memory in
    place (``share_memory_``, no copy) and written by a child process. Each round answers from ``results``;
    ``touches`` says whether its child writes into the buffers (a group formed) before it fails."""

    state: OuterState
    params: list[torch.Tensor]
    results: list[tuple[RoundResult, bool]] = field(default_factory=list)
    swarm: int = 1
    swarm_after: int | None = None
    donor: tuple[float, int] | None = None
    buffers: list[torch.Tensor] = field(default_factory=lambda: [torch.zeros(4).share_memory_()])
    late_seen: list[list[float] | None] = field(default_factory=list)
    released: int = 0

    def driver_holds(self, driver: RoundDriver) -> None:
        self._driver = driver

    def observe(self, epoch: int) -> Observation:
        return Observation(epoch, self.swarm, 3, unseen_s=0.0)

    def in_minority(self, epoch: int) -> bool:
        return False

    def swarm_epoch(self) -> int | None:
        return self.swarm_after

    def averaging(self, epoch: int) -> None:
        pass

    def before_allreduce(self) -> None:
        pass

    def average(self, lease: BufferLease, weight: float, staleness: int, epoch: int,
                stale_weight: float) -> RoundResult:
        fresh, late = lease.in_flight()
        # core lets go of the late work for the round: nothing of the driver's refers to what the child writes
        assert self._driver.pending.late is None
        self.late_seen.append(None if late is None else [float(v) for v in late[0]])
        result, touches = self.results.pop(0)
        if late is not None:
            late = [t.share_memory_() for t in late]  # in place, as ``swarm.averager._shared``
        if touches:
            child = mp.get_context("fork").Process(target=_allreduce_in_place, args=(late or [], fresh))
            child.start()
            child.join(30)
            assert child.exitcode == 0
        result.late_consumed = late is not None and touches
        return result

    def resync(self, min_epoch: int) -> bool:
        if self.donor is None:
            return False
        value, epoch = self.donor
        self.state.load_state_tensors({"param.0": torch.full((4,), value)}, epoch)
        self.state.begin(self.params)
        return True

    def published(self, epoch: int, update: object = None) -> None:
        pass

    def collect(self, epoch: int, timeout: float) -> Collected:
        raise AssertionError("blocking rounds only")

    def launch(self, *args: object) -> bool:
        raise AssertionError("blocking rounds only")

    def discard(self, why: str) -> None:
        pass

    def lease(self) -> BufferLease:
        return BufferLease(self.buffers, shared=True, on_release=self._release)

    def _release(self) -> None:
        self.released += 1

    def withdraw(self) -> None:
        pass


def _peer_with_late_work(results: list[tuple[RoundResult, bool]]) -> tuple[RoundDriver, SharedMemoryPort]:
    """A peer that missed epoch 0: its work (-1 per value, weight 4) is late work, origin 0, at epoch 1."""
    params = [torch.zeros(4)]
    state = OuterState(params, lr=1.0, momentum=0.0)
    failed = RoundResult(Outcome.SKIPPED, "partial all-reduce", 0)
    port = SharedMemoryPort(state, params, results=[(failed, True), *results], swarm=0, swarm_after=1,
                            donor=(5.0, 1))
    driver = RoundDriver(state, params, RoundPolicy(StalenessPolicy(staleness_decay=1.0, max_staleness=4)),
                         port, ME)
    port.driver_holds(driver)
    driver.begin()
    params[0].add_(1.0)
    assert driver.end(4, RoundReport(epoch=0), 1.0).outcome is Outcome.RESYNCED
    assert driver.pending.late is not None and driver.pending.late.delta[0].tolist() == [-1.0] * 4
    port.swarm = 1
    return driver, port


def _round(driver: RoundDriver, epoch: int, step: float = 1.0) -> Outcome:
    driver.begin()
    driver.params[0].add_(step)
    return driver.end(4, RoundReport(epoch=epoch), 1.0).outcome


@pytest.mark.parametrize("touched", [True, False])
def test_late_work_after_a_failed_fold_a_carry_and_a_resync_is_never_what_another_process_wrote(
        touched: bool) -> None:
    """The path issue 33 suspected: a fold round fails (partial, nobody advanced: CARRY), then the swarm moves
    on (RESYNC adds the new work to the late work). A round whose child process wrote into the late work spends
    it; one that failed before any group formed hands it back intact, and the resync adds to that."""
    failed = RoundResult(Outcome.SKIPPED, "partial all-reduce" if touched else "no group formed", 1)
    behind = RoundResult(Outcome.SKIPPED, "partial all-reduce", 1)
    driver, port = _peer_with_late_work([(failed, touched), (behind, False)])
    port.swarm_after = None  # nobody advanced: carry
    assert _round(driver, 1) is Outcome.SKIPPED and driver.pending.train_on
    assert port.late_seen[-1] == [-1.0] * 4  # what the fold round was handed
    if touched:
        assert driver.pending.late is None
    else:
        assert driver.pending.late is not None and driver.pending.late.delta[0].tolist() == [-1.0] * 4
    port.swarm_after, port.donor = 2, (9.0, 2)  # the others finished epoch 1 without us: resync
    assert _round(driver, 1) is Outcome.RESYNCED
    late = driver.pending.late
    assert late is not None and late.delta[0].data_ptr() != port.buffers[0].data_ptr()
    assert late.origin_epoch == (1 if touched else 0)  # merged late work counts its staleness from the older
    # two phases of this peer's own work (carried, then trained on), plus the older late work if it survived
    expected = -2.0 + (0.0 if touched else -1.0)
    assert late.delta[0].tolist() == [expected] * 4  # never 0.5 * late + 77, never the 123s of the buffer


def test_the_leases_are_released_round_by_round_and_the_served_mean_until_the_next() -> None:
    mean = RoundResult(Outcome.AVERAGED, "", 1, contributors=(ME, "other"), weights=(4.0, 4.0),
                       stale_weights=(0.0, 0.0), stalenesses=(0, 0))
    driver, port = _peer_with_late_work([])
    mean.fresh_mean = port.buffers  # the swarm's mean stays in the shared buffers (``copy_out=False``)
    folded = RoundResult(Outcome.AVERAGED, "", 1, contributors=(ME, "other"), weights=(4.0, 4.0),
                         stale_weights=(0.0, 4.0), stalenesses=(0, 1), fresh_mean=port.buffers,
                         stale_term=[torch.zeros(4)], with_stale=True)
    port.results = [(folded, False), (mean, False)]
    port.swarm_after = None
    before = port.released
    assert _round(driver, 1) is Outcome.FOLDED_LATE and driver.pending.late is None
    assert driver.lease is not None and driver.lease.state is LeaseState.SERVED
    assert port.released == before + 1  # the resync round's lease ended when this round took its own
    served = driver.lease
    port.swarm = 2
    assert _round(driver, 2) is Outcome.AVERAGED
    assert served.state is LeaseState.RELEASED and port.released == before + 2
    with pytest.raises(LeaseError, match="released"):
        served.mean()
