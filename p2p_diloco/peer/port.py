"""The swarm side of the round driver: :class:`SwarmPort` executes the round policy's actions on a real
swarm (the ``RoundPort`` of :mod:`p2p_diloco.core.round_driver`).

It reads and writes the swarm only through :class:`p2p_diloco.swarm.facade.Swarm` and tells listeners what
happens. The decisions are not here: which epochs, checksum votes and donors to believe is
:class:`p2p_diloco.core.evidence.Evidence`'s, fed with what this peer saw (``peer.view``); how a peer that is
behind catches up (live update, download, missed-round step, retries) is :mod:`p2p_diloco.core.sync`'s, which
alone loads what the catch-up's port (``peer.sync_port``) fetched, once verified. What is served to joiners,
and its digest, is ``peer.serving``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from p2p_diloco.core.delayed import RoundAggregate
from p2p_diloco.core.evidence import Evidence, outvoted
from p2p_diloco.core.lease import BufferLease
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.round_driver import Collected
from p2p_diloco.core.rounds import Observation, RoundResult
from p2p_diloco.core.sync import DOWNLOAD_ATTEMPTS, Catchup, SyncPolicy
from p2p_diloco.peer.eager import EagerOverlap
from p2p_diloco.peer.faults import FaultHooks
from p2p_diloco.peer.report import SessionListener
from p2p_diloco.peer.serving import StateServing
from p2p_diloco.peer.sync_port import SwarmSync
from p2p_diloco.peer.view import SwarmView
from p2p_diloco.swarm.facade import Swarm
from p2p_diloco.swarm.group import DEFAULT_MAX_ROUND_WEIGHT

__all__ = ["DOWNLOAD_ATTEMPTS", "SwarmPort", "capped"]

logger = logging.getLogger(__name__)


def capped(weight: float, max_round_weight: float | None) -> float:
    """Claim at most ``max_round_weight``: every member refuses (and bans) a claim above it, and work carried
    over many skipped rounds is still applied, only weighted as that much."""
    cap = max_round_weight or DEFAULT_MAX_ROUND_WEIGHT
    if weight > cap:
        logger.info("Claiming a weight of %.4g instead of %.4g: max_round_weight", cap, weight)
    return min(weight, cap)


class SwarmPort:
    """Executes rounds on ``swarm`` for the outer state ``state`` of the model's ``params``.

    Its parts: :attr:`view` (records, evidence, listeners), :attr:`serving` (what joiners download, its
    digest), :attr:`sync` (the catch-up's port) and :attr:`catchup` (``core.sync``, the outer state's writer
    when this peer is behind). :attr:`overlap` is the eager overlap (``--overlap eager``), set when the swarm
    has started (``SwarmSession.start``)."""

    def __init__(self, swarm: Swarm, state: OuterState, params: Sequence[torch.Tensor],
                 listeners: list[SessionListener], faults: FaultHooks, eager: bool,
                 evidence: Evidence | None = None) -> None:
        self.swarm, self.state, self.params = swarm, state, list(params)
        self.faults, self.eager = faults, eager
        self.view = SwarmView(swarm, listeners, evidence)
        self.evidence = self.view.evidence
        self.serving = StateServing(swarm, state, self.view)
        self.sync = SwarmSync(swarm, self.view, self.serving)
        self.catchup = Catchup(state, params, SyncPolicy(eager=eager), self.sync,
                               default_timeout_s=swarm.cfg.state_download_timeout_s)
        self.overlap: EagerOverlap | None = None

    # ------------------------------------------------------------------ RoundPort

    def swarm_epoch(self) -> int | None:
        """The largest epoch this peer believes (``Evidence.swarm_epoch``), not the largest anybody claims."""
        return self.view.swarm_epoch()

    def observe(self, epoch: int) -> Observation:
        with self.view.network():
            swarm_epoch = self.view.swarm_epoch()
        last = self.view.last_seen_others
        unseen = None if last is None else time_since(last)
        return Observation(epoch, swarm_epoch, self.view.peers_visible, unseen_s=unseen)

    def in_minority(self, epoch: int) -> bool:
        """Peers this one trusts (averaged with, or ``--trusted-peers``) published, by strict majority,
        another digest of parameters and momentum for ``epoch``; other ids' votes do not count."""
        with self.view.network():
            votes = self.evidence.trusted_votes(self.swarm.checksum_votes(epoch))
        return outvoted(votes, self.serving.state_digest())

    def averaging(self, epoch: int) -> None:
        self.view.notify("status", "averaging", epoch)

    def before_allreduce(self) -> None:
        self.faults.before_allreduce()

    def average(self, lease: BufferLease, weight: float, staleness: int, epoch: int,
                stale_weight: float) -> RoundResult:
        # the late work goes to the averager process as it is (shared, scaled there in place): the lease owns it
        delta, stale = lease.in_flight()
        cap = self.swarm.cfg.max_round_weight
        weight, stale_weight = capped(weight, cap), capped(stale_weight, cap)
        # the fresh mean stays in the averager's buffer: the driver applies it before the next round
        with self.view.network():
            result = self.swarm.average(delta, weight, staleness, epoch, stale, stale_weight, copy_out=False,
                                        left_behind=lambda window_open: self.view.left_behind(epoch, window_open),
                                        vouched=self.evidence.trusts)
        self.view.saw(result)
        return result

    def resync(self, min_epoch: int, timeout: float | None = None) -> bool:
        """Catch up with the swarm (``core.sync.Catchup``: the choice, the retries, the checks and the load)."""
        return self.catchup.run(min_epoch, timeout)

    def published(self, epoch: int, update: RoundAggregate | None = None) -> None:
        self.serving.published(self.eager, update)

    def collect(self, epoch: int, timeout: float) -> Collected:
        with self.view.network():
            got = self.overlap.collect(epoch, timeout)
        self.view.saw(got.result)
        return got

    def launch(self, delta: Sequence[torch.Tensor], weight: float, staleness: int, epoch: int,
               stale: Sequence[torch.Tensor] | None, stale_weight: float) -> bool:
        cap = self.swarm.cfg.max_round_weight
        return self.overlap.launch(delta, capped(weight, cap), staleness, epoch, stale=stale,
                                   stale_weight=capped(stale_weight, cap))

    def discard(self, why: str) -> None:
        if self.overlap is not None:
            self.overlap.discard(why)

    def lease(self) -> BufferLease | None:
        """A lease over the averager's shared fresh buffers (None while a round still holds them, or eager: the
        overlap copies into them itself). The last round's mean, served as its update, lives in these buffers
        whichever buffers that round's Δ was written to: it is withdrawn here, and again when the lease ends."""
        if self.eager:
            return None
        self._withdraw_update()
        buffers = self.swarm.fresh_buffers()
        return None if buffers is None else BufferLease(buffers, shared=True, on_release=self._withdraw_update)

    def _withdraw_update(self) -> None:
        with self.view.network():  # joiners fetching the served update finish first
            self.swarm.withdraw_update()

    def withdraw(self) -> None:
        self.serving.withdraw()


def time_since(moment: float) -> float:
    """Seconds since ``moment`` (``time.monotonic``)."""
    return time.monotonic() - moment
