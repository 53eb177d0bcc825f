"""How a peer that is behind catches up with the swarm: which way, how often it tries, whom it believes.

Three ways, the cheapest that applies first (the choice is :class:`SyncPolicy`'s, network-free):

* **live update**: exactly one round behind, with the swarm's own state of the round before (a peer that
  loaded a state while the swarm averaged it, then missed that round's group): fetch that round's update
  (half a state or less) and apply it to copies of this peer's anchors and momentum.
* **download**: the swarm's verified state of ``min_epoch`` or newer, asked for again (at most
  ``download_attempts`` times, within the one time limit) when an attempt failed because the donors stepped
  on (the swarm this peer believes moved, or a donor stopped serving the state midway): they moved to the next
  round's state, which is then the one to fetch.
* **missed-round step**: the swarm moved one round on while the state downloaded: apply the round it missed
  to the downloaded tensors. When the result fails its check, the downloaded tensors changed and are not the
  swarm's: download once more (the newer state), then give up.

Whom it believes: an update's result must have the digest the donors claimed for it, and that digest must
pass :func:`p2p_diloco.core.evidence.state_verdict` for the next epoch, with the votes and the trusted peers
the port reports (``core.evidence``: never a head count of free identities). A failed check changes nothing:
the update is applied to copies, and the copies replace the live state only once verified.

:class:`Catchup` runs these choices against a :class:`SyncPort` (the real swarm: ``peer.sync_port``; unit
tests: a fake). The port only fetches and checks: it returns a verified download or an update whose chunks
matched their manifest, hashes tensors and reads votes; it never writes the :class:`OuterState`.
:class:`Catchup` is that state's only writer here, as the round driver is for rounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from p2p_diloco.core.delayed import RoundAggregate, apply_round
from p2p_diloco.core.evidence import state_verdict
from p2p_diloco.core.outer import MOMENTUM_KEY_PREFIX, OuterOptimizer
from p2p_diloco.core.peer_state import OuterState

logger = logging.getLogger(__name__)

DOWNLOAD_ATTEMPTS = 3
"""How often one catch-up asks for the swarm's state when the donors stepped on mid-download: each attempt ends
when the donors step again, so more only helps a peer whose download takes about one round."""


class SyncStep(Enum):
    """What a catch-up does next (:class:`SyncPolicy`)."""

    LIVE_UPDATE = "live_update"
    """Fetch the round this peer missed and apply it to its own state."""
    DOWNLOAD = "download"
    """Download the swarm's whole state."""
    STEP_DOWNLOADED = "step_downloaded"
    """Apply the round the swarm took meanwhile to the downloaded state, then load it."""
    LOAD = "load"
    """Load the downloaded state as it is."""
    DOWNLOAD_AGAIN = "download_again"
    """The stepped download failed its check: download the newer state, once."""
    GIVE_UP = "give_up"
    """Keep this peer's own state (it trains on, and the round policy tries again later)."""


class JoinStep(Enum):
    """What a starting peer does after a catch-up that failed (:meth:`SyncPolicy.after_failed_join`)."""

    STOP = "stop"
    """No believed peer is ahead: train from our own state."""
    WAIT = "wait"
    """The same epoch is still believed (a trusted donor busy, or none yet): wait a little, try again."""
    RETRY = "retry"
    """Another epoch is believed now: try that one at once."""


@dataclass(frozen=True)
class SyncPolicy:
    """The catch-up choices; network-free and stateless (see the module docstring)."""

    eager: bool = False
    """Eager peers publish no checksums and serve no updates: they always download whole states."""
    download_attempts: int = DOWNLOAD_ATTEMPTS
    join_wait_s: float = 5.0
    """How long a starting peer waits before asking again for a state no donor serves yet."""

    def first(self, epoch: int, min_epoch: int, again: bool) -> SyncStep:
        """Live update when exactly one round behind (and not already on a second try), else download."""
        if not again and not self.eager and min_epoch == epoch + 1:
            return SyncStep.LIVE_UPDATE
        return SyncStep.DOWNLOAD

    def retry_download(self, before: int | None, after: int | None, time_left_s: float,
                       donors_stepped_on: bool = False) -> bool:
        """Ask again after a failed download only when the donors moved to the next state meanwhile, and time
        is left; otherwise a retry would meet the same donors in the same state. They moved on when the believed
        swarm stepped on (``before`` < ``after``), or when ``donors_stepped_on``: a donor that handed out the
        manifest stopped serving that state midway (the download's ``backed``). Why both: the swarm a peer
        believes is read from records refreshed every few seconds, and donors of rounds shorter than that step
        on between a joiner's manifest and its first chunk without any record showing it yet (seen: a donor
        pair averaging a round a second, the joiner failing its download and training a round on its old
        state). A donor that stops on purpose gains nothing: the retry asks for the same ``min_epoch`` (a
        donor's claimed epoch raises nothing) within the same time limit, at most ``download_attempts`` times."""
        if time_left_s < 1.0:
            return False
        return donors_stepped_on or (before is not None and after is not None and after > before)

    def after_download(self, state_epoch: int, swarm_epoch: int | None) -> SyncStep:
        """Step the download by the round the swarm took meanwhile, when it is exactly one round on."""
        if not self.eager and swarm_epoch == state_epoch + 1:
            return SyncStep.STEP_DOWNLOADED
        return SyncStep.LOAD

    def after_bad_step(self, again: bool) -> SyncStep:
        """A stepped download failed its check: its tensors changed, so download again, but only once."""
        return SyncStep.GIVE_UP if again else SyncStep.DOWNLOAD_AGAIN

    def after_failed_join(self, believed: int | None, epoch: int, tried: int) -> JoinStep:
        """After a failed catch-up to ``tried`` at start: stop when nobody believed is ahead of ``epoch``, wait
        when ``tried`` is still what is believed, else retry the newly believed epoch."""
        if believed is None or believed <= epoch:
            return JoinStep.STOP
        return JoinStep.WAIT if believed == tried else JoinStep.RETRY


class RoundUpdate(Protocol):
    """A round's update as the port fetched it (``swarm.catchup.SwarmUpdate``): every chunk matched its
    manifest; the state it leads to is not checked yet."""

    fresh: list[torch.Tensor] | None
    stale: list[torch.Tensor] | None
    result_sha: str
    """The state digest the donors claim the update leads to."""
    donor: str
    """The donor that delivered the most verified chunks (what a log names; ``""`` if none did)."""
    vouching: str
    """Whose word :func:`state_verdict` weighs for the result (a trusted donor among those that delivered)."""
    sources: tuple[str, ...]
    delivered: dict[str, int] | None
    """Donor -> verified chunks it delivered (whom ``core.evidence.credited`` may vouch for)."""


class DownloadedState(Protocol):
    """A whole state as the port downloaded it (``swarm.state.SwarmState``), verified against its digest."""

    params: list[torch.Tensor]
    opt_tensors: list[torch.Tensor]
    epoch: int
    state_sha256: str
    donor: str
    params_manifest: Any
    """The parameters' manifest (handed back to :meth:`SyncPort.serve`: no second hash pass)."""
    delivered: dict[str, int] | None


@dataclass
class Digest:
    """What :meth:`SyncPort.digest` found for a candidate state."""

    sha: str
    """The state digest peers publish and compare."""
    manifest: Any = None
    """The parameters' manifest (the port's type; served with the state)."""
    problem: str | None = None
    """Why the values cannot be a trained model's (NaN, absurd magnitudes), or None."""


class SyncPort(Protocol):
    """The network side of a catch-up. Every method is bounded in time and never raises for network trouble."""

    def swarm_epoch(self) -> int | None:
        """The largest epoch this peer believes now (records read again)."""

    def trusted(self) -> frozenset[str] | None:
        """The peers whose donors and votes this one trusts, ``None`` when none of them is online."""

    def syncing(self, min_epoch: int) -> None:
        """About to catch up to ``min_epoch``: stop serving the current state (it is behind; joiners refuse it)."""

    def resume_serving(self) -> None:
        """The catch-up failed: serve the unchanged state again."""

    def serve(self, manifest: Any) -> None:
        """Serve the newly loaded state (``manifest``: its parameters', already hashed)."""

    def base_digest(self) -> str:
        """The digest of the state this peer's last outer step started from (what a live update applies to)."""

    def fetch_update(self, params: Sequence[torch.Tensor], base_sha: str, epoch: int, timeout: float,
                     trusted: frozenset[str] | None) -> RoundUpdate | None:
        """The update of round ``epoch`` served for the state of digest ``base_sha`` (``params``: its
        parameters, the layout), or None."""

    def download(self, min_epoch: int, timeout: float, trusted: frozenset[str] | None,
                 backed: dict[str, int]) -> DownloadedState | None:
        """The swarm's verified state of ``min_epoch`` or newer, or None; ``backed`` collects the donors that
        delivered verified chunks of a state that stayed incomplete (``core.evidence.Evidence.unbacked``)."""

    def digest(self, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> Digest:
        """Hash a candidate state and check its values."""

    def votes(self, epoch: int) -> Any:
        """The checksum votes published for ``epoch`` (``core.evidence.state_verdict``'s ``votes``)."""

    def received(self, ok: bool) -> None:
        """A download (all its attempts) ended, with a state (``ok``) or without."""

    def credit(self, delivered: dict[str, int] | None, trusted: frozenset[str] | None) -> str | None:
        """A verified state or update was loaded from these donors (``core.evidence.Evidence.loaded``)."""

    def unbacked(self, min_epoch: int, backed: dict[str, int]) -> dict[str, float]:
        """No state of ``min_epoch`` loaded: the untrusted claims of it now ignored (``Evidence.unbacked``)."""

    def started_late(self, epoch: int, floor_s: float) -> None:
        """The state of ``epoch`` was loaded; the swarm's phase began at least ``floor_s`` ago."""


@dataclass
class SyncReport:
    """What one catch-up did (for logs and tests)."""

    steps: list[SyncStep] = field(default_factory=list)
    loaded_epoch: int | None = None


class Catchup:
    """Brings ``state`` (and the model's ``params``) up to the swarm's through ``port``; see the module docstring.

    The only writer of ``state`` during a catch-up: what the port returns is loaded only here, and only once
    verified."""

    def __init__(self, state: OuterState, params: Sequence[torch.Tensor], policy: SyncPolicy, port: SyncPort,
                 *, default_timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> None:
        self.state, self.params, self.policy, self.port = state, list(params), policy, port
        self.default_timeout_s = default_timeout_s
        self.sleep = sleep
        self.last = SyncReport()
        """The steps of the last :meth:`run`."""
        self._update_fetch_s = 0.0

    # ------------------------------------------------------------------ entry points

    def run(self, min_epoch: int, timeout: float | None = None, *, again: bool = False) -> bool:
        """Load the swarm's verified state of ``min_epoch`` or newer (by the cheapest way that works) into the
        outer state and the parameters; False (nothing changed, the old state served again) when none loaded."""
        if not again:
            self.last = SyncReport()
        began = time.monotonic()
        limit = self.default_timeout_s if timeout is None else timeout
        self.port.syncing(min_epoch)
        step = self.policy.first(self.state.epoch, min_epoch, again)
        self.last.steps.append(step)
        if step is SyncStep.LIVE_UPDATE:
            if self._live_update(began, limit):
                self.last.loaded_epoch = self.state.epoch
                return True
            self.last.steps.append(SyncStep.DOWNLOAD)
        backed: dict[str, int] = {}
        trusted = self.port.trusted()
        state = self._download(min_epoch, began, limit, backed, trusted)
        self.port.received(state is not None)
        if state is None:
            ignored = self.port.unbacked(min_epoch, backed)
            logger.warning("Could not download the swarm's state (epoch >= %d); keeping ours%s", min_epoch,
                           f"; ignoring the epoch claims of {len(ignored)} untrusted peer(s) for "
                           f"{min(ignored.values()):.0f} s or more" if ignored else "")
            self.port.resume_serving()
            return False
        self.port.credit(state.delivered or {}, trusted)  # a relay of trusted bytes earns nothing
        epoch, manifest, floor_s = state.epoch, state.params_manifest, None
        step = self.policy.after_download(state.epoch, self.port.swarm_epoch())
        self.last.steps.append(step)
        if step is SyncStep.STEP_DOWNLOADED:
            stepped = self._step_downloaded(state, began, limit)
            if stepped is None:  # the downloaded tensors changed and are not the swarm's
                target = state.epoch + 1
                del state
                step = self.policy.after_bad_step(again)
                self.last.steps.append(step)
                if step is SyncStep.DOWNLOAD_AGAIN:
                    return self.run(target, timeout, again=True)
                self.port.resume_serving()
                return False
            if stepped is not False:
                # the update was served from the swarm's step on: its fetch time is the floor of the phase
                epoch, manifest, floor_s = epoch + 1, stepped, self._update_fetch_s
        self._load(state.params, state.opt_tensors, epoch)
        state.params, state.opt_tensors = [], []  # the downloaded copy goes now, not when run returns
        self.port.serve(manifest)
        # The donors served the state from the moment they stepped to it, before this download began: its time
        # is a lower bound on how far they are. After a missed round was applied, the swarm's phase began during
        # the download but before the update was served: the update's fetch time is the floor.
        self.port.started_late(epoch, time.monotonic() - began if floor_s is None else floor_s)
        self.last.loaded_epoch = epoch
        logger.info("Synchronised to epoch %d from %s", epoch, state.donor)
        return True

    def join(self, swarm_epoch: int, timeout: float | None = None) -> int | None:
        """At start: catch up to ``swarm_epoch``, retrying within ``timeout`` while a newer epoch is believed
        or a believed donor may appear. Each failed try makes untrusted claims of that epoch unbacked
        (``core.evidence``), so a claim nobody serves gives way to the next one believed. Returns the epoch
        loaded, or None (training from our own state)."""
        limit = self.default_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.run(swarm_epoch, timeout=max(1.0, deadline - time.monotonic())):
                return self.state.epoch
            believed = self.port.swarm_epoch()
            step = self.policy.after_failed_join(believed, self.state.epoch, swarm_epoch)
            if step is JoinStep.STOP:
                logger.info("No peer served an acceptable state of epoch %d, and no other claim is believed: "
                            "training from our own state at epoch %d", swarm_epoch, self.state.epoch)
                return None
            if step is JoinStep.WAIT:
                logger.info("No peer shares an acceptable state of epoch %d yet; retrying", swarm_epoch)
                self.sleep(min(self.policy.join_wait_s, max(0.0, deadline - time.monotonic())))
            swarm_epoch = believed  # type: ignore[assignment]  # not None past STOP
        logger.warning("No peer shared its state within %.0f s; training from our own state at epoch %d",
                       limit, self.state.epoch)
        return None

    # ------------------------------------------------------------------ the ways

    def _download(self, min_epoch: int, began: float, limit: float, backed: dict[str, int],
                  trusted: frozenset[str] | None) -> DownloadedState | None:
        state = None
        for attempt in range(1, self.policy.download_attempts + 1):
            before, backed_before = self.port.swarm_epoch(), dict(backed)
            state = self.port.download(min_epoch, max(1.0, limit - (time.monotonic() - began)), trusted, backed)
            if state is not None:
                return state
            left_s = limit - (time.monotonic() - began)
            after = self.port.swarm_epoch() if left_s >= 1.0 else None  # no time left: no read
            stepped_on = backed != backed_before
            if not self.policy.retry_download(before, after, left_s, donors_stepped_on=stepped_on):
                return None
            logger.info("The %s stepped on while we downloaded (attempt %d of %d, believed epoch %s -> %s); asking "
                        "for its new state", "donors" if stepped_on else "swarm", attempt,
                        self.policy.download_attempts, before, after)
            if before is not None and after is not None and after > before:
                min_epoch = max(min_epoch, after)
        return state

    def _live_update(self, began: float, limit: float) -> bool:
        """Fetch the round this peer missed, apply it to copies of its anchors and momentum (8 bytes/param of
        ordinary memory while this runs), and load them only once their values and digest passed every check.
        ``False``: nothing changed (no donor serves it, or it failed a check; the caller downloads)."""
        epoch, trusted = self.state.epoch, self.port.trusted()
        update = self.port.fetch_update(self.state.anchors, self.port.base_digest(), epoch,
                                        max(1.0, limit - (time.monotonic() - began)), trusted)
        if update is None:
            return False
        fetched_s = time.monotonic() - began
        anchors = [a.detach().to("cpu", copy=True) for a in self.state.anchors]
        momentum = [m.detach().to("cpu", copy=True) for m in self.state.outer.momentum_buffers() if m is not None]
        stepped = self._step(anchors, momentum if len(momentum) == len(anchors) else [], update)
        digest = self._check(update, anchors, stepped, epoch + 1, trusted, live=True)
        if digest is None:
            return False
        self._load(anchors, stepped, epoch + 1)
        del anchors, stepped
        # A round's update vouches for nobody, whoever delivered it: the newcomer's credit (``core.evidence``)
        # anchors a peer between its first download and its first round, and a peer applying an update has a
        # state of its own. One that trusts nobody visible here was late for the swarm's first round (nobody is
        # trusted before it) or outlived every peer it trusted; crediting the donor that delivered most then
        # trusted a relay of the honest swarm's update at top priority (seen in the CI rehearsal of
        # ``tests/integration/test_relay_capture.py[vouched-only]``). Such a peer is no worse off than every peer
        # of a swarm's first round: its first complete all-reduce anchors it.
        self.port.credit({}, trusted)
        self.port.serve(digest.manifest)
        self.port.started_late(self.state.epoch, fetched_s)  # served from the donors' step on: a lower bound
        logger.info("Applied the round of epoch %d we missed (from %d donor(s), most from %s) to our own state",
                    epoch, len(update.sources), update.donor or "nobody")
        return True

    def _step_downloaded(self, state: DownloadedState, began: float, limit: float) -> Any:
        """Apply the round the swarm took meanwhile to the downloaded tensors, in place. Returns the stepped
        parameters' manifest; ``False`` when no donor serves the update (``state`` unchanged, loaded as it is:
        the round policy resyncs later); ``None`` when the result failed its checks (the downloaded tensors
        changed). The live state is not touched here."""
        # at least half the download's own limit (the update is half a state or less): a download that used
        # most of its limit left the update too little time (1 Mbit/s: 30 s left for 27 s of update, cut)
        trusted = self.port.trusted()
        fetch_began = time.monotonic()
        update = self.port.fetch_update(state.params, state.state_sha256, state.epoch,
                                        max(limit / 2, limit - (time.monotonic() - began)), trusted)
        self._update_fetch_s = time.monotonic() - fetch_began
        if update is None:
            logger.info("The swarm is at epoch %d and no donor serves the round we missed; loading epoch %d",
                        state.epoch + 1, state.epoch)
            return False
        state.opt_tensors = self._step(state.params, state.opt_tensors, update)
        digest = self._check(update, state.params, state.opt_tensors, state.epoch + 1, trusted, live=False)
        if digest is None:
            return None
        logger.info("Applied the round of epoch %d we missed (from %d donor(s)) to the downloaded state",
                    state.epoch, len(update.sources))
        return digest.manifest

    # ------------------------------------------------------------------ helpers

    def _step(self, params: list[torch.Tensor], momentum: list[torch.Tensor],
              update: RoundUpdate) -> list[torch.Tensor]:
        """The outer step every member of the round ran (``core.delayed.apply_round``), on ``params`` and
        ``momentum`` in place (momentum empty: none yet). Returns the momentum after it (zeros where none; with
        μ = 0 the ``momentum`` given, untouched)."""
        outer = OuterOptimizer(params, lr=self.state.outer.lr, momentum=self.state.outer.momentum)
        if momentum and outer.momentum > 0:
            outer.load_state_tensors({f"{MOMENTUM_KEY_PREFIX}{i}": t for i, t in enumerate(momentum)}, take=True)
        apply_round(outer, RoundAggregate(update.fresh, update.stale, None))  # type: ignore[arg-type]
        update.fresh = update.stale = None
        buffers = outer.momentum_buffers()
        if momentum and all(m is None for m in buffers):
            return momentum  # no momentum kept (μ = 0): what was served stays what is hashed
        return [m if m is not None else torch.zeros_like(p) for m, p in zip(buffers, params, strict=True)]

    def _check(self, update: RoundUpdate, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
               epoch: int, trusted: frozenset[str] | None, *, live: bool) -> Digest | None:
        """The stepped state's digest when it is the one the donors claimed and the swarm's evidence for
        ``epoch`` accepts it; None (with the reason logged) otherwise."""
        digest = self.port.digest(params, momentum)
        verdict = digest.problem or state_verdict(update.vouching or update.donor, digest.sha,
                                                  self.port.votes(epoch), trusted)
        if digest.sha != update.result_sha or verdict is not None:
            logger.warning("The update of epoch %d from %s does not lead to the swarm's state (%s); %s", epoch - 1,
                           update.donor or "nobody",
                           verdict or f"{digest.sha[:12]}... instead of the claimed {update.result_sha[:12]}...",
                           "our state is unchanged, downloading the whole state" if live
                           else "downloading the state again")
            return None
        return digest

    def _load(self, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], epoch: int) -> None:
        """Make a verified state ours (taken, not copied) and start the parameters from it."""
        tensors = {f"param.{i}": t for i, t in enumerate(params)}
        if self.state.outer.momentum > 0:
            # Donors always serve a momentum (zeros when they have none); without momentum there is none to load.
            tensors.update({f"{MOMENTUM_KEY_PREFIX}{i}": t for i, t in enumerate(momentum)})
        self.state.load_state_tensors(tensors, epoch, take=True)
        self.state.begin(self.params)
