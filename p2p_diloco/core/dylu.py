"""Dynamic Local Updates (DyLU): slower peers run fewer inner steps so everyone finishes together.

A peer with speed ``v`` (inner steps per second) runs::

    steps = max(min_steps, floor(H · v / v_max))

where ``v_max`` is the fastest speed known (the peer's own included) and ``H`` is the step
count of the fastest peer (Liu et al., arXiv 2401.09135). A peer half as fast as the fastest
runs H/2 steps and reaches the all-reduce at about the same time, instead of arriving a
round late. Weight its pseudo-gradient by the samples it processed so the average is not
skewed by the shorter run.

Speeds come from other peers' reports, which are noisy (a checkpoint save, a slow data
shard, thermal throttling) and can be missing or stale. :class:`DyLU` therefore:

* smooths each peer's readings with an exponential moving average,
* ignores readings that are NaN, infinite, zero or negative,
* forgets peers not heard from in ``max_age_s``, so a fast peer that left the swarm does
  not keep everyone else on short rounds.

Time is injected (a ``clock`` callable or an explicit ``now``), so the class never sleeps and
is deterministic under test.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["DyLU", "late_start_steps", "phase_elapsed_s"]

logger = logging.getLogger(__name__)


@dataclass
class _SpeedEstimate:
    steps_per_s: float
    last_seen: float


class DyLU:
    """Per-peer speed estimates and the resulting number of local steps.

    Args:
        target_steps: H, the inner steps of the fastest peer (DiLoCo uses 500).
        min_steps: the floor (the reference notebook uses 5). A very slow peer still
            contributes a little; raise the floor if tiny rounds make its pseudo-gradient
            too noisy to be worth the all-reduce.
        alpha: EMA weight of a new reading, in (0, 1]. With one reading per round, 0.3
            forgets a reading's influence by half in about two rounds: steady against a
            single slow step, yet it follows a real change of hardware within a few rounds.
            Use 1.0 to trust the latest reading only.
        max_age_s: forget a peer not heard from for this long. Set it to a few round
            durations (three rounds is a good start): shorter and peers flap in and out of
            the estimate between reports, longer and a departed fast peer holds everyone
            back.
        clock: monotonic time source used when a method gets no explicit ``now``.
    """

    def __init__(
        self,
        target_steps: int,
        min_steps: int = 5,
        alpha: float = 0.3,
        max_age_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(target_steps, bool) or not isinstance(target_steps, int) or target_steps < 1:
            raise ValueError(f"target_steps must be an integer >= 1, got {target_steps!r}")
        if (
            isinstance(min_steps, bool)
            or not isinstance(min_steps, int)
            or not 1 <= min_steps <= target_steps
        ):
            raise ValueError(
                f"min_steps must be an integer in [1, target_steps={target_steps}], got {min_steps!r}"
            )
        if not (math.isfinite(alpha) and 0.0 < alpha <= 1.0):
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not (math.isfinite(max_age_s) and max_age_s > 0.0):
            raise ValueError(f"max_age_s must be finite and > 0, got {max_age_s}")
        self.target_steps = target_steps
        self.min_steps = min_steps
        self.alpha = float(alpha)
        self.max_age_s = float(max_age_s)
        self._clock = clock
        self._estimates: dict[str, _SpeedEstimate] = {}

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else float(now)

    def observe(self, peer_id: str, steps_per_s: float, now: float | None = None) -> bool:
        """Fold one speed reading into ``peer_id``'s estimate; returns False if it was ignored."""
        now = self._now(now)
        self.prune(now)
        if not (isinstance(steps_per_s, (int, float)) and math.isfinite(steps_per_s) and steps_per_s > 0):
            logger.debug("ignoring speed reading %r from peer %s", steps_per_s, peer_id)
            return False
        estimate = self._estimates.get(peer_id)
        if estimate is None:
            self._estimates[peer_id] = _SpeedEstimate(float(steps_per_s), now)
        else:
            estimate.steps_per_s += self.alpha * (float(steps_per_s) - estimate.steps_per_s)
            estimate.last_seen = now
        return True

    def prune(self, now: float | None = None) -> list[str]:
        """Forget peers not heard from in ``max_age_s``; returns their ids."""
        now = self._now(now)
        expired = [pid for pid, est in self._estimates.items() if now - est.last_seen > self.max_age_s]
        for peer_id in expired:
            del self._estimates[peer_id]
        if expired:
            logger.debug("forgot speeds of %d silent peers", len(expired))
        return expired

    def forget(self, peer_id: str) -> None:
        """Drop a peer at once (e.g. it announced it is leaving)."""
        self._estimates.pop(peer_id, None)

    def speed(self, peer_id: str, now: float | None = None) -> float | None:
        """Smoothed speed of a peer, or None if unknown or aged out."""
        self.prune(now)
        estimate = self._estimates.get(peer_id)
        return None if estimate is None else estimate.steps_per_s

    def speeds(self, now: float | None = None) -> dict[str, float]:
        """All current smoothed speeds."""
        self.prune(now)
        return {pid: est.steps_per_s for pid, est in self._estimates.items()}

    def fastest(self, my_speed: float | None = None, now: float | None = None) -> float | None:
        """v_max over the known peers and ``my_speed``; None when nothing valid is known."""
        candidates = list(self.speeds(now).values())
        if my_speed is not None and math.isfinite(my_speed) and my_speed > 0:
            candidates.append(float(my_speed))
        return max(candidates) if candidates else None

    def local_steps(self, my_speed: float | None, now: float | None = None) -> int:
        """Inner steps for a peer of speed ``my_speed``: ``max(min_steps, floor(H·v/v_max))``.

        Pass the peer's own smoothed speed (observe yourself under your id, then use
        :meth:`speed`). Without a valid own speed (the first round) this returns H: the
        peer behaves like plain DiLoCo until it has measured itself.
        """
        if my_speed is None or not math.isfinite(my_speed) or my_speed <= 0:
            return self.target_steps
        v_max = self.fastest(my_speed, now)
        assert v_max is not None  # my_speed itself is a valid candidate
        # H * (v / v_max) rather than (H * v) / v_max: the ratio is exactly 1.0 for the fastest
        # peer, so it gets exactly H steps with no rounding down to H - 1.
        steps = math.floor(self.target_steps * (float(my_speed) / v_max))
        return max(self.min_steps, min(self.target_steps, steps))


PHASE_RECORD_MAX_AGE_S = 60.0
"""The most seconds of a progress record's age that :func:`phase_elapsed_s` counts (see there)."""


def phase_elapsed_s(records: Iterable[tuple[float, float]], max_age_s: float = PHASE_RECORD_MAX_AGE_S
                    ) -> float | None:
    """How far the swarm is into the inner phase of one epoch, for a peer that just loaded that epoch's state.

    ``records`` holds one ``(phase_s, age_s)`` per peer at that epoch: the peer had trained ``phase_s``
    seconds of the phase when it wrote its progress record, ``age_s`` seconds ago. The answer is the median of
    ``phase_s + age_s``; ``None`` without records.

    Why records and not the download time: a joiner measured only its download, but the swarm began the
    phase before the download started (measured on the testbed at 2 Mbit/s: 35 s of download, 46 s behind),
    so it planned too many steps, reached the all-reduce after the group had formed, and resynced instead of
    contributing. Arriving early costs a wait in matchmaking; arriving late costs the round.

    Both numbers are claims and the age rests on the writer's clock, so the age counts only within
    ``[0, max_age_s]``: a training peer rewrites its record every few seconds, and one whose record is
    older has finished its phase and waits for its group, so the phase is over either way. The median
    keeps a minority of false records from moving the answer, but a new joiner believes only the donor it
    loaded from, so the caller also takes the larger of this and what it measured itself (the download time,
    a lower bound: the donors served the state from the start of their phase). A liar can then only make the
    phase look further along: this peer plans fewer steps, arrives early and waits for its group
    (``swarm.quorum.EarlyAssembly`` lets it follow), losing part of one phase's work, never the round.
    """
    totals = sorted(float(phase) + min(max(float(age), 0.0), max_age_s) for phase, age in records
                    if math.isfinite(phase) and phase >= 0 and math.isfinite(age))
    return statistics.median(totals) if totals else None


LATE_START_AIM = 0.5
"""The share of the swarm's remaining phase that a late starter plans to fill with steps (:func:`late_start_steps`)."""


def late_start_steps(steps: int, late_s: float, speed: float | None, min_steps: int,
                     aim: float = LATE_START_AIM) -> int:
    """Steps for a round that starts ``late_s`` seconds after the swarm's (a joiner, a peer that resynced).

    The others began their inner phase before this peer had their state; running the full ``steps`` would
    bring it to the all-reduce ``late_s`` after them, behind again, and a peer that downloads every round
    never contributes fresh work. ``steps - late_s * speed`` is what the others have left; this peer plans
    ``aim`` of that. ``late_s`` is :func:`phase_elapsed_s` of the peers' progress records, or the download
    time when no record says. Without a speed estimate nothing changes.

    Why only half (``aim = 0.5``): ``speed`` is the others' speed, not this peer's (it has not trained yet),
    and the costs are lopsided. Arriving early costs the rest of the phase in matchmaking, once. Arriving
    after the group formed costs the round's work and another download. On the testbed a joiner that
    planned the whole remainder (202 steps at the donors' 14.4 steps/s) ran at 9.6 steps/s beside them on a
    shared CPU and reached matchmaking 1 s after the window closed.
    """
    if speed is None or not math.isfinite(speed) or speed <= 0 or not late_s > 0:
        return steps
    left = steps - late_s * speed
    return max(min_steps, min(steps, math.floor(left * aim)))
