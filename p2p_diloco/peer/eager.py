"""Eager overlap: round t's all-reduce runs in a background thread while round t+1's inner steps train.

The session drives it once per round, at the end of each inner phase::

    prev = overlap.collect(epoch - 1, timeout)    # round t-1's average, or None
    overlap.launch(delta, weight, epoch, ...)     # round t's all-reduce, in the background
    state.apply_eager(delta, prev avg or None)    # the core's eager rule (p2p_diloco.core.eager)

Rules that keep it safe:

* **One average at a time.** ``RoundAverager`` owns one pair of shared buffers, so a new round is launched
  only when the previous thread has finished; otherwise this round's work is not sent (it still moves this
  peer through its own term, and the next round steps with the own term only).
* **Bounded wait.** ``collect`` waits at most ``timeout`` seconds (the session passes about one inner
  phase), so training is never held up by more than one round; a round still running then is "late".
* **Never a partial as a full.** Only a result whose every member confirmed a complete all-reduce, for exactly
  the epoch asked for, and that holds this peer's own contribution, is returned. Late, failed, partial or
  discarded rounds give ``None``: the eager rule then steps with the own term only (``Δ(t-1)`` unknown).

The thread itself does almost no work: the all-reduce runs in the averager's process, and the thread only
waits for its answer, so it costs the training loop nothing but a copy of the pseudo-gradient.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from p2p_diloco.swarm import RoundAverager
from p2p_diloco.swarm.result import RoundResult

if TYPE_CHECKING:
    from p2p_diloco.peer.report import RoundReport
    from p2p_diloco.peer.session import SwarmSession

logger = logging.getLogger(__name__)


@dataclass
class Collected:
    """What ``collect`` found for the round it was asked about."""

    result: RoundResult | None
    """The complete round's result, or None when there is nothing to apply."""
    reason: str
    """Why there is nothing to apply (empty when ``result`` is set)."""
    waited_s: float
    """How long the caller was blocked waiting for it."""
    folded_stale: bool = False
    """The round carried this peer's late work, and it went in."""


class _Round:
    """One ``RoundAverager.average`` call on a daemon thread."""

    def __init__(self, averager: RoundAverager, epoch: int, args: tuple, kwargs: dict) -> None:
        self.epoch = epoch
        self.carried_stale = kwargs.get("stale") is not None
        self.launched_at = time.monotonic()
        self.result: RoundResult | None = None
        self.discarded = ""
        self._thread = threading.Thread(target=self._run, args=(averager, args, kwargs),
                                        name=f"eager-allreduce-{epoch}", daemon=True)
        self._thread.start()

    def _run(self, averager: RoundAverager, args: tuple, kwargs: dict) -> None:
        try:
            self.result = averager.average(*args, **kwargs)
            logger.info("Background all-reduce of epoch %d: %s after %.1f s (matchmaking %.1f s, all-reduce %.1f s)%s",
                        self.epoch, self.result.outcome, time.monotonic() - self.launched_at,
                        self.result.wait_seconds, self.result.allreduce_seconds,
                        f": {self.result.reason}" if self.result.reason else "")
        except Exception as e:  # noqa: BLE001 - any failure is a skipped round, reported to the caller
            logger.warning("Background all-reduce of epoch %d failed: %r", self.epoch, e)
            self.result = RoundResult("skipped", f"background all-reduce raised {e!r}", self.epoch)

    def join(self, timeout: float) -> bool:
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


class EagerOverlap:
    """Runs at most one background all-reduce and hands back its result only when it is complete."""

    def __init__(self, averager: RoundAverager, peer_id: str) -> None:
        self.averager = averager
        self.peer_id = peer_id
        self._round: _Round | None = None

    @property
    def busy(self) -> bool:
        """A background all-reduce is still running (a new one cannot start)."""
        return self._round is not None and self._round.running

    def launch(self, delta: Sequence[torch.Tensor], weight: float, staleness: int, epoch: int,
               stale: Sequence[torch.Tensor] | None = None, stale_weight: float = 0.0) -> bool:
        """Start round ``epoch``'s all-reduce of ``delta`` (copied first); False if the previous one still runs."""
        if self.busy:
            logger.warning("Not sending the work of epoch %d: the all-reduce of epoch %d is still running",
                           epoch, self._round.epoch)
            return False
        fresh = [t.detach().clone() for t in delta]
        stale_copy = [t.detach().clone() for t in stale] if stale is not None else None
        self._round = _Round(self.averager, epoch, (fresh, weight, staleness, epoch),
                             dict(stale=stale_copy, stale_weight=stale_weight))
        return True

    def collect(self, epoch: int, timeout: float) -> Collected:
        """Round ``epoch``'s complete result, waiting at most ``timeout`` s; see the module docstring."""
        started = time.monotonic()
        current = self._round
        if current is None:
            return Collected(None, "no all-reduce was launched for the previous round", 0.0)
        if current.epoch != epoch or current.discarded:
            if not current.running:
                self._round = None
            why = current.discarded or f"the last one launched was for epoch {current.epoch}"
            return Collected(None, f"no usable all-reduce of epoch {epoch}: {why}", 0.0)
        finished = current.join(timeout)
        waited = time.monotonic() - started
        if not finished:
            # Keep the handle: the thread still owns the averager's buffers, so the next launch must wait.
            current.discarded = f"the all-reduce of epoch {epoch} was late"
            return Collected(None, f"the all-reduce of epoch {epoch} was still running after {waited:.1f} s of "
                                   "waiting (late by more than one round)", waited)
        self._round = None
        result = current.result
        if result is None or not result.averaged or result.fresh_mean is None:
            reason = result.reason if result is not None else "no result"
            return Collected(None, f"the all-reduce of epoch {epoch} did not complete: {reason}", waited)
        if self.peer_id not in result.contributors:
            return Collected(None, f"the all-reduce of epoch {epoch} did not include this peer", waited)
        return Collected(result, "", waited, folded_stale=current.carried_stale)

    def discard(self, why: str) -> None:
        """Forget the running round's result (e.g. after a state download it belongs to a state we left)."""
        if self._round is not None:
            self._round.discarded = why

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a running all-reduce, so the averager shuts down between rounds."""
        if self._round is not None:
            self._round.join(timeout)
            self._round.discarded = "the peer is shutting down"


def own_share(result: RoundResult, peer_id: str) -> float:
    """This peer's weight fraction in ``result``'s fresh mean (the eager rule's own-term factor)."""
    index = result.contributors.index(peer_id)
    total = sum(result.weights)
    return result.weights[index] / total if total > 0 else 1.0 / max(1, result.group_size)


def group_average(result: RoundResult) -> list[torch.Tensor]:
    """The round's full aggregate Δ(t-1): the fresh mean plus any folded late work's term."""
    if result.stale_term is None:
        return list(result.fresh_mean)
    return [f + s for f, s in zip(result.fresh_mean, result.stale_term, strict=True)]


def eager_round(session: SwarmSession, delta: list[torch.Tensor], weight: float, report: RoundReport,
                inner_seconds: float) -> None:
    """The end of an inner phase with ``--overlap eager``: collect, launch, eager outer step."""
    overlap = session.overlap
    epoch = session.epoch
    session._notify("status", "averaging", epoch)
    # Wait for the previous round at most one inner phase, and never less than the matchmaking window:
    # a round shorter than that window cannot hide an all-reduce anyway.
    got = overlap.collect(epoch - 1, max(inner_seconds, session.cfg.swarm.matchmaking_time_s))
    report.blocked_seconds = got.waited_s
    if got.folded_stale:
        session.late = None
    if session.faults:
        session.faults.before_allreduce()
    stale, stale_weight, staleness = session._late_for_round()

    result = got.result
    share = own_share(result, session.peer_id) if result is not None else 0.0
    if result is not None and session.state.eager.has_previous and share > 0.0:
        session.state.apply_eager(delta, group_average(result), result.group_size, session.params,
                                  own_share=share)
        report.outcome = "folded_late" if got.folded_stale else "averaged"
        report.group_size, report.contributors = result.group_size, list(result.contributors)
        report.weights = [w + s for w, s in zip(result.weights, result.stale_weights, strict=True)]
        report.staleness = list(result.stalenesses)
        report.allreduce_seconds, report.wait_seconds = result.allreduce_seconds, result.wait_seconds
        report.bytes_sent, report.bytes_received = result.bytes_sent, result.bytes_received
        report.late_folded = sum(1 for s in result.stalenesses if s > 0)
    else:
        # Δ(t-1) unknown: the eager rule with Δ(t-1) = 0, i.e. this peer's own share of its fresh work.
        session.state.apply_eager(delta, None, max(1, session.peers_visible), session.params)
        report.outcome = "own_only"
        report.reason = got.reason if result is None else "no own term stored for the previous round"
    session.continue_local, session.carry_weight = False, 0.0
    session._serve_state()
    # Launch last: serving the new state talks to the averager process over the same pipe as the round's
    # start, and a multiprocessing pipe must not be written from two threads at once.
    if not overlap.launch(delta, weight, staleness, epoch, stale=stale, stale_weight=stale_weight):
        report.reason = (report.reason + "; " if report.reason else "") + (
            f"the work of epoch {epoch} was not sent: the previous all-reduce still runs")
