"""What a session tells the outside world: the per-round report (built by the core's round driver) and the
listener interface.

Metrics (``monitoring.peer_metrics``), the terminal display (``monitoring.progress``) and the JSON-lines run
log consume these; they depend on nothing else in the session.
"""

from __future__ import annotations

from p2p_diloco.core.rounds import Outcome, RoundReport
from p2p_diloco.inner_stats import InnerStats

__all__ = ["Outcome", "RoundReport", "SessionListener"]


class SessionListener:
    """Receives what the session does; metrics, the terminal display and tests subclass it.

    Every method has a no-op default, so a listener implements only what it needs. Methods run on the
    training thread: keep them cheap and never raise.
    """

    def status(self, phase: str, epoch: int) -> None:
        """Phase changes: training, matchmaking/averaging, syncing."""

    def inner_step(self, step: int, total: int, loss: float, epoch: int) -> None:
        """After every inner step; ``total`` is this phase's DyLU step count."""

    def round(self, report: RoundReport, stats: InnerStats) -> None:
        """After every round, with what it did."""

    def swarm(self, peers_visible: int, swarm_epoch: int | None) -> None:
        """Whenever the session read the swarm's progress records."""

    def state_transfer(self, direction: str, ok: bool) -> None:
        """A state download: direction 'received' (ok or not)."""
