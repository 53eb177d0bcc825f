"""What one peer sees of the swarm, and whom it believes: records, epoch claims, trusted speeds, listeners.

:class:`SwarmView` reads the swarm's progress records through :class:`p2p_diloco.swarm.facade.Swarm` and feeds
:class:`p2p_diloco.core.evidence.Evidence` with what this peer saw; the decisions (which epochs, votes, donors
and speeds to believe) are the evidence's. The round port (``peer.port``), the catch-up's port
(``peer.sync_port``) and the session share one view.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from p2p_diloco.core.dylu import phase_elapsed_s
from p2p_diloco.core.evidence import Claim, Evidence
from p2p_diloco.core.rounds import RoundResult
from p2p_diloco.peer.report import SessionListener
from p2p_diloco.swarm.facade import Swarm
from p2p_diloco.swarm.records import PeerProgress

logger = logging.getLogger(__name__)


class SwarmView:
    """The records this peer read last, the evidence it keeps, its listeners, and its time on the network."""

    def __init__(self, swarm: Swarm, listeners: list[SessionListener], evidence: Evidence | None = None) -> None:
        self.swarm = swarm
        self.listeners = listeners
        self.evidence = evidence or Evidence()
        """Whom this peer believes (``core.evidence``); its ``me`` is set in :meth:`start`."""
        self.claims: list[Claim] = []
        """The epoch claims of the records read last (non-client peers)."""
        self._records: list[PeerProgress] | None = None  # read by the last records()
        self.peers_visible = 0
        self.last_seen_others: float | None = None
        self.network_s = 0.0
        """Seconds spent in calls that talk to the swarm since the session last reset it (the round's
        overhead is the rest of ``end_round``)."""

    def start(self) -> None:
        self.evidence.me = self.swarm.peer_id

    def notify(self, method: str, *args: Any) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, method)(*args)
            except Exception:  # noqa: BLE001 - a display or metrics bug must not stop training
                logger.exception("listener %s.%s failed", type(listener).__name__, method)

    @contextlib.contextmanager
    def network(self) -> Iterator[None]:
        """Counts the time spent inside towards :attr:`network_s`."""
        began = time.monotonic()
        try:
            yield
        finally:
            self.network_s += time.monotonic() - began

    def records(self) -> list[PeerProgress]:
        """This run's and model's progress records; tracks who is visible and tells the listeners."""
        records = self._records = self.swarm.records()
        self.peers_visible = len(records)
        if any(r.peer_id != self.swarm.peer_id for r in records):
            self.last_seen_others = time.monotonic()
        self.claims = [Claim(r.peer_id, r.epoch) for r in records if not r.client_mode]
        self.notify("swarm", self.peers_visible, self.evidence.swarm_epoch(self.claims))
        return records

    def swarm_epoch(self) -> int | None:
        """The largest epoch this peer believes (``Evidence.swarm_epoch``), not the largest anybody claims."""
        self.records()
        return self.evidence.swarm_epoch(self.claims)

    def trusted_speeds(self) -> list[tuple[str, float]]:
        """``(peer id, steps/s)`` published by the trusted peers among this run's records: what DyLU may
        compare with. Untrusted speeds are free claims that would shrink everybody's H. The records are those
        the round's observation read last (read now only before the first): this runs on the training thread
        right before the inner phase, which must not wait on the DHT."""
        records = self._records if self._records is not None else self.records()
        return [(r.peer_id, r.steps_per_s) for r in records
                if r.peer_id != self.swarm.peer_id and r.steps_per_s > 0 and self.evidence.trusts(r.peer_id)]

    def trusted_or_none(self) -> frozenset[str] | None:
        """The peers whose donors and checksums this one trusts, ``None`` when none of them is online."""
        return self.evidence.trusted_or_none(c.peer_id for c in self.claims)

    def saw(self, result: RoundResult | None) -> None:
        """A complete all-reduce vouches for its members; members rejected in it are trusted no more."""
        if result is None:
            return
        for line in result.rejected:
            self.evidence.forget(line.split(":", 1)[0])
        if result.averaged:  # only members that carried weight are vouched for (Evidence.averaged_with)
            stale = result.stale_weights or (0.0,) * len(result.weights)
            carried = ([w + s for w, s in zip(result.weights, stale, strict=True)]
                       if len(stale) == len(result.weights) else [])  # misaligned: vouches for nobody
            self.evidence.averaged_with(result.contributors, carried)

    def left_behind(self, epoch: int, window_open: bool = False) -> bool:
        """Read the records again: has every peer this one believes moved past ``epoch`` (``Evidence.left_behind``)?
        A peer that missed its group then stops waiting for one; the round policy resyncs it next.

        ``window_open``: asked while this peer's matchmaking window is still open, where it must also find each
        of them finished that round (``Evidence.round_over``: their checksums of ``epoch + 1``, read only once
        the records already say they moved on)."""
        self.records()
        if not self.evidence.left_behind(self.claims, epoch):
            return False
        if not window_open:
            return True
        return self.evidence.round_over(self.claims, epoch, self.swarm.checksum_votes(epoch + 1))

    def phase_elapsed(self, epoch: int, floor_s: float) -> float:
        """How far the believed peers are into the inner phase of ``epoch`` (``core.dylu.phase_elapsed_s``
        of their records, read now), and never less than ``floor_s``, what this peer measured itself (records
        are claims: one can only make the phase look further along)."""
        with self.network():
            records = self.records()
        believed = {c.peer_id for c in self.evidence.believed(self.claims)} - {self.swarm.peer_id}
        elapsed = phase_elapsed_s((r.phase_s, r.age_s()) for r in records
                                  if r.epoch == epoch and r.peer_id in believed and not r.client_mode)
        return floor_s if elapsed is None else max(floor_s, elapsed)
