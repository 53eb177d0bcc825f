"""Eager overlap: round t's all-reduce runs in a background thread while round t+1's inner steps train.

The round driver (:class:`p2p_diloco.core.round_driver.RoundDriver`, action ``EAGER``) uses it through the
session's port once per round, at the end of each inner phase::

    prev = overlap.collect(epoch - 1, timeout)    # round t-1's average, or None
    state.apply_eager(delta, prev avg or None)    # the core's eager rule (p2p_diloco.core.eager)
    overlap.launch(delta, weight, epoch, ...)     # round t's all-reduce, in the background

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
waits for its answer, so it costs the training loop one copy of the pseudo-gradient into the averager's
shared buffer. The average comes back as a view of that buffer (no copy), which the round applies before it
launches the next all-reduce into the same buffer. Memory beyond a blocking peer: the own term of the last
round (``core.eager``, 4 bytes/param) and the pseudo-gradient the round computes beside the buffer (4).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

from p2p_diloco.core.round_driver import Collected
from p2p_diloco.core.rounds import Outcome, RoundResult
from p2p_diloco.swarm.facade import Swarm

logger = logging.getLogger(__name__)


class _Round:
    """One ``Swarm.average`` call on a daemon thread."""

    def __init__(self, averager: Swarm, epoch: int, args: tuple, kwargs: dict) -> None:
        self.epoch = epoch
        self.carried_stale = kwargs.get("stale") is not None
        self.launched_at = time.monotonic()
        self.result: RoundResult | None = None
        self.discarded = ""
        self._thread = threading.Thread(target=self._run, args=(averager, args, kwargs),
                                        name=f"eager-allreduce-{epoch}", daemon=True)
        self._thread.start()

    def _run(self, averager: Swarm, args: tuple, kwargs: dict) -> None:
        try:
            self.result = averager.average(*args, **kwargs)
            logger.info("Background all-reduce of epoch %d: %s after %.1f s (matchmaking %.1f s, all-reduce %.1f s)%s",
                        self.epoch, self.result.outcome, time.monotonic() - self.launched_at,
                        self.result.wait_seconds, self.result.allreduce_seconds,
                        f": {self.result.reason}" if self.result.reason else "")
        except Exception as e:  # noqa: BLE001 - any failure is a skipped round, reported to the caller
            logger.warning("Background all-reduce of epoch %d failed: %r", self.epoch, e)
            self.result = RoundResult(Outcome.SKIPPED, f"background all-reduce raised {e!r}", self.epoch)

    def join(self, timeout: float) -> bool:
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


class EagerOverlap:
    """Runs at most one background all-reduce and hands back its result only when it is complete."""

    def __init__(self, averager: Swarm, peer_id: str) -> None:
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
        # Written into the averager's shared buffer, which the all-reduce reads in place: no copy of the work
        # lives beside it for the round. The previous round's average was read from the same buffer (a view,
        # ``copy_out=False``), and the caller applied it before this launch.
        shared = self.averager.fresh_buffers()
        if shared is not None:
            for dst, src in zip(shared, delta, strict=True):
                dst.copy_(src.detach())
            fresh = shared
        else:  # still locked: a round whose host side gave up (its budget ran out) may still run in the process
            fresh = [t.detach().clone() for t in delta]
        stale_copy = [t.detach().clone() for t in stale] if stale is not None else None
        self._round = _Round(self.averager, epoch, (fresh, weight, staleness, epoch),
                             dict(stale=stale_copy, stale_weight=stale_weight, copy_out=False))
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
