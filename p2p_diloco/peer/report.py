"""What a session tells the outside world: the per-round report and the listener interface.

Metrics (``monitoring.peer_metrics``), the terminal display (``monitoring.progress``) and the JSON-lines run
log consume these; they depend on nothing else in the session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from p2p_diloco.trainer import InnerStats


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


@dataclass
class LateWork:
    """A pseudo-gradient that missed its round, waiting to be folded into a later one."""

    delta: list[torch.Tensor]
    weight: float
    origin_epoch: int


@dataclass
class RoundReport:
    """What one round did, as written to the JSON-lines log."""

    epoch: int
    outcome: str
    reason: str = ""
    group_size: int = 0
    contributors: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    inner_steps: int = 0
    inner_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    wait_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    train_loss: float = float("nan")
    params_sha256: str = ""
    new_epoch: int = 0
    late_folded: int = 0
    """How many late contributions (any member's) this round applied."""
    rejected: list[str] = field(default_factory=list)
    """Hostile or unauthorised input rejected at receipt, as "peer id: reason"; those peers are banned."""
    rejected_records: dict[str, int] = field(default_factory=dict)
    """DHT records dropped since the last round, by kind (``swarm.signing``); ``record_bans`` lists the
    writers banned for a record they signed, as "peer id: reason"."""
    record_bans: list[str] = field(default_factory=list)
    blocked_seconds: float = 0.0
    """How long training waited for the network this round (the whole all-reduce when blocking; with eager
    overlap only the wait for the previous round's background all-reduce)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
