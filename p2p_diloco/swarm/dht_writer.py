"""DHT stores on a thread of their own, so the training thread never waits on the DHT to publish.

A store asks the DHT's k nearest nodes to keep a record and waits for their answers: on a healthy swarm tens
of milliseconds, on a lossy one up to ``records._DHT_TIMEOUT_S`` (30 s). A peer publishes its progress every
few seconds during the inner phase (``session.PROGRESS_EVERY_S``) and its checksum after each round; waiting
there stalls training for as long as the slowest DHT node takes. ``DhtWriter`` takes each store as a closure
under a *slot* name and returns at once; one background thread runs them in order. A newer store under the
same slot replaces one still waiting (only the latest progress record matters), so a slow DHT delays what is
published, never the caller, and the backlog is bounded by the number of slots (``MAX_SLOTS``; beyond it the
oldest waiting store is dropped with a warning).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

logger = logging.getLogger(__name__)

MAX_SLOTS = 256
"""Stores waiting at most (one per slot: the progress record, a checksum per epoch; with F fragments, F + 1
progress records and a checksum per fragment round: at the largest F, 64, about 130)."""


class DhtWriter:
    """Runs submitted DHT stores on a background thread (see the module docstring).

    :param name: the thread's name (shown in stack dumps).
    """

    def __init__(self, name: str = "dht-writer") -> None:
        self._pending: OrderedDict[str, Callable[[], object]] = OrderedDict()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, slot: str, store: Callable[[], object]) -> None:
        """Run ``store()`` soon, on the writer's thread, replacing a store of ``slot`` still waiting. Returns at
        once; ``store``'s exceptions are logged, never raised. Dropped after :meth:`close`."""
        with self._cond:
            if self._closed:
                return
            self._pending.pop(slot, None)
            self._pending[slot] = store
            while len(self._pending) > MAX_SLOTS:
                dropped, _ = self._pending.popitem(last=False)
                logger.warning("DHT writer backlog full: dropped the waiting store of %s", dropped)
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every submitted store ran; whether they all did."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Run what is waiting for up to ``timeout`` seconds, then stop (stores still waiting are dropped)."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()
        self._thread.join(timeout=max(0.0, timeout))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                slot, store = self._pending.popitem(last=False)
                self._busy = True
            try:
                store()
            except Exception as e:  # noqa: BLE001 - a missed publication must not stop the writer
                logger.warning("DHT store of %s failed: %r", slot, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
