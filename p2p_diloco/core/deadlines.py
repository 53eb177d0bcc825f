"""Round deadlines learned from what this peer observed: the matchmaking window and the all-reduce deadline.

The fixed flags (``--matchmaking-time-s``, ``--allreduce-timeout-s``) are what an operator can promise as
the worst case; they are the ceilings here. Below them each peer sets its own deadlines from the arrivals
and all-reduce durations it saw in its last rounds, so that a swarm whose peers all arrive within a second
stops paying a 15 s window whenever one due peer went silent, and a stuck all-reduce is cut after a few
times its usual length instead of ten minutes.

**The rule: median plus k times the MAD, with floors and ceilings.** For the last ``history`` samples x,
the deadline is ``median(x) * slack + k * 1.4826 * MAD(x)``, clamped to ``[floor, ceiling]``.

- Median and MAD, not mean and standard deviation: one round in which a peer's disk stalled for a minute
  must not set the deadline of the next dozen rounds. Both ignore up to half of the samples being wild.
- ``k = 4`` MADs: for normally spread arrivals that keeps about 99.99% of them; arrivals over the internet
  have a longer tail, which the ``slack`` factor covers.
- **A cut straggler grows the window, once it proves it is alive.** A round whose window ended with a due
  peer missing did not see that peer's arrival, only that it came later than the window, or never: a peer
  that died stays "due" while its signed progress record lives, for a round or two. Growing the window for
  it would make the survivors wait the full flag for a dead peer (measured: ``benchmarks/silent_peer.py``).
  So the cut is remembered, and counts only once one of the cut peers proves it is alive: it turns up in a
  group of the next round, or it re-published its signed progress record since the round that cut it (a
  record with a later expiration than the one read for that round; a dead peer writes none). Then the window
  that cut it is recorded as a censored sample, and the window is ``growth x`` (2x) it, so it doubles each
  round until the straggler fits or it reaches the ceiling. The record counts at the next round's start, so
  that round's window already grows: a peer late by the same margin every round (one that catches up through
  a relay, downloading each round's update, then trains) was otherwise cut round after round, since it never
  made it into a group to prove itself (seen on the home-network testbed: rounds 3-6 of a relayed peer). A
  record proves only that its identity lives, and identities are free: a Sybil that is due, never joins and
  keeps writing records would hold every round's window at the ceiling. So the caller passes only the records
  of peers it trusts (averaged with, or ``--trusted-peers``: ``Evidence.trusts``), as the late peer above is
  once it averaged with this one; a stranger proves itself only by turning up in a group. Each complete round
  lets that boost decay by ``decay`` (0.8x), and the median brings the window back down within about
  ``history / 2`` rounds of prompt arrivals, without swinging between cutting and not. A cut peer that
  never comes back teaches nothing.
- Floors. The window never drops below ``1.5 x request_timeout_s``: hivemind breaks matchmaking deadlocks
  with the request timeout and needs the window longer than it. The all-reduce deadline never drops below
  ``2 x next_chunk_timeout_s``, the time a silent groupmate takes to be detected, so a slow part never ends
  a round that the chunk timeout would have let live.

What the samples are:

- **Arrival**: how long after this peer began looking its group formed, in rounds where the group formed
  with every due peer in it (a leader forms it the moment the last due peer joins, a follower is told at
  once). Rounds without a known due set (a new swarm) teach nothing: their window decided.
- **Arrival in a round that cut due peers**: a leader also knows when the last due peer that came joined it,
  and learns from that. Without it, a swarm with churn never learned: a peer that died stays due while its
  record lives (up to two rounds), so with a peer leaving every round or two almost no round was complete
  and the window stayed where it was (measured with 32 peers, BENCHMARKS.md "Swarm scale with churn"). A
  cut peer that was alive after all still grows the window, by the censoring rule above, when it turns up
  in the next round's group. A follower in such a round learns nothing: it saw only the leader's window.
- **All-reduce**: the seconds the all-reduce took in rounds that averaged; a round that ran out of time is
  censored at once (groupmates that stop answering are caught by ``--next-chunk-timeout-s``, so running
  out of time means the network was slower than the deadline).

This module is pure arithmetic on numbers; ``swarm.averager`` feeds it and uses its answers, and the
simulator can drive it the same way.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

MAD_TO_SIGMA = 1.4826
"""MAD x this estimates the standard deviation of normally spread samples."""


@dataclass
class LearnedDeadline:
    """One deadline learned from samples: ``median * slack + k * sigma_MAD``, within ``[floor, ceiling]``.

    Until ``min_samples`` samples exist the ceiling applies: a new peer knows nothing about its swarm.
    """

    floor: float
    """Never below this many seconds (see the module docstring for how each floor is chosen)."""
    ceiling: float
    """Never above this: the operator's fixed flag."""
    slack: float = 1.5
    """Multiplies the median; covers the drift between samples that the MAD of a quiet swarm does not."""
    k: float = 4.0
    """MADs (scaled to sigma) above the median."""
    history: int = 9
    """Samples kept (the last rounds). Odd, so that the median is a sample. 9 reacts within about 5 rounds."""
    min_samples: int = 3
    """Samples needed before the deadline leaves its ceiling."""
    growth: float = 2.0
    """After a censored round the deadline is at least this many times the one that cut it."""
    decay: float = 0.8
    """Each complete sample multiplies that boost by this."""
    _samples: deque[float] = field(init=False, repr=False)
    _boost: float = field(init=False, repr=False, default=0.0)

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.ceiling:
            raise ValueError(f"need 0 < floor <= ceiling, got floor={self.floor!r}, ceiling={self.ceiling!r}")
        if self.slack < 1 or self.k < 0 or self.growth <= 1 or not 0 <= self.decay < 1:
            raise ValueError(f"need slack >= 1, k >= 0, growth > 1, 0 <= decay < 1; got {self.slack}, {self.k}, "
                             f"{self.growth}, {self.decay}")
        if self.history < 1 or not 1 <= self.min_samples <= self.history:
            raise ValueError(f"need 1 <= min_samples <= history, got {self.min_samples}, {self.history}")
        self._samples = deque(maxlen=self.history)

    @property
    def seconds(self) -> float:
        """The deadline for the next round."""
        if len(self._samples) < self.min_samples:
            return self.ceiling
        median = statistics.median(self._samples)
        mad = statistics.median(abs(x - median) for x in self._samples)
        learned = median * self.slack + self.k * MAD_TO_SIGMA * mad
        return min(self.ceiling, max(self.floor, learned, self._boost))

    def observe(self, seconds: float) -> None:
        """A complete sample: what the awaited event took."""
        if seconds >= 0 and seconds == seconds and seconds != float("inf"):
            self._samples.append(float(seconds))
            self._boost *= self.decay

    def censored(self, deadline: float) -> None:
        """The event did not happen within ``deadline`` (the deadline this round used)."""
        grown = min(self.ceiling, max(self.floor, deadline) * self.growth)
        self._samples.append(grown)
        self._boost = grown

    @property
    def samples(self) -> tuple[float, ...]:
        return tuple(self._samples)


@dataclass(frozen=True)
class RoundDeadlines:
    """The deadlines one round uses, as reported in the round log and the metrics."""

    window_s: float
    """Matchmaking window: the longest a leader waits for due peers that have not joined."""
    allreduce_s: float
    """All-reduce deadline once the group formed."""


class ArrivalDeadlines:
    """A peer's matchmaking window and all-reduce deadline, learned from its rounds (module docstring).

    :param window_ceiling_s: ``matchmaking_time_s``; :param request_timeout_s: sets the window's floor.
    :param allreduce_ceiling_s: ``allreduce_timeout_s``; :param next_chunk_timeout_s: sets its floor.
    :param adaptive: ``False`` keeps the fixed flags (the ceilings) for every round.
    """

    def __init__(
        self,
        *,
        window_ceiling_s: float,
        request_timeout_s: float,
        allreduce_ceiling_s: float,
        next_chunk_timeout_s: float,
        adaptive: bool = True,
    ):
        self.adaptive = adaptive
        self.window = LearnedDeadline(floor=min(window_ceiling_s, window_floor(request_timeout_s)),
                                      ceiling=window_ceiling_s)
        self.allreduce = LearnedDeadline(floor=min(allreduce_ceiling_s, 2 * next_chunk_timeout_s),
                                         ceiling=allreduce_ceiling_s, slack=3.0)
        self._cut: frozenset[str] = frozenset()  # due peers the last round's window left out
        self._cut_by = 0.0  # that round's window
        self._published: Mapping[str, float] = {}  # record expirations read for the round under way
        self._cut_published: dict[str, float] = {}  # those of the peers the last round cut

    def next_round(self, published: Mapping[str, float] | None = None) -> RoundDeadlines:
        """The deadlines of the round about to start. ``published``: peer id -> the expiration time of its signed
        progress record as read for this round; a peer the last round cut whose record was written again since
        is alive, and the window grows for it now (module docstring). Without it nothing is learned here."""
        if published is not None:
            self._published = dict(published)
            if self._cut and any(published.get(peer, -math.inf) > self._cut_published.get(peer, math.inf)
                                 for peer in self._cut):
                self.window.censored(self._cut_by)
                self._cut = frozenset()  # proven: not counted again when it turns up in this round's group
        if not self.adaptive:
            return RoundDeadlines(self.window.ceiling, self.allreduce.ceiling)
        return RoundDeadlines(self.window.seconds, self.allreduce.seconds)

    def observe(
        self,
        used: RoundDeadlines,
        *,
        due_members: int,
        cut: Collection[str],
        members: Collection[str],
        wait_s: float,
        allreduce_s: float | None,
        allreduce_timed_out: bool,
        due_arrival_s: float | None = None,
    ) -> None:
        """What one round showed.

        :param used: the deadlines the round ran with.
        :param due_members: peers verified due (this one included); below 2 the round says nothing about
          arrivals.
        :param cut: ids of the due peers missing from the group (empty when everyone due joined).
        :param members: ids of the group's members (empty when no group formed).
        :param wait_s: seconds from the start of the search until the group formed (or the search ended).
        :param allreduce_s: the all-reduce's duration when it completed, else ``None``.
        :param allreduce_timed_out: the all-reduce ran into ``used.allreduce_s``.
        :param due_arrival_s: this peer led the group: when the last due peer that came joined it
          (``RoundResult.due_arrival_s``); learned from in a round that cut due peers.
        """
        if self._cut and self._cut & frozenset(members):
            self.window.censored(self._cut_by)  # a peer cut last round is here: it was late, not gone
        self._cut, self._cut_by = frozenset(cut), used.window_s
        self._cut_published = {peer: self._published[peer] for peer in self._cut if peer in self._published}
        if due_members >= 2 and members and not cut:
            self.window.observe(wait_s)
        elif cut and members and due_arrival_s is not None:
            self.window.observe(due_arrival_s)  # the peers that came; a cut one proves itself next round
        if allreduce_timed_out:
            self.allreduce.censored(used.allreduce_s)
        elif allreduce_s is not None:
            self.allreduce.observe(allreduce_s)


def window_floor(request_timeout_s: float) -> float:
    """The shortest matchmaking window hivemind tolerates for ``request_timeout_s`` (it must exceed it)."""
    return 1.5 * request_timeout_s
