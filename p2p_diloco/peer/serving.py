"""Serving this peer's anchors and momentum to joiners, and the digest peers compare.

:class:`StateServing` hashes the anchors once per new state (``swarm.checksum``), hands them (no copy) to the
swarm's state server, and withdraws them before anything changes them: a download being served ends first,
and a checkpoint being written from the live anchors finishes first (``SwarmSession.save_in_background``).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from p2p_diloco.core.delayed import RoundAggregate
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.peer.view import SwarmView
from p2p_diloco.swarm.checksum import TensorManifest, state_sha256, tensor_manifest
from p2p_diloco.swarm.facade import Swarm
from p2p_diloco.swarm.state_server import ServedUpdate

logger = logging.getLogger(__name__)


class StateServing:
    """What this peer serves, and its digest; reads the outer state, never writes it."""

    def __init__(self, swarm: Swarm, state: OuterState, view: SwarmView) -> None:
        self.swarm, self.state, self.view = swarm, state, view
        self.manifest: TensorManifest | None = None
        """The anchors' manifest as served now (None while they change): hashed once per new state."""
        self.state_sha: str | None = None
        """``checksum.state_sha256`` of anchors and momentum as served now (None while they change)."""
        self.base_sha: str | None = None
        """The digest of the state the last outer step started from (the served update's base)."""
        self.known: TensorManifest | None = None
        """The manifest served before a catch-up began (served again if the catch-up fails)."""
        self.writer: threading.Thread | None = None
        """A checkpoint being written from the live anchors (``peer.resume.CheckpointWriter``)."""
        self.voted_epoch: int | None = None
        """The epoch whose checksum this peer published last (``serve(checksum=True)``), None before any."""
        self._zeros: list[torch.Tensor] | None = None

    def wait_writer(self) -> None:
        """Let a checkpoint being written from the live anchors finish (before they change)."""
        if self.writer is not None:
            began = time.monotonic()
            self.writer.join()
            if time.monotonic() - began > 1.0:
                logger.info("Waited %.1f s for the checkpoint being written", time.monotonic() - began)
            self.writer = None

    def withdraw(self) -> None:
        """The anchors are about to change: stop serving them (a checkpoint being written finishes first)."""
        self.wait_writer()
        with self.view.network():  # waits only for downloads being served
            self.swarm.withdraw()
        self.base_sha = self.state_sha  # the state the next outer step starts from (its update's base)
        self.manifest = self.state_sha = None

    def withdraw_for_sync(self) -> None:
        """A peer that is behind has nothing worth serving (joiners refuse states older than the swarm's): stop
        serving before a download, and drop the zeros kept for serving, so that the downloaded state does not
        sit beside them. What was served is remembered for :meth:`serve_known`."""
        self.known = self.manifest
        self.withdraw()
        self._zeros = None

    def serve_known(self) -> None:
        """A catch-up failed: serve the unchanged state again."""
        self.serve(checksum=False, manifest=self.known)

    def published(self, eager: bool, update: RoundAggregate | None = None) -> None:
        """Serve a new state after an outer step (its checksum published unless eager: eager peers' parameters
        differ by their own terms by design); ``update``: the swarm round's aggregate that led here."""
        served = None
        if update is not None and not eager and self.base_sha is not None:
            served = ServedUpdate(self.base_sha, update.fresh_mean, update.stale_term)
        self.serve(checksum=not eager, update=served)

    def serve_loaded(self, manifest: TensorManifest | None) -> None:
        """Serve a verified state a catch-up just loaded (``manifest``: its anchors', from the download).

        Its checksum is published only when it replaces a state of the epoch whose checksum this peer published
        last: that vote named parameters this peer no longer holds. Why: peers that trust this one weigh its vote
        above any donor's. In a mixed NAT run, a peer resynced to the majority's state of the epoch it had voted
        for, and a peer whose one trusted peer it was refused the majority's state on the stale vote for the rest
        of the run. Any other loaded state gets no vote (its epoch is the swarm's, not one this peer averaged)."""
        self.serve(checksum=self.voted_epoch is not None and self.voted_epoch == self.state.epoch, manifest=manifest)

    def serve(self, *, checksum: bool, manifest: TensorManifest | None = None,
              update: ServedUpdate | None = None) -> None:
        """Serve the current anchors and momentum to joiners (and publish their checksum if asked). The anchors
        are hashed here, once per state (``manifest`` when already known, e.g. a verified download's); the
        digest peers compare adds one pass over the momentum (``checksum.state_sha256``)."""
        momentum = self.momentum()
        # the round's one hash pass over the anchors
        self.manifest = manifest if manifest is not None else tensor_manifest(self.state.anchors)
        with self.view.network():
            self.state_sha = self.swarm.serve(self.state.anchors, momentum, self.state.epoch, checksum=checksum,
                                              manifest=self.manifest, update=update)
        if checksum:
            self.voted_epoch = self.state.epoch

    def momentum(self) -> list[torch.Tensor]:
        """The outer momentum as served and checksummed: zeros where the optimizer keeps none (before the
        first outer step, or FedAvg), allocated once."""
        buffers = self.state.outer.momentum_buffers()
        if all(m is not None for m in buffers):
            self._zeros = None
            return list(buffers)
        if self._zeros is None:
            self._zeros = [torch.zeros_like(a) for a in self.state.anchors]
        return [m if m is not None else z for m, z in zip(buffers, self._zeros, strict=True)]

    def anchors_sha(self) -> str:
        """The anchors' sha256 (hashed when they were last served)."""
        if self.manifest is None:
            self.manifest = tensor_manifest(self.state.anchors)
        return self.manifest.sha

    def state_digest(self) -> str:
        """The digest of anchors and momentum that peers publish and compare (computed when last served)."""
        if self.state_sha is None:
            self.state_sha = state_sha256(self.state.anchors, self.momentum(), params_sha=self.anchors_sha())
        return self.state_sha
