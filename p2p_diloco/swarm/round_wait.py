"""How the training thread waits for a round's result while the averager process looks for its group.

The wait is also when this peer learns that the swarm moved on without it: ``wait_for_round`` asks
``left_behind`` as it waits, and the averager process decides whether the search stops (``commands.GiveUp``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hivemind.averaging.control import AveragingStage, StepControl

from p2p_diloco.core.rounds import RoundResult

LEFT_BEHIND_POLL_S = 2.0
"""While this peer looks for a group, at most how long between two asks of ``average(left_behind=...)`` whether
the swarm left this epoch behind. Each ask reads the progress records from the DHT (a few KB; within the window,
once they say the others moved on, their checksums too); a few seconds is far below ``matchmaking_timeout_s``
(60 s by default), which is what a peer that missed its group waited before."""
POLL_SHARE = 0.25
"""Within a short matchmaking window the asks come every this share of it (:func:`poll_interval`)."""
MIN_POLL_S = 0.25
"""The shortest time between two asks, whatever the window: at most 4 reads of the records per second."""


def poll_interval(window_s: float) -> float:
    """Seconds between two asks of ``left_behind`` in a round whose matchmaking window is ``window_s`` (0: not
    known, the longest interval).

    Why it shrinks with the window: a peer left behind learns it at the next ask after the others finished
    their round, then fetches the round's update, trains and searches again, and all of it must fit in their
    next inner phase plus their window, or it is cut again. A 2 s interval is on average 1 s of that, half of
    it at worst; with 10-step phases and the 3 s window floor a peer catching up through a relay lost every
    round by about 0.6 s (the relayed live test, issue 31), chasing the swarm for all its rounds. A quarter of
    the window keeps the delay a small share of the slack the window gives. The windows users run (the 15 s
    default, a learned floor of 7.5 s at the 5 s request timeout) keep 1.9-2 s; only swarms of short windows
    read the records more often, at most ``1 / MIN_POLL_S`` times a second per waiting peer."""
    if not window_s > 0:
        return LEFT_BEHIND_POLL_S
    return min(LEFT_BEHIND_POLL_S, max(MIN_POLL_S, POLL_SHARE * window_s))


def wait_for_round(control: StepControl, budget: float, left_behind: Callable[[bool], bool] | None,
                   after_s: float = 0.0, give_up: Callable[[], None] | None = None) -> RoundResult:
    """``control``'s result within ``budget`` seconds (``TimeoutError`` past it). While the averager
    process still looks for a group, ``left_behind(window_open)`` is asked every :func:`poll_interval`, and
    once more the moment the round's window (``after_s`` seconds into the search) ends, with whether it is
    still open; once it says so, ``give_up()`` asks the averager process to stop the search
    (``commands.GiveUp``), and the wait goes on for the round's own result: ``left_behind`` when the search
    stopped before a group formed, else the group's all-reduce.

    Why the process decides and not this thread: the stage this thread reads lags the process. A group can
    form between the read and the request; had this thread then dropped the round, the group's other
    members would apply an update this peer never applied (a group split, seen in a CI run). The process
    answers on the loop where groups form, so a round whose group formed always runs to its result.

    Why the question differs before the window ends: a record one epoch ahead does not always mean the
    round is over. An eager peer publishes ``e + 1`` while its all-reduce of ``e`` still looks for a group,
    and any leader still assembling ``e`` waits at most its window for this peer. Past the window, with
    every believed peer past ``e``, the group of ``e`` formed without this peer; within it, the peers
    must also have finished ``e`` (``Evidence.round_over``). Why ask within it at all: a peer that starts
    its search after the others' group formed (its catch-up outlasted their inner phase) otherwise waits
    out its whole window alone, and arrives late for the next round as well."""
    began = time.monotonic()
    deadline, window_end = began + budget, began + after_s
    poll_s = poll_interval(after_s)

    def next_ask(now: float) -> float:
        ask = now + poll_s
        return min(ask, window_end) if now < window_end else ask

    ask_at = next_ask(began)
    asking = left_behind is not None and give_up is not None
    while True:
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            raise TimeoutError
        try:
            return control.result(timeout=remaining if not asking else min(remaining, max(0.05, ask_at - now)))
        except TimeoutError:
            now = time.monotonic()
            if not asking or now < ask_at:
                continue
            ask_at = next_ask(now)
            if control.stage == AveragingStage.LOOKING_FOR_GROUP and left_behind(now < window_end):
                give_up()
                asking = False  # asked once; the process's answer is the round's result
