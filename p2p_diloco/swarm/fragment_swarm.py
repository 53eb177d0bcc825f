"""One fragment's view of the swarm (Streaming DiLoCo, ``core.fragments``): what that fragment's rounds talk to.

A peer with F fragments runs F round drivers, each over its own ``peer.port.SwarmPort``; each port talks to a
:class:`FragmentSwarm` instead of the whole :class:`~p2p_diloco.swarm.facade.Swarm`. Why a view and not F swarms:
the fragments share one DHT node, one averager process and one buffer of the largest fragment's size
(``swarm.buffer_layout``); what is per fragment is only the namespace of what is decided per fragment:

- **records**: each peer publishes one progress record per fragment, under the fragment's namespace
  (``records.fragment_records_id``), with that fragment's epoch. So who is due in a fragment's round, the
  fragment's swarm epoch and every claim the evidence weighs are read exactly as for a whole round, from
  records whose epoch is the fragment's; nothing maps one number onto F epochs (a peer whose fragments are
  not in step, after a skipped round, would be misread).
- **checksum votes**: after a fragment's round a peer publishes the digest of that fragment's state (anchors
  and momentum) under the fragment's namespace and epoch; the vote and a minority's resync are per fragment.
- **served state**: a donor serves each fragment's state as its own (its manifest asked for by
  ``chunk_transfer.fragment_selector``), so a fragment left behind downloads 8/F bytes per parameter, not the
  model's 8, and a joiner downloads each fragment at its own epoch.
- **rounds**: the averager's round of this fragment (``RoundAverager.average(..., fragment=f)``), with the due
  peers of this fragment's records.

Chosen over F averager processes: those would hold F buffers adding up to the whole model and run F
matchmakings per peer; over one record carrying all F epochs: the record's schema would change (every peer
of today's protocol would ban the new field as malformed), where a namespace per fragment reuses it as is.
Cost: F progress records per publication instead of one (at most every 5 s, and after each round).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from p2p_diloco.core.rounds import RoundResult
from p2p_diloco.swarm.catchup import SwarmUpdate
from p2p_diloco.swarm.checksum import TensorManifest
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.facade import Swarm
from p2p_diloco.swarm.records import PeerProgress
from p2p_diloco.swarm.state import SwarmState
from p2p_diloco.swarm.state_server import ServedUpdate

__all__ = ["FragmentSwarm"]


class FragmentSwarm:
    """Fragment ``fragment`` of ``swarm``: the part of :class:`~p2p_diloco.swarm.facade.Swarm`'s interface a
    ``SwarmPort`` uses, each call scoped to the fragment (see the module docstring). Every method is bounded in
    time and never raises for network trouble, as the swarm's."""

    def __init__(self, swarm: Swarm, fragment: int) -> None:
        if not swarm.layout.flat:
            raise ValueError("this swarm has no fragments")
        self.swarm, self.fragment = swarm, swarm.layout.check_fragment(fragment)
        self.records_id = swarm.fragment_ids[fragment]
        self._seen: list[PeerProgress] = []
        """The fragment's records :meth:`records` read last: who is due in its next round."""

    @property
    def cfg(self) -> SwarmConfig:
        return self.swarm.cfg

    @property
    def peer_id(self) -> str:
        return self.swarm.peer_id

    @property
    def served(self) -> int:
        return self.swarm.served

    def records(self) -> list[PeerProgress]:
        """The fragment's progress records (each peer's epoch of this fragment); when the DHT does not answer in
        time, those read last."""
        fetched = self.swarm.read_records(self.records_id)
        if fetched is not None:
            self._seen = fetched
        return list(self._seen)

    def checksum_votes(self, epoch: int) -> dict[str, str]:
        """Digests of this fragment's state at its ``epoch``: peer id -> digest."""
        return self.swarm.checksum_votes(epoch, records_id=self.records_id)

    def average(self, delta: Sequence[torch.Tensor], weight: float, staleness: int, epoch: int,
                stale: Sequence[torch.Tensor] | None, stale_weight: float, copy_out: bool = True,
                left_behind: Callable[[bool], bool] | None = None,
                vouched: Callable[[str], bool] | None = None) -> RoundResult:
        """The fragment's round at its ``epoch`` (``Swarm.average``), the due peers read from its records."""
        return self.swarm.average(delta, weight, staleness, epoch, stale, stale_weight, copy_out=copy_out,
                                  left_behind=left_behind, fragment=self.fragment, seen=self._seen, vouched=vouched)

    def fresh_buffers(self) -> list[torch.Tensor] | None:
        """The fragment's views of the averager's shared buffer (None while a round holds it)."""
        return self.swarm.fresh_buffers(fragment=self.fragment)

    def serve(self, anchors: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], epoch: int,
              *, checksum: bool, manifest: TensorManifest | None = None,
              update: ServedUpdate | None = None) -> str:
        """Serve the fragment's state of its ``epoch`` (and publish its digest when ``checksum``). A fragment's
        round update is not served: a fragment left behind downloads the fragment (1/F of the model)."""
        return self.swarm.serve(anchors, momentum, epoch, checksum=checksum, manifest=manifest,
                                fragment=self.fragment)

    def withdraw(self) -> None:
        """The fragment's served state is about to change (``Swarm.withdraw``)."""
        self.swarm.withdraw(fragment=self.fragment)

    def withdraw_update(self) -> None:
        """Nothing to withdraw: a fragment's round update is not served (:meth:`serve`)."""

    def download(self, templates: Sequence[torch.Tensor], min_epoch: int, timeout: float | None = None,
                 trusted: frozenset[str] | None = None, backed: dict[str, int] | None = None) -> SwarmState | None:
        """The fragment's verified state at its epoch ``min_epoch`` or newer (``templates``: its tensors)."""
        return self.swarm.download(templates, min_epoch, timeout, trusted=trusted, backed=backed,
                                   fragment=self.fragment)

    def download_update(self, templates: Sequence[torch.Tensor], base_sha: str, base_epoch: int,
                        timeout: float, trusted: frozenset[str] | None = None) -> SwarmUpdate | None:
        """None: a fragment's round update is not served (:meth:`serve`); the catch-up downloads the fragment."""
        return None
