"""The network side of a catch-up (``core.sync.SyncPort``) on a real swarm.

:class:`SwarmSync` fetches (a verified state download, a round update whose chunks matched their manifest:
``swarm.state``, ``swarm.catchup``), hashes candidate states and reads votes. It never writes the outer state:
``core.sync.Catchup`` decides which way to catch up, checks what this returns, and loads it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from p2p_diloco.core.sync import Digest
from p2p_diloco.peer.serving import StateServing
from p2p_diloco.peer.view import SwarmView
from p2p_diloco.swarm.catchup import SwarmUpdate, implausible
from p2p_diloco.swarm.checksum import TensorManifest, state_sha256, tensor_manifest
from p2p_diloco.swarm.facade import Swarm
from p2p_diloco.swarm.state import SwarmState

logger = logging.getLogger(__name__)


class SwarmSync:
    """``core.sync.SyncPort`` over ``swarm``, reporting to ``view`` and serving through ``serving``."""

    def __init__(self, swarm: Swarm, view: SwarmView, serving: StateServing) -> None:
        self.swarm, self.view, self.serving = swarm, view, serving
        self.late_start_s = 0.0
        """How far the swarm was into its inner phase when this peer last loaded its state (the next phase is
        shortened by that much; ``core.dylu.late_start_steps``)."""

    def swarm_epoch(self) -> int | None:
        return self.view.swarm_epoch()

    def trusted(self) -> frozenset[str] | None:
        return self.view.trusted_or_none()

    def syncing(self, min_epoch: int) -> None:
        self.view.notify("status", "syncing", min_epoch)
        self.serving.withdraw_for_sync()

    def resume_serving(self) -> None:
        self.serving.serve_known()

    def serve(self, manifest: TensorManifest | None) -> None:
        self.serving.serve_loaded(manifest)

    def base_digest(self) -> str:
        return self.serving.base_sha or self.serving.state_digest()

    def fetch_update(self, params: Sequence[torch.Tensor], base_sha: str, epoch: int, timeout: float,
                     trusted: frozenset[str] | None) -> SwarmUpdate | None:
        with self.view.network():
            return self.swarm.download_update(params, base_sha, epoch, timeout, trusted=trusted)

    def download(self, min_epoch: int, timeout: float, trusted: frozenset[str] | None,
                 backed: dict[str, int]) -> SwarmState | None:
        with self.view.network():
            return self.swarm.download(self.serving.state.anchors, min_epoch, timeout, trusted=trusted,
                                       backed=backed)

    def received(self, ok: bool) -> None:
        self.view.notify("state_transfer", "received", ok)

    def digest(self, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> Digest:
        problem = implausible(params) or implausible(momentum)
        manifest = tensor_manifest(params)
        return Digest(state_sha256(params, momentum, params_sha=manifest.sha), manifest, problem)

    def votes(self, epoch: int) -> dict[str, str]:
        with self.view.network():
            return self.swarm.checksum_votes(epoch)

    def credit(self, delivered: dict[str, int] | None, trusted: frozenset[str] | None) -> str | None:
        return self.view.evidence.loaded(delivered or {}, trusted)

    def unbacked(self, min_epoch: int, backed: dict[str, int]) -> dict[str, float]:
        claims = self.view.claims
        if backed:
            self.view.records()  # did the donors that stopped midway move on? (their records now say)
        return self.view.evidence.unbacked(claims, min_epoch, served=backed, now=self.view.claims)

    def started_late(self, epoch: int, floor_s: float) -> None:
        self.late_start_s = self.view.phase_elapsed(epoch, floor_s=floor_s)
