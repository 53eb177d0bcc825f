"""Deadlines learned from arrivals (core.deadlines): they shrink to what the swarm shows, grow when rounds
are cut, and never leave the bounds the flags set."""

from __future__ import annotations

import pytest

from p2p_diloco.core.deadlines import ArrivalDeadlines, LearnedDeadline, RoundDeadlines


def _deadlines(**overrides: object) -> ArrivalDeadlines:
    kwargs: dict = dict(window_ceiling_s=15.0, request_timeout_s=1.0, allreduce_ceiling_s=600.0,
                        next_chunk_timeout_s=10.0)
    kwargs.update(overrides)
    return ArrivalDeadlines(**kwargs)


def _round(d: ArrivalDeadlines, *, wait: float, cut: tuple[str, ...] = (), members: tuple[str, ...] = ("me", "x", "y"),
           allreduce: float | None = 2.0, timed_out: bool = False) -> RoundDeadlines:
    used = d.next_round()
    members = tuple(m for m in members if m not in cut)
    d.observe(used, due_members=3, cut=cut, members=members, wait_s=wait,
              allreduce_s=None if timed_out else allreduce, allreduce_timed_out=timed_out)
    return used


def test_a_new_peer_uses_the_flags_until_it_has_seen_rounds() -> None:
    d = _deadlines()
    assert d.next_round() == RoundDeadlines(15.0, 600.0)
    _round(d, wait=0.4)
    _round(d, wait=0.5)
    assert d.next_round() == RoundDeadlines(15.0, 600.0)  # two samples are not a swarm's behaviour yet


def test_prompt_arrivals_shrink_the_window_and_fast_allreduces_the_deadline_down_to_their_floors() -> None:
    d = _deadlines()
    for wait in (0.4, 0.6, 0.5, 0.45, 0.55):
        _round(d, wait=wait)
    now = d.next_round()
    assert now.window_s == pytest.approx(1.5)  # floor: 1.5 x request_timeout_s
    assert now.allreduce_s == pytest.approx(20.0)  # floor: 2 x next_chunk_timeout_s


def test_the_window_follows_the_spread_of_arrivals() -> None:
    d = _deadlines()
    for wait in (2.0, 4.0, 3.0, 5.0, 3.0):
        _round(d, wait=wait)
    # median 3, MAD 1: 3 x 1.5 + 4 x 1.4826 x 1
    assert d.next_round().window_s == pytest.approx(3 * 1.5 + 4 * 1.4826)


def test_one_wild_round_does_not_move_it_but_a_slower_swarm_does() -> None:
    d = _deadlines()
    for _ in range(8):
        _round(d, wait=0.5)
    _round(d, wait=14.0)  # one peer's disk stalled
    assert d.next_round().window_s == pytest.approx(1.5)
    for _ in range(5):  # the swarm's arrivals really spread out now
        _round(d, wait=6.0)
    assert d.next_round().window_s == pytest.approx(min(15.0, 6.0 * 1.5 + 4 * 1.4826 * 0.0))


def test_a_straggler_cut_every_round_grows_the_window_up_to_the_flag_and_it_comes_back_down() -> None:
    d = _deadlines()
    for _ in range(5):
        _round(d, wait=0.5)
    windows = []
    for i in range(7):  # peer y now arrives after every window: each round cuts it, and it folds its work
        # into the next round's group, which is how this peer knows it was late and not gone
        cut = ("y",) if i % 2 == 0 else ("x",)
        windows.append(_round(d, wait=d.next_round().window_s, cut=cut).window_s)
    assert windows[0] == pytest.approx(1.5)
    assert windows == sorted(windows) and windows[-1] == 15.0, windows  # grew, up to the ceiling, no further
    for _ in range(9):  # prompt again: the growth decays (0.8x a round) instead of dropping at once
        _round(d, wait=0.5)
    assert d.next_round().window_s < 2.5
    for _ in range(6):
        _round(d, wait=0.5)
    assert d.next_round().window_s == pytest.approx(1.5)


def test_a_peer_that_died_does_not_grow_the_window() -> None:
    # Its progress record keeps it "due" for a round or two; it never joins a group again.
    d = _deadlines()
    for _ in range(5):
        _round(d, wait=0.5)
    windows = [_round(d, wait=1.5, cut=("dead",), members=("me", "x")).window_s for _ in range(2)]
    windows += [_round(d, wait=0.5, members=("me", "x")).window_s for _ in range(3)]
    assert windows == [pytest.approx(1.5)] * 5, windows


def test_a_straggler_that_never_makes_a_group_but_writes_its_record_grows_the_window_at_once() -> None:
    # A relayed peer that catches up each round (an update fetched through the relay) arrives after every
    # window by the same margin, so it never turns up in a group; its signed record, written again, proves it.
    d = _deadlines()
    for _ in range(5):
        _round(d, wait=0.5)
    windows, written = [], 100.0
    for _ in range(4):
        written += 10.0  # its record re-published during the round that cut it
        used = d.next_round(published={"me": written, "x": written, "y": written})
        windows.append(used.window_s)
        d.observe(used, due_members=3, cut=("y",), members=("me", "x"), wait_s=used.window_s, allreduce_s=2.0,
                  allreduce_timed_out=False)
    # the first round cut it at the learned 1.5 s; from the next round's start on the window doubles each round
    assert windows == [pytest.approx(1.5), pytest.approx(3.0), pytest.approx(6.0), pytest.approx(12.0)], windows
    # it joins at last: not counted a second time (its record proved it already at this round's start)
    used = d.next_round(published={"me": written + 10, "x": written + 10, "y": written + 10})
    d.observe(used, due_members=3, cut=(), members=("me", "x", "y"), wait_s=13.0, allreduce_s=2.0,
              allreduce_timed_out=False)
    assert used.window_s == pytest.approx(15.0) and d.next_round().window_s <= 15.0


def test_a_dead_peers_record_that_is_not_written_again_grows_nothing() -> None:
    d = _deadlines()
    for _ in range(5):
        _round(d, wait=0.5)
    windows = []
    for i in range(3):  # "dead" stays due through its unexpired record, never written again; the others' are
        used = d.next_round(published={"me": 100.0 + i, "x": 100.0 + i, "dead": 90.0})
        windows.append(used.window_s)
        d.observe(used, due_members=3, cut=("dead",), members=("me", "x"), wait_s=1.5, allreduce_s=2.0,
                  allreduce_timed_out=False, due_arrival_s=0.5)
    assert windows == [pytest.approx(1.5)] * 3, windows


def test_under_churn_a_leader_learns_the_window_from_the_peers_that_came() -> None:
    # A new swarm with churn: every round some due peer is dead (its record still lives), so no round is
    # complete. The leader still sees when the last due peer that came joined it, and learns from that.
    d = _deadlines()
    windows = []
    for i in range(6):
        used = d.next_round()
        windows.append(used.window_s)
        d.observe(used, due_members=5, cut=(f"dead{i}",), members=("me", "a", "b", "c"), wait_s=used.window_s,
                  allreduce_s=2.0, allreduce_timed_out=False, due_arrival_s=0.8)
    assert windows[:3] == [15.0] * 3 and windows[-1] == pytest.approx(1.5), windows
    # A follower of such rounds saw only the leader's window: it learns nothing.
    f = _deadlines()
    for i in range(6):
        used = f.next_round()
        f.observe(used, due_members=5, cut=(f"dead{i}",), members=("me", "a"), wait_s=used.window_s,
                  allreduce_s=2.0, allreduce_timed_out=False)
    assert f.window.samples == () and f.next_round().window_s == 15.0
    # A cut peer that was alive after all, and joins the next round, still grows the learned window.
    used = d.next_round()
    d.observe(used, due_members=4, cut=("late",), members=("me", "a", "b"), wait_s=used.window_s, allreduce_s=2.0,
              allreduce_timed_out=False, due_arrival_s=0.8)
    _round(d, wait=0.9, members=("me", "late", "a"))
    assert d.next_round().window_s == pytest.approx(2 * 1.5 * 0.8)  # doubled, then decayed once (0.8x)


def test_rounds_without_a_due_set_teach_nothing_about_arrivals() -> None:
    d = _deadlines()
    for _ in range(5):
        used = d.next_round()
        d.observe(used, due_members=1, cut=(), members=("me", "x"), wait_s=15.0, allreduce_s=None,
                  allreduce_timed_out=False)
    assert d.window.samples == () and d.allreduce.samples == ()


def test_allreduce_timeouts_grow_the_deadline() -> None:
    d = _deadlines()
    for _ in range(5):
        _round(d, wait=0.5, allreduce=1.0)
    assert d.next_round().allreduce_s == pytest.approx(20.0)
    deadlines = [_round(d, wait=0.5, timed_out=True).allreduce_s for _ in range(5)]
    assert deadlines[0] == 20.0 and deadlines[-1] > 100.0 and max(deadlines) <= 600.0, deadlines


def test_fixed_deadlines_when_not_adaptive_and_bounds_hold_for_any_input() -> None:
    d = _deadlines(adaptive=False)
    for _ in range(5):
        _round(d, wait=0.5, allreduce=0.1)
    assert d.next_round() == RoundDeadlines(15.0, 600.0)
    learned = LearnedDeadline(floor=1.0, ceiling=10.0)
    for x in (float("nan"), float("inf"), -3.0, 1e300, 0.0):
        learned.observe(x)
    assert 1.0 <= learned.seconds <= 10.0
    assert learned.samples == (1e300, 0.0)
    with pytest.raises(ValueError, match="floor"):
        LearnedDeadline(floor=5.0, ceiling=2.0)


def test_floors_never_exceed_the_flags() -> None:
    d = _deadlines(window_ceiling_s=1.2, request_timeout_s=1.0, allreduce_ceiling_s=15.0, next_chunk_timeout_s=7.0)
    assert d.window.floor == 1.2 and d.allreduce.floor == 14.0
