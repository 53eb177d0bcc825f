"""Serving this peer's state to joiners (the donor side of ``swarm.state``).

A donor announces itself under ``{prefix}.all_averagers`` with its epoch as priority (hivemind's state
protocol) and answers ``rpc_state_chunk`` (``swarm.chunk_transfer``) with its manifest
(``state.make_state_metadata``) or one chunk's bytes (nothing is pickled). It serves its live anchors and
momentum, not a copy: before they change (an outer step, a resync) the host withdraws them
(:meth:`StateServer.withdraw`), waits for downloads in flight to end (at most a budget saved at 15% of the
time it worked, ``core.chunks.ServeWait``, which no downloader can stretch; a joiner that fetched a manifest
or chunk in the last ``chunk_transfer.PIN_S`` counts as in flight), and bumps a version that a stream checks before every
message it sends; so a chunk is either of one epoch or cut short (the joiner then fetches it from another
donor, or the new state). hivemind's whole-state stream (``rpc_download_state``) is closed. A donor also
serves the last round's update for one round (``swarm.catchup``): a joiner whose download outlasted a round
applies it instead of downloading again.

Why one module: :class:`StateServer` is the training process's side (what is served, and when it changes), and
:func:`state_donors` finds the others' served states. The server reaches the averager only through
``state.ServingAverager``; the averager process serves chunks with ``chunk_transfer.ChunkServer``.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration

from p2p_diloco.core.chunks import ServeWait
from p2p_diloco.swarm.checksum import TensorManifest, combine_state_sha, tensor_manifest
from p2p_diloco.swarm.state import ServingAverager, make_state_metadata

logger = logging.getLogger(__name__)




def state_donors(dht: Any, prefix: str, own_id: PeerID, allowed: frozenset[str] | None) -> list[tuple[str, float]]:
    """Peers announcing shareable state under ``{prefix}.all_averagers`` (hivemind's state protocol, the run's
    and model's prefix): ``(peer id, priority)``, best first; a private swarm's (``allowed``) only."""
    found = dht.get(f"{prefix}.all_averagers", latest=True, return_future=True).result(timeout=30)
    if not isinstance(found, ValueWithExpiration) or not isinstance(found.value, dict):
        return []
    donors = []
    for subkey, entry in list(found.value.items())[:4096]:
        try:
            peer = PeerID(subkey)
        except Exception:
            continue
        priority = entry.value if isinstance(entry, ValueWithExpiration) else None
        if isinstance(priority, bool) or not isinstance(priority, (int, float)) or not math.isfinite(priority):
            continue  # None marks a peer that stopped sharing
        if allowed is not None and peer.to_base58() not in allowed:
            continue  # a private swarm takes state only from its own members
        if peer != own_id:
            donors.append((peer.to_base58(), float(priority), random.random()))
    return [(peer, priority) for peer, priority, _ in sorted(donors, key=lambda d: (-d[1], d[2]))]


@dataclass
class ServedUpdate:
    """The round's update that turned state ``base_sha`` (epoch ``epoch - 1``) into the served one: the tensors
    ``core.delayed.apply_round`` applied (the fresh mean, the late-work term; ``None`` where the round had
    none). Served, not copied: they are the averager's buffers, valid until the next round writes into them
    (``StateServer.withdraw_update``, which copies them when a joiner may still need them)."""

    base_sha: str
    fresh: list[torch.Tensor] | None
    stale: list[torch.Tensor] | None

    def copied(self) -> ServedUpdate:
        """The same update in tensors of its own (``StateServer.withdraw_update`` keeps serving it)."""
        return ServedUpdate(self.base_sha, [t.detach().clone() for t in self.fresh] if self.fresh is not None else None,
                            [t.detach().clone() for t in self.stale] if self.stale is not None else None)


class StateServer:
    """Serves this peer's live state to joiners: ``publish`` after each change, ``withdraw`` before the next.

    No copy is kept: the tensors served are the anchors and momentum themselves (CPU), so serving costs no
    memory beyond one chunk per request being answered. The price: the owner must call :meth:`withdraw`
    before changing them, which waits for downloads in flight (bounded, see the module docstring).
    """

    def __init__(self, averager: ServingAverager):
        self._averager = averager
        self._lock = threading.Lock()
        self._state: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        self._update: ServedUpdate | None = None
        self._update_meta: dict[str, Any] | None = None
        self.waited_s = 0.0
        """Seconds :meth:`withdraw` spent waiting for downloads in flight, in total."""
        self.budget = ServeWait()
        """How long the next withdrawal may wait for downloads (``core.chunks.ServeWait``: a share of the time
        worked, saved up to a burst)."""
        self.cut_off = 0
        """Withdrawals that cut downloads still running (their joiners fetch the new state instead)."""
        self._update_owned = False
        """``_update`` is a copy of our own (kept through the round by :meth:`withdraw_update`), not the
        averager's buffers."""
        self._served_since = 0
        """Manifests handed out when the state before the served one was published: more since means a joiner
        asked during the last two epochs (one whose download of the previous state ended as we stepped on
        needs exactly the update we serve now)."""
        self._served_at_publish = 0
        """Manifests handed out when the served state was published (the next publish's ``_served_since``)."""
        self.kept_updates = 0
        """Rounds through which the last update was kept (copied) for a joiner still catching up."""
        self._fragments: dict[int, tuple[dict[str, Any], list[torch.Tensor]]] = {}
        """With Streaming DiLoCo's fragments: each fragment's served state (metadata, tensors), by fragment;
        one that is changing is absent. Each is asked for by its own selector (``chunk_transfer``)."""

    def publish(self, params: Sequence[torch.Tensor], opt_tensors: Sequence[torch.Tensor], epoch: int,
                manifest: TensorManifest | None = None, update: ServedUpdate | None = None,
                fragment: int | None = None, records_id: str | None = None) -> str:
        """Serve ``params`` and ``opt_tensors`` (CPU tensors, not copied) as the state of ``epoch``; returns
        its digest (``checksum.state_sha256``). ``manifest``: the parameters' manifest when the caller hashed
        them already (one pass over them per round; the digest then adds only the momentum's pass).
        ``update``: the round's update that led here, served until :meth:`withdraw_update`.

        ``fragment``: the state is that fragment's (Streaming DiLoCo), served beside the others' under the
        manifest of ``records_id`` (the fragment's namespace, which a joiner checks), without an update (a
        fragment left behind downloads the fragment: 1/F of the model).

        A client-mode peer serves nothing: it accepts no incoming connections, so no joiner could download
        from it, and hivemind refuses to announce its state. It only gets the checksum back.
        """
        manifest = manifest if manifest is not None else tensor_manifest(params)
        momentum = tensor_manifest(opt_tensors)
        sha = combine_state_sha(manifest.sha, momentum.sha)
        if self._averager.client_mode:
            return sha
        tensors = [t.detach() for t in (*params, *opt_tensors)]
        extra = [*(update.fresh or ()), *(update.stale or ())] if update is not None else []
        if any(t.device.type != "cpu" for t in (*tensors, *extra)):
            raise ValueError("the served state must be CPU tensors (keep anchors and momentum on the CPU)")
        cfg = self._averager.cfg
        metadata = make_state_metadata(records_id or cfg.run_id, self._averager.fingerprint, int(epoch), sha,
                                       manifest, momentum, len(params), len(opt_tensors))
        if fragment is not None:
            with self._lock:
                self._fragments[fragment] = (metadata, tensors)
                priority = float(sum(meta["ep"] for meta, _ in self._fragments.values()))
            self._averager.state_sharing_priority = priority  # fragment rounds done: donors ahead first
            self._averager.set_state_provider(self._provide_fragments)
            return sha
        served = self._averager.manifests_served()
        with self._lock:
            self._state = (metadata, tensors)
            self._update, self._update_meta, self._update_owned = update, None, False
            self._served_since, self._served_at_publish = self._served_at_publish, served
        self._averager.state_sharing_priority = float(epoch)  # donors with newer state are asked first
        self._averager.set_state_provider(self._provide)
        return sha

    def _provide(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        with self._lock:
            if self._state is None:
                raise RuntimeError("this peer's state is changing; ask another donor")
            state_meta, tensors = self._state
            update, extra = self._update, []
            if update is not None:
                fresh, stale = list(update.fresh or ()), list(update.stale or ())
                if self._update_meta is None:  # hashed once, when a joiner first asks (not every round)
                    fm, sm = tensor_manifest(fresh), tensor_manifest(stale)
                    self._update_meta = dict(state_meta, ep=state_meta["ep"] - 1, base=update.base_sha,
                                             to=state_meta["sha"], sha=combine_state_sha(fm.sha, sm.sha),
                                             np=len(fresh), no=len(stale), pc=fm.chunks, mc=sm.chunks)
                extra = [t.detach() for t in (*fresh, *stale)]
            return {"s": state_meta, "u": self._update_meta if update is not None else None}, tensors + extra

    def _provide_fragments(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Every fragment's served state: ``{"f": [metadata or None, ...]}`` and their tensors, in that order."""
        with self._lock:
            if not self._fragments:
                raise RuntimeError("this peer's state is changing; ask another donor")
            top = max(self._fragments) + 1
            metas = [self._fragments[f][0] if f in self._fragments else None for f in range(top)]
            tensors = [t for f in range(top) if f in self._fragments for t in self._fragments[f][1]]
        return {"f": metas}, tensors

    @property
    def served(self) -> int:
        """Downloads of our state (or of its round update) begun so far: manifests handed out."""
        return self._averager.manifests_served()

    def withdraw_update(self, timeout: float) -> None:
        """The update's buffers are about to be overwritten (the next round's pseudo-gradient): stop serving
        them, as :meth:`withdraw` does for the state. Nothing to wait for when none is served.

        If a joiner fetched a manifest from us since the state before this one was published (during the last
        two epochs), the update is copied first and the copy is served on through the round, until the outer
        step (:meth:`withdraw`). Why: a joiner whose state download lasts about a round (a home uplink, a
        relay, 8 bytes per parameter) finishes it as the swarm steps on, and meets the next round already
        running; the buffers it would have caught up from were overwritten at that round's start, so it had
        to download the whole state again, and again (it chased the swarm: seen behind a relay, 6 downloads
        of 7-10 s in a row). With the copy it applies the round it missed (``swarm.catchup``) any time in the
        next epoch. Cost: the update's size
        (4 bytes per parameter in fp32, plus the late-work term in a fold round) of host memory and one copy
        on the training thread, only in rounds after a joiner asked; nothing otherwise."""
        with self._lock:
            if self._update is None or self._update_owned:
                return
            if self._averager.manifests_served() > self._served_since:
                self._update, self._update_owned = self._update.copied(), True  # same values: same manifest
                self.kept_updates += 1
            else:
                self._update = self._update_meta = None
        self._wait_and_cut(timeout)  # downloads in flight read the buffers about to change: cut them

    def withdraw(self, timeout: float, fragment: int | None = None) -> None:
        """The served tensors (``fragment``'s, with fragments) are about to change: stop handing them out, wait
        up to ``timeout`` s for the downloads in flight to end (a joiner fetching chunks counts until it paused
        ``chunk_transfer.PIN_S``), then make any still running stop before their next message (with fragments,
        the other fragments' downloads too: one version counts every served state's changes)."""
        with self._lock:
            self._state = None
            self._update = self._update_meta = None
            self._update_owned = False
            if fragment is not None:
                self._fragments.pop(fragment, None)
        self._averager.mark_state_live(False)
        self._wait_and_cut(timeout)

    def _wait_and_cut(self, timeout: float) -> None:
        """Wait for downloads in flight, at most ``timeout`` and at most what the budget allows
        (``core.chunks.ServeWait``: nobody downloading can hold this peer's rounds for more than a share of
        its work plus one burst), then make those still running stop before their next message: their
        joiners get a chunk cut short, a clean failure, and fetch the new state."""
        if self._averager.client_mode or not self._averager.is_alive():
            return
        began = time.monotonic()
        allowed = self.budget.allowance(timeout)
        deadline = began + allowed
        while self._averager.downloading() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._averager.downloading():
            self.cut_off += 1
            logger.info("A state download still runs after %.2f s (the budget left for downloads); cutting it "
                        "off to change our state (cut %d so far)", allowed, self.cut_off)
        self._averager.bump_state_version()
        waited = time.monotonic() - began
        self.budget.spend(waited)
        self.waited_s += waited

    def stop(self) -> None:
        """Stop serving (e.g. while this peer resyncs itself)."""
        self._averager.set_state_provider(None)
