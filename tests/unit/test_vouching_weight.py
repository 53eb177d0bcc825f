"""A round vouches only for the members that carried weight in it, and a vouch lapses (issue 51, finding 5b).

A zero-weight client that completed one round was trusted for the run: its signed records then held every
round's window open (proof of life, ``core.deadlines``) and its published speed counted for DyLU, both of which
ask ``Evidence.trusts``.
"""

from __future__ import annotations

from p2p_diloco.core import evidence
from p2p_diloco.core.evidence import Claim, Evidence


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_zero_weight_client_is_not_vouched_for_by_the_round_it_completed() -> None:
    ev = Evidence("me")
    # RoundResult.weights + stale_weights: "client" carried nothing, "late" only late work
    ev.averaged_with(["me", "worker", "client", "late"], weights=[1.0, 2.0, 0.0, 0.5])
    assert ev.trusts("worker") and ev.trusts("late")
    assert not ev.trusts("client")
    assert ev.trusted == frozenset({"worker", "late"})
    ev.averaged_with(["client", "nan"], weights=[0.0, float("nan")])
    assert not ev.trusts("client") and not ev.trusts("nan")
    ev.averaged_with(["a", "b"], weights=[1.0])  # malformed: nobody
    assert not ev.trusts("a") and not ev.trusts("b")


def test_an_adopted_donor_stays_until_a_groupmate_with_weight_anchors_us() -> None:
    ev = Evidence("me")
    ev.adopted_from("donor")
    ev.averaged_with(["me", "client"], weights=[1.0, 0.0])  # only a client beside us: still anchored by the donor
    assert ev.trusts("donor") and not ev.trusts("client")
    ev.averaged_with(["me", "worker"], weights=[1.0, 1.0])
    assert not ev.trusts("donor") and ev.trusts("worker")


def test_a_vouch_lapses_unless_a_round_with_weight_renews_it() -> None:
    clock = Clock()
    ev = Evidence("me", clock=clock, vouch_s=100.0)
    ev.averaged_with(["me", "a", "b"], weights=[1.0, 1.0, 1.0])
    clock.now = 60.0
    ev.averaged_with(["me", "a", "b"], weights=[1.0, 1.0, 0.0])  # b contributes nothing this time
    clock.now = 120.0
    assert ev.trusts("a") and not ev.trusts("b")
    assert ev.swarm_epoch([Claim("a", 5), Claim("b", 10**6)]) == 5  # anchored on a; b's claim is not believed
    clock.now = 161.0
    assert not ev.trusts("a") and ev.trusted == frozenset()
    assert evidence.VOUCH_S >= 3600.0  # well above the gap between two rounds with an honest groupmate
