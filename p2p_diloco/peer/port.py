"""The swarm side of the round driver: :class:`SwarmPort` executes the round policy's actions on a real
swarm (the ``RoundPort`` of :mod:`p2p_diloco.core.round_driver`).

It reads and writes the swarm only through :class:`p2p_diloco.swarm.facade.Swarm`, changes the outer state
only by loading a verified download or a verified round update (stepped by the round it missed when the swarm
moved on meanwhile, on copies, and checked against the swarm's digest before anything live changes:
``swarm.catchup``), and tells listeners what happens. The decisions are not here: which
epochs, checksum votes and donors to believe is :class:`p2p_diloco.core.evidence.Evidence`'s, fed with what
this peer saw (its completed rounds, its downloads, the failed ones).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from p2p_diloco.core.delayed import RoundAggregate, apply_round
from p2p_diloco.core.dylu import phase_elapsed_s
from p2p_diloco.core.evidence import Claim, Evidence, outvoted, state_verdict
from p2p_diloco.core.outer import MOMENTUM_KEY_PREFIX, OuterOptimizer
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.round_driver import Collected
from p2p_diloco.core.rounds import Observation, RoundResult
from p2p_diloco.peer.eager import EagerOverlap
from p2p_diloco.peer.faults import FaultHooks
from p2p_diloco.peer.report import SessionListener
from p2p_diloco.swarm.catchup import implausible
from p2p_diloco.swarm.checksum import TensorManifest, state_sha256, tensor_manifest
from p2p_diloco.swarm.facade import Swarm
from p2p_diloco.swarm.group import DEFAULT_MAX_ROUND_WEIGHT
from p2p_diloco.swarm.records import PeerProgress
from p2p_diloco.swarm.state import ServedUpdate, SwarmState

logger = logging.getLogger(__name__)

DOWNLOAD_ATTEMPTS = 3
"""How often one resync asks for the swarm's state when the donors stepped on mid-download (``SwarmPort._download``):
each attempt ends when the donors step again, so more only helps a peer whose download takes about one round."""


class SwarmPort:
    """Executes rounds on ``swarm`` for the outer state ``state`` of the model's ``params``."""

    def __init__(self, swarm: Swarm, state: OuterState, params: Sequence[torch.Tensor],
                 listeners: list[SessionListener], faults: FaultHooks, eager: bool,
                 evidence: Evidence | None = None) -> None:
        self.swarm, self.state, self.params = swarm, state, list(params)
        self.evidence = evidence or Evidence()
        """Whom this peer believes (``core.evidence``); its ``me`` is set in :meth:`start`."""
        self.claims: list[Claim] = []
        """The epoch claims of the records read last (non-client peers)."""
        self._records: list[PeerProgress] | None = None  # read by the last records()
        self.listeners, self.faults, self.eager = listeners, faults, eager
        self.overlap: EagerOverlap | None = None
        self.peers_visible = 0
        self.last_seen_others: float | None = None
        self.late_start_s = 0.0
        """How far the swarm was into its inner phase when this peer last loaded its state (the next phase is
        shortened by that much; ``core.dylu.late_start_steps``)."""
        self.manifest: TensorManifest | None = None
        """The anchors' manifest as served now (None while they change): hashed once per new state."""
        self.state_sha: str | None = None
        """``checksum.state_sha256`` of anchors and momentum as served now (None while they change)."""
        self._base_sha: str | None = None
        """The digest of the state the last outer step started from (the served update's base)."""
        self.writer: threading.Thread | None = None
        """A checkpoint being written from the live anchors (``peer.resume.CheckpointWriter``)."""
        self._zeros: list[torch.Tensor] | None = None
        self._update_fetch_s = 0.0
        """How long the last missed round's update took to fetch: a floor on how far the swarm is into its phase."""
        self.network_s = 0.0
        """Seconds spent in calls that talk to the swarm since the session last reset it (the round's
        overhead is the rest of ``end_round``)."""

    def start(self) -> None:
        self.evidence.me = self.swarm.peer_id
        if self.eager:
            self.overlap = EagerOverlap(self.swarm, self.swarm.peer_id)

    def close(self, timeout: float) -> None:
        if self.overlap is not None:
            self.overlap.close(timeout=timeout)
        self.wait_writer()

    def wait_writer(self) -> None:
        """Let a checkpoint being written from the live anchors finish (before they change)."""
        if self.writer is not None:
            began = time.monotonic()
            self.writer.join()
            if time.monotonic() - began > 1.0:
                logger.info("Waited %.1f s for the checkpoint being written", time.monotonic() - began)
            self.writer = None

    def notify(self, method: str, *args: Any) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, method)(*args)
            except Exception:  # noqa: BLE001 - a display or metrics bug must not stop training
                logger.exception("listener %s.%s failed", type(listener).__name__, method)

    def records(self) -> list[PeerProgress]:
        """This run's and model's progress records; tracks who is visible and tells the listeners."""
        records = self._records = self.swarm.records()
        self.peers_visible = len(records)
        if any(r.peer_id != self.swarm.peer_id for r in records):
            self.last_seen_others = time.monotonic()
        self.claims = [Claim(r.peer_id, r.epoch) for r in records if not r.client_mode]
        self.notify("swarm", self.peers_visible, self.evidence.swarm_epoch(self.claims))
        return records

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

    # ------------------------------------------------------------------ RoundPort

    def swarm_epoch(self) -> int | None:
        """The largest epoch this peer believes (``Evidence.swarm_epoch``), not the largest anybody claims."""
        self.records()
        return self.evidence.swarm_epoch(self.claims)

    @contextlib.contextmanager
    def _network(self) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.network_s += time.monotonic() - began

    def observe(self, epoch: int) -> Observation:
        with self._network():
            swarm_epoch = self.swarm_epoch()
        unseen = None if self.last_seen_others is None else time.monotonic() - self.last_seen_others
        return Observation(epoch, swarm_epoch, self.peers_visible, unseen_s=unseen)

    def in_minority(self, epoch: int) -> bool:
        """Peers this one trusts (averaged with, or ``--trusted-peers``) published, by strict majority,
        another digest of parameters and momentum for ``epoch``; other ids' votes do not count."""
        with self._network():
            votes = self.evidence.trusted_votes(self.swarm.checksum_votes(epoch))
        return outvoted(votes, self.state_digest())

    def averaging(self, epoch: int) -> None:
        self.notify("status", "averaging", epoch)

    def before_allreduce(self) -> None:
        self.faults.before_allreduce()

    def average(self, delta: Sequence[torch.Tensor], weight: float, staleness: int, epoch: int,
                stale: Sequence[torch.Tensor] | None, stale_weight: float) -> RoundResult:
        weight, stale_weight = self._capped(weight), self._capped(stale_weight)
        # the fresh mean stays in the averager's buffer: the driver applies it before the next round
        with self._network():
            result = self.swarm.average(delta, weight, staleness, epoch, stale, stale_weight, copy_out=False,
                                        left_behind=lambda: self._left_behind(epoch))
        self.saw(result)
        return result

    def _left_behind(self, epoch: int) -> bool:
        """Read the records again: has every peer this one believes moved past ``epoch`` (``Evidence.left_behind``)?
        A peer that missed its group then stops waiting for one; the round policy resyncs it next."""
        self.records()
        return self.evidence.left_behind(self.claims, epoch)

    def _capped(self, weight: float) -> float:
        """Claim at most ``max_round_weight``: every member refuses (and bans) a claim above it, and work
        carried over many skipped rounds is still applied, only weighted as that much."""
        cap = self.swarm.cfg.max_round_weight or DEFAULT_MAX_ROUND_WEIGHT
        if weight > cap:
            logger.info("Claiming a weight of %.4g instead of %.4g: max_round_weight", cap, weight)
        return min(weight, cap)

    def saw(self, result: RoundResult | None) -> None:
        """A complete all-reduce vouches for its members; members rejected in it are trusted no more."""
        if result is None:
            return
        for line in result.rejected:
            self.evidence.forget(line.split(":", 1)[0])
        if result.averaged:
            self.evidence.averaged_with(result.contributors)

    def resync(self, min_epoch: int, timeout: float | None = None, again: bool = False) -> bool:
        self.notify("status", "syncing", min_epoch)
        began = time.monotonic()
        # A peer that is behind has nothing worth serving (joiners refuse states older than the swarm's): stop
        # serving before the download, and drop the zeros kept for serving, so that the downloaded state does
        # not sit beside them.
        known = self.manifest
        self.withdraw()
        self._zeros = None
        if not again and not self.eager and min_epoch == self.state.epoch + 1:
            if self._catch_up_live(self._base_sha or self.state_digest(), began, timeout):
                return True
        backed: dict[str, int] = {}
        trusted = self.trusted_or_none()
        state = self._download(min_epoch, began, timeout, backed, trusted)
        self.notify("state_transfer", "received", state is not None)
        if state is None:
            claims = self.claims
            if backed:
                self.records()  # did the donors that stopped midway move on? (their records now say)
            ignored = self.evidence.unbacked(claims, min_epoch, served=backed, now=self.claims)
            logger.warning("Could not download the swarm's state (epoch >= %d); keeping ours%s", min_epoch,
                           f"; ignoring the epoch claims of {len(ignored)} untrusted peer(s) for "
                           f"{min(ignored.values()):.0f} s or more" if ignored else "")
            self.serve(checksum=False, manifest=known)
            return False
        self.evidence.loaded(state.delivered or {}, trusted)  # a relay of trusted bytes earns nothing
        epoch, manifest = state.epoch, state.params_manifest  # the download was verified against it
        if not self.eager and self.swarm_epoch() == state.epoch + 1:
            stepped = self._apply_missed_round(state, began, timeout)
            if stepped is None:  # the downloaded tensors changed and are not the swarm's: download again
                target = state.epoch + 1
                del state
                if not again:
                    return self.resync(target, timeout, again=True)
                self.serve(checksum=False, manifest=known)
                return False
            if stepped:
                epoch, manifest = epoch + 1, stepped
        tensors = {f"param.{i}": t for i, t in enumerate(state.params)}
        if self.state.outer.momentum > 0:
            # Donors always serve a momentum (zeros when they have none); without momentum there is none to load.
            tensors.update({f"outer.momentum.{i}": t for i, t in enumerate(state.opt_tensors)})
        self.state.load_state_tensors(tensors, epoch, take=True)  # the downloaded momentum becomes ours
        del tensors
        state.params, state.opt_tensors = [], []  # the downloaded copy goes now, not when resync returns
        self.state.begin(self.params)
        self.serve(checksum=False, manifest=manifest)
        # The donors served epoch ``state.epoch`` from the moment they stepped to it, before this download
        # began: its time is a lower bound on how far they are, measured here, which no record can lower. After
        # a missed round was applied the swarm's phase began during the download, but before the update was
        # served: its fetch time is the floor (a believed record of phase_s 0 made a joiner plan the full H).
        downloaded_s = time.monotonic() - began if epoch == state.epoch else self._update_fetch_s
        self.late_start_s = self._phase_elapsed(epoch, floor_s=downloaded_s)
        logger.info("Synchronised to epoch %d from %s", epoch, state.donor)
        return True

    def _download(self, min_epoch: int, began: float, timeout: float | None, backed: dict[str, int],
                  trusted: frozenset[str] | None) -> SwarmState | None:
        """The swarm's verified state of ``min_epoch`` or newer, asked for again (at most
        ``DOWNLOAD_ATTEMPTS`` times, within the one time limit) when an attempt failed while the swarm this peer
        believes stepped to a later epoch: the donors stopped serving the state being fetched because they
        moved on to the next round's, which is then the state to fetch. Without this a peer whose download
        outlasted one of the swarm's rounds (all donors of one group step together) gave up and trained a
        whole phase on its old state before trying again. ``backed`` collects every attempt's donors
        (``swarm.download``)."""
        limit = self.swarm.cfg.state_download_timeout_s if timeout is None else timeout
        state = None
        for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
            before = self.swarm_epoch()
            with self._network():
                state = self.swarm.download(self.state.anchors, min_epoch, max(1.0, limit - (time.monotonic() - began)),
                                            trusted=trusted, backed=backed)
            if state is not None or limit - (time.monotonic() - began) < 1.0:
                return state
            after = self.swarm_epoch()
            if after is None or before is None or after <= before:
                return None  # nobody believed moved on: a retry would meet the same donors in the same state
            logger.info("The swarm stepped from epoch %d to %d while we downloaded (attempt %d of %d); asking "
                        "for its new state", before, after, attempt, DOWNLOAD_ATTEMPTS)
            min_epoch = max(min_epoch, after)
        return state

    def _phase_elapsed(self, epoch: int, floor_s: float) -> float:
        """How far the believed peers are into the inner phase of ``epoch`` (``core.dylu.phase_elapsed_s``
        of their records, read now), and never less than ``floor_s``, what this peer measured itself (records
        are claims: one can only make the phase look further along)."""
        with self._network():
            records = self.records()
        believed = {c.peer_id for c in self.evidence.believed(self.claims)} - {self.swarm.peer_id}
        elapsed = phase_elapsed_s((r.phase_s, r.age_s()) for r in records
                                  if r.epoch == epoch and r.peer_id in believed and not r.client_mode)
        return floor_s if elapsed is None else max(floor_s, elapsed)

    def _catch_up_live(self, base: str, began: float, timeout: float | None) -> bool:
        """One round behind with the swarm's own state of the round before (a peer that loaded a state while
        the swarm averaged it, then missed that round's group): fetch that round's update and apply it
        (``swarm.catchup``; donors serve it only for this exact base digest), instead of downloading a whole
        state that can take longer than the swarm's round (measured at 1 Mbit/s: a 6.7 MB state against 63 s
        rounds, and the download failed when the donors stepped on).

        The update is applied to copies of the anchors and momentum (8 bytes/param of ordinary memory while
        this runs, beside the update's 4 to 8 in shared memory) and the result replaces the live state only
        once its values and digest passed every check: a hostile or broken update leaves this peer on its last
        verified state, serving it, whatever happens next. ``True``: caught up and verified; ``False``:
        nothing changed (no donor serves it, or it failed a check; the caller downloads)."""
        limit = self.swarm.cfg.state_download_timeout_s if timeout is None else timeout
        epoch, trusted = self.state.epoch, self.trusted_or_none()
        with self._network():
            update = self.swarm.download_update(self.state.anchors, base, epoch,
                                                max(1.0, limit - (time.monotonic() - began)), trusted=trusted)
        if update is None:
            return False
        fetched_s = time.monotonic() - began
        anchors = [a.detach().to("cpu", copy=True) for a in self.state.anchors]
        momentum = [m.detach().to("cpu", copy=True) for m in self.state.outer.momentum_buffers() if m is not None]
        outer = OuterOptimizer(anchors, lr=self.state.outer.lr, momentum=self.state.outer.momentum)
        if len(momentum) == len(anchors) and outer.momentum > 0:
            outer.load_state_tensors({f"{MOMENTUM_KEY_PREFIX}{i}": t for i, t in enumerate(momentum)}, take=True)
        apply_round(outer, RoundAggregate(update.fresh, update.stale, None))  # type: ignore[arg-type]
        update.fresh = update.stale = None
        stepped = [m if m is not None else torch.zeros_like(a) for m, a in zip(outer.momentum_buffers(), anchors,
                                                                                   strict=True)]
        problem = implausible(anchors) or implausible(stepped)
        manifest = tensor_manifest(anchors)
        sha = state_sha256(anchors, stepped, params_sha=manifest.sha)
        with self._network():
            votes = self.swarm.checksum_votes(epoch + 1)
        verdict = problem or state_verdict(update.vouching or update.donor, sha, votes, trusted)
        if sha != update.result_sha or verdict is not None:
            logger.warning("The update of epoch %d from %s does not lead to the swarm's state (%s); our state is "
                           "unchanged, downloading the whole state", epoch, update.donor or "nobody",
                           verdict or f"{sha[:12]}... instead of the claimed {update.result_sha[:12]}...")
            return False
        tensors = {f"param.{i}": t for i, t in enumerate(anchors)}
        if self.state.outer.momentum > 0:
            tensors.update({f"{MOMENTUM_KEY_PREFIX}{i}": t for i, t in enumerate(stepped)})
        self.state.load_state_tensors(tensors, epoch + 1, take=True)  # verified: now it becomes ours
        del tensors, anchors, stepped, outer
        self.state.begin(self.params)
        credited = self.evidence.loaded(update.delivered or {}, trusted)
        self.serve(checksum=False, manifest=manifest)
        # the donors served the update from the moment they stepped: the fetch time is a lower bound
        self.late_start_s = self._phase_elapsed(self.state.epoch, floor_s=fetched_s)
        logger.info("Applied the round of epoch %d we missed (from %d donor(s), most from %s%s) to our own state",
                    epoch, len(update.sources), update.donor or "nobody",
                    "" if credited is None else "; it is trusted from now on")
        return True

    def _apply_missed_round(self, state: SwarmState, began: float,
                            timeout: float | None) -> TensorManifest | None | bool:
        """The swarm moved on while ``state`` downloaded: apply the round it missed to the downloaded tensors
        (``swarm.catchup``), with the outer step every member ran (``core.delayed.apply_round``). Returns the
        stepped parameters' manifest; ``False`` when no donor serves the update (``state`` is unchanged and
        loaded as it is: the round policy resyncs later); ``None`` when the result failed its checks (the
        downloaded tensors changed: the caller downloads again). The live state is not touched here."""
        limit = self.swarm.cfg.state_download_timeout_s if timeout is None else timeout
        # at least half the download's own limit (the update is half a state or less): a download that used
        # most of its limit left the update too little time (1 Mbit/s: 30 s left for 27 s of update, cut)
        fetch_began = time.monotonic()
        with self._network():
            update = self.swarm.download_update(state.params, state.state_sha256, state.epoch,
                                                max(limit / 2, limit - (time.monotonic() - began)),
                                                trusted=self.trusted_or_none())
        self._update_fetch_s = time.monotonic() - fetch_began  # the update was served from the swarm's step on
        if update is None:
            logger.info("The swarm is at epoch %d and no donor serves the round we missed; loading epoch %d",
                        state.epoch + 1, state.epoch)
            return False
        outer = OuterOptimizer(state.params, lr=self.state.outer.lr, momentum=self.state.outer.momentum)
        if outer.momentum > 0:  # the downloaded momentum becomes the buffers and is stepped in place
            outer.load_state_tensors({f"{MOMENTUM_KEY_PREFIX}{i}": t for i, t in enumerate(state.opt_tensors)},
                                     take=True)
        apply_round(outer, RoundAggregate(update.fresh, update.stale, None))  # type: ignore[arg-type]
        update.fresh = update.stale = None
        problem = implausible(state.params) or implausible(state.opt_tensors)
        manifest = tensor_manifest(state.params)
        sha = state_sha256(state.params, state.opt_tensors, params_sha=manifest.sha)
        with self._network():
            votes = self.swarm.checksum_votes(state.epoch + 1)
        verdict = problem or state_verdict(update.vouching or update.donor, sha, votes, self.trusted_or_none())
        if sha != update.result_sha or verdict is not None:
            logger.warning("The update of epoch %d from %s does not lead to the swarm's state (%s); downloading "
                           "the state again", state.epoch, update.donor,
                           verdict or f"{sha[:12]}... instead of the claimed {update.result_sha[:12]}...")
            return None
        logger.info("Applied the round of epoch %d we missed (from %d donor(s)) to the downloaded state",
                    state.epoch, len(update.sources))
        return manifest

    def published(self, epoch: int, update: RoundAggregate | None = None) -> None:
        # Eager peers publish no checksums: their parameters differ by their own terms by design.
        served = None
        if update is not None and not self.eager and self._base_sha is not None:
            served = ServedUpdate(self._base_sha, update.fresh_mean, update.stale_term)
        self.serve(checksum=not self.eager, update=served)

    def collect(self, epoch: int, timeout: float) -> Collected:
        with self._network():
            got = self.overlap.collect(epoch, timeout)
        self.saw(got.result)
        return got

    def launch(self, delta: Sequence[torch.Tensor], weight: float, staleness: int, epoch: int,
               stale: Sequence[torch.Tensor] | None, stale_weight: float) -> bool:
        return self.overlap.launch(delta, self._capped(weight), staleness, epoch, stale=stale,
                                   stale_weight=self._capped(stale_weight))

    def discard(self, why: str) -> None:
        if self.overlap is not None:
            self.overlap.discard(why)

    def delta_buffers(self) -> list[torch.Tensor] | None:
        if self.eager:
            return None
        with self._network():  # the served update lives in these buffers: joiners fetching it finish first
            self.swarm.withdraw_update()
        return self.swarm.fresh_buffers()

    def withdraw(self) -> None:
        self.wait_writer()
        with self._network():  # waits only for downloads being served
            self.swarm.withdraw()
        self._base_sha = self.state_sha  # the state the next outer step starts from (its update's base)
        self.manifest = self.state_sha = None

    # ------------------------------------------------------------------ state

    def serve(self, *, checksum: bool, manifest: TensorManifest | None = None,
              update: ServedUpdate | None = None) -> None:
        """Serve the current anchors and momentum to joiners (and publish their checksum if asked). The anchors
        are hashed here, once per state (``manifest`` when already known, e.g. a verified download's); the
        digest peers compare adds one pass over the momentum (``checksum.state_sha256``)."""
        momentum = self._momentum()
        # the round's one hash pass over the anchors
        self.manifest = manifest if manifest is not None else tensor_manifest(self.state.anchors)
        with self._network():
            self.state_sha = self.swarm.serve(self.state.anchors, momentum, self.state.epoch, checksum=checksum,
                                              manifest=self.manifest, update=update)

    def _momentum(self) -> list[torch.Tensor]:
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
            self.state_sha = state_sha256(self.state.anchors, self._momentum(), params_sha=self.anchors_sha())
        return self.state_sha
