"""The injected faults' plan (peer.faults): parsing, and ``start_together``'s wait for the others' records."""

from __future__ import annotations

import pytest

from p2p_diloco.peer import faults
from p2p_diloco.peer.faults import FaultPlan, parse_faults


def _plan(text: str) -> tuple[FaultPlan, list[tuple[str, int]]]:
    fired: list[tuple[str, int]] = []
    return FaultPlan(parse_faults(text), lambda action, epoch: fired.append((action, epoch))), fired


def test_start_together_needs_the_number_of_peers() -> None:
    with pytest.raises(ValueError, match="needs a finite number"):
        parse_faults("start_together@0")
    assert parse_faults("start_together@0=3,slow_steps@1=0.8")[0] == faults.Fault("start_together", 0, 3.0)


def test_start_together_waits_until_every_peer_is_visible_then_never_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "START_TOGETHER_POLL_S", 0.0)
    plan, fired = _plan("start_together@0=3")
    seen = iter([1, 1, 2, 3, 3])
    reads: list[int] = []

    def visible() -> int:
        reads.append(next(seen))
        return reads[-1]

    plan.set_epoch(0)
    plan.before_phase(visible)
    assert reads == [1, 1, 2, 3]  # read until all 3 were visible, not once more
    plan.before_phase(visible)  # the epoch-0 round was skipped and is retried: no second wait
    assert reads == [1, 1, 2, 3] and fired == []  # it paces the peer only: no fault event


def test_start_together_is_keyed_by_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that joined at a later epoch (a state download) does not wait for a start it was not part of."""
    monkeypatch.setattr(faults, "START_TOGETHER_POLL_S", 0.0)
    plan, _ = _plan("start_together@0=3")
    plan.set_epoch(4)
    plan.before_phase(lambda: pytest.fail("read the records at epoch 4"))


def test_start_together_gives_up_after_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "START_TOGETHER_POLL_S", 0.0)
    monkeypatch.setattr(faults, "START_TOGETHER_MAX_S", 0.05)
    plan, _ = _plan("start_together@0=3")
    reads: list[int] = []
    plan.before_phase(lambda: reads.append(1) or 1)  # nobody else ever comes up
    assert reads  # it read, and returned once the bound passed instead of waiting forever


def test_a_production_peer_runs_no_fault() -> None:
    faults.NO_FAULTS.before_phase(lambda: pytest.fail("a production peer read the records for a fault"))
