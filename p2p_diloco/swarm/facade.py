"""``Swarm``: one peer's whole hivemind side behind one object.

It owns the DHT (with the record guard), the ``RoundAverager``, the ``StateServer`` and the DHT's
``RecordAudit``. Peers banned for a record they signed are banned in the averager process from inside here
(see :meth:`Swarm.records`), so callers never pass bans around. Every method is bounded in time; only
:meth:`start` raises (``SwarmStartError``, with what to fix).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import hivemind
import torch
from hivemind.compression import CompressionBase

from p2p_diloco.core.rounds import RoundResult
from p2p_diloco.swarm.averager import RoundAverager
from p2p_diloco.swarm.buffer_layout import BufferLayout
from p2p_diloco.swarm.catchup import SwarmUpdate, download_update
from p2p_diloco.swarm.checksum import TensorManifest
from p2p_diloco.swarm.chunk_transfer import fragment_selector
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.dht import SwarmStartError, start_dht, visible_maddrs
from p2p_diloco.swarm.dht_writer import DhtWriter
from p2p_diloco.swarm.quorum import due_peers
from p2p_diloco.swarm.reach import MESSAGES, Reach, Stall, diagnose, own_reach
from p2p_diloco.swarm.records import (
    PeerProgress,
    fetch_checksums,
    fetch_progress,
    fragment_records_id,
    other_versions,
    publish_checksum,
    publish_progress,
    run_validator,
)
from p2p_diloco.swarm.runner import FaultHook
from p2p_diloco.swarm.signing import RecordAudit, record_audit
from p2p_diloco.swarm.state import SwarmState, download_state
from p2p_diloco.swarm.state_server import ServedUpdate, StateServer

logger = logging.getLogger(__name__)


class Swarm:
    """The DHT, averager, state server and record audit of one peer of run ``cfg.run_id``.

    Args:
        cfg: swarm settings.
        fingerprint: the model's architecture digest; records of other models are ignored.
        template: tensors shaped like the anchors (the averager shares them with its process).
        compression: the all-reduce's wire codec.
        fault_hook: test-only hook run inside the averager process (see ``runner.FaultHook``).
        fragments: Streaming DiLoCo's assignment (``core.fragments.assign_fragments``); with more than one, each
            fragment's rounds, records, checksums and served state are its own (``swarm.fragment_swarm``).
    """

    def __init__(self, cfg: SwarmConfig, fingerprint: str, template: Sequence[torch.Tensor],
                 compression: CompressionBase | None = None, fault_hook: FaultHook | None = None,
                 fragments: Sequence[Sequence[int]] | None = None) -> None:
        self.cfg, self.fingerprint = cfg, fingerprint
        self._template, self._compression, self._fault_hook = list(template), compression, fault_hook
        self._fragments = [list(group) for group in fragments] if fragments is not None else None
        self.layout = BufferLayout.of(self._template, self._fragments)
        self.fragment_ids = [fragment_records_id(cfg.run_id, self.layout.tag, f)
                             for f in range(self.layout.count)] if self.layout.flat else []
        """Each fragment's records namespace (``fragment_records_id``); empty without fragments."""
        self.dht: hivemind.DHT | None = None
        self.averager: RoundAverager | None = None
        self.server: StateServer | None = None
        self.audit: RecordAudit | None = None
        self._writer = DhtWriter()
        self.partial_dir: Path | None = None
        """Where a state download keeps its verified chunks so a restart resumes it (``swarm.partial``);
        the peer sets it under its checkpoint directory. ``None``: nothing is kept."""
        self._warned_epoch = -(10**9)
        self._stall_warned: int | None = None
        """Round of the last "more peers than one group holds" warning."""
        self._seen: list[PeerProgress] = []
        """The progress records :meth:`records` read last: who is due in the next round."""

    def start(self) -> None:
        validators = [run_validator(run_id) for run_id in (self.cfg.run_id, *self.fragment_ids)]
        self.dht = start_dht(self.cfg, record_validators=validators)
        self.audit = record_audit(self.dht)
        self.averager = RoundAverager(self._template, self.dht, self.cfg, fingerprint=self.fingerprint,
                                      compression=self._compression, fault_hook=self._fault_hook,
                                      fragments=self._fragments)
        self.server = StateServer(self.averager)

    def close(self) -> None:
        self._writer.close(self.cfg.shutdown_timeout_s)  # the last progress and checksum go out first
        if self.averager is not None:
            self.averager.shutdown()
        if self.dht is not None:
            self.dht.shutdown()

    def check_alive(self) -> None:
        """Raise ``SwarmStartError`` (with what to do) when the averager process died.

        Without it the peer would go on skipping every round (``RoundAverager.average`` answers "not
        running") and train alone without saying so. A peer whose averager died stops instead; its last
        checkpoint resumes it.
        """
        averager = self.averager
        if averager is not None and not averager.is_alive():
            raise SwarmStartError(
                f"the averager process stopped (exit code {averager.exitcode}); this peer can no longer average. "
                "Restart it (with --checkpoint-dir it resumes from its last checkpoint) and check the log above "
                "for why it stopped (out of memory, killed)")

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58() if self.dht is not None else ""

    @property
    def served(self) -> int:
        """State snapshots handed to joiners so far."""
        return self.server.served if self.server is not None else 0

    def visible_maddrs(self) -> list[str]:
        return [a for a in visible_maddrs(self.dht) if "/p2p-circuit" not in a] if self.dht else []

    def diagnose_stall(self, epoch: int) -> Stall:
        """After a skipped round: why no round of this swarm can average, if this peer can tell (``swarm.reach``).
        Logged as a warning the first time and every 10th round after; never raises."""
        try:
            reach = own_reach(visible_maddrs(self.dht, latest=True) if self.dht else [], self.cfg.client_mode)
            # read afresh, any epoch: a peer left behind (or one whose policy read nothing yet) must not take
            # full peers it has not looked for as absent
            fetched = self._fetch_progress() if reach is Reach.CLIENT else []
            if fetched is None or (reach is Reach.CLIENT and not fetched):
                return Stall.NONE  # nothing read: no grounds to call the swarm stalled
            me = self.peer_id
            full = sum(not r.client_mode and r.peer_id != me and r.fingerprint == self.fingerprint for r in fetched)
            stall = diagnose(reach, full, self.cfg.initial_peers)
        except Exception as e:  # noqa: BLE001 - a diagnosis must never end a round
            logger.debug("Could not diagnose the skipped round: %r", e)
            return Stall.NONE
        if stall is not Stall.NONE and (self._stall_warned is None or epoch >= self._stall_warned + 10):
            self._stall_warned = epoch
            logger.warning("Round %d skipped and rounds will keep skipping: %s", epoch, MESSAGES[stall])
        return stall

    # ------------------------------------------------------------------ records

    def other_versions(self) -> dict[int, int]:
        """Peers of this run under other protocol versions' names (``records.other_versions``): ``{version:
        peers}``; empty when there are none or the DHT does not answer."""
        if self.dht is None:
            return {}
        try:
            return other_versions(self.dht, self.cfg.run_id)
        except Exception as e:  # noqa: BLE001 - a look that failed only costs the warning
            logger.debug("Could not look for peers of other protocol versions: %r", e)
            return {}

    def all_records(self) -> list[PeerProgress]:
        """Every valid progress record of this run, any model (to refuse a run of another model); empty when
        the DHT does not answer in time."""
        return self._fetch_progress() or []

    def records(self) -> list[PeerProgress]:
        """Progress records of this run and model; newly banned record writers are banned in the averager.
        When the DHT does not answer in time (``records._DHT_TIMEOUT_S``), the records read last."""
        fetched = self.read_records(self.cfg.run_id)
        if fetched is not None:
            self._seen = fetched
        return list(self._seen)

    def read_records(self, records_id: str) -> list[PeerProgress] | None:
        """Progress records of this model under ``records_id`` (the run's, or a fragment's), None when the DHT
        does not answer in time; newly banned record writers are banned in the averager."""
        fetched = self._fetch_progress(records_id)
        if fetched is None:
            return None
        for peer, reason in self.audit.take_bans().items():  # the readers skip them already
            self.averager.ban(peer, reason)
        return [r for r in fetched if r.fingerprint == self.fingerprint]

    def _fetch_progress(self, records_id: str | None = None) -> list[PeerProgress] | None:
        try:
            return fetch_progress(self.dht, records_id or self.cfg.run_id)
        except Exception as e:  # noqa: BLE001 - a round API never raises for network trouble
            logger.warning("Could not read the progress records: %r", e)
            return None

    def take_record_report(self) -> tuple[dict[str, int], list[str]]:
        """Rejected DHT records by kind and record bans since the last call."""
        return self.audit.take_report()

    def publish_progress(self, *, epoch: int, inner_step: int, rates: tuple[float, float, float],
                         phase_s: float = 0.0, fragment_epochs: Sequence[int] = ()) -> None:
        """Publish this peer's progress in the background (``dht_writer``): returns at once, a newer call
        replaces one the DHT has not taken yet. ``phase_s``: seconds into the inner phase of ``epoch``.

        With fragments, ``fragment_epochs`` holds each fragment's epoch: a record goes under each fragment's
        namespace with that epoch (what the fragment's rounds read: who is due, the fragment's swarm epoch),
        and the run's record carries ``epoch`` (the fragment rounds done, a joiner's progress display)."""
        if len(fragment_epochs) != len(self.fragment_ids):
            raise ValueError(f"{len(fragment_epochs)} fragment epochs for {len(self.fragment_ids)} fragments")
        steps_s, samples_s, tokens_s = rates
        dht, fingerprint, cfg = self.dht, self.fingerprint, self.cfg
        for slot, records_id, at in (("progress", cfg.run_id, epoch),
                                     *((f"progress {f}", self.fragment_ids[f], e) for f, e in enumerate(fragment_epochs))):
            self._writer.submit(slot, lambda records_id=records_id, at=at: publish_progress(
                dht, records_id, epoch=at, inner_step=inner_step, steps_per_s=steps_s, samples_per_s=samples_s,
                tokens_per_s=tokens_s, fingerprint=fingerprint, client_mode=cfg.client_mode,
                ttl_s=cfg.progress_ttl_s, phase_s=phase_s))

    def flush_publications(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until what was published reached the DHT (or failed); whether it did."""
        return self._writer.flush(timeout)

    def checksum_votes(self, epoch: int, records_id: str | None = None) -> dict[str, str]:
        """The valid checksums published for ``epoch`` by peers not banned: peer id -> digest (empty when the
        DHT does not answer). Who of them to believe is ``core.evidence``'s decision. ``records_id``: a
        fragment's namespace (its epochs and digests), by default the run's."""
        try:
            return fetch_checksums(self.dht, records_id or self.cfg.run_id, epoch)
        except Exception as e:  # noqa: BLE001 - a vote nobody could read changes nothing
            logger.warning("Could not read the checksums of epoch %d: %r", epoch, e)
            return {}

    # ------------------------------------------------------------------ state

    def serve(self, anchors: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], epoch: int,
              *, checksum: bool, manifest: TensorManifest | None = None,
              update: ServedUpdate | None = None, fragment: int | None = None) -> str:
        """Serve the state of ``epoch`` to joiners (the tensors themselves, no copy: call :meth:`withdraw`
        before changing them); publish its checksum too when ``checksum``. Returns its digest
        (``checksum.state_sha256``; ``manifest``: the anchors' when the caller hashed them already).
        ``update``: the round's update that led here, served until :meth:`withdraw_update`. ``fragment``:
        with fragments, the state (and ``epoch``) is that fragment's, served and voted on as its own."""
        records_id = self.cfg.run_id if fragment is None else self.fragment_ids[fragment]
        sha = self.server.publish(anchors, momentum, epoch, manifest, update, fragment=fragment,
                                  records_id=records_id)
        if checksum:  # in the background, as progress
            dht, ttl_s, digest = self.dht, self.cfg.checksum_ttl_s, sha
            slot = f"checksum {epoch}" if fragment is None else f"checksum {fragment} {epoch}"
            self._writer.submit(slot, lambda: publish_checksum(dht, records_id, epoch, digest, ttl_s=ttl_s))
        return sha

    def withdraw(self, fragment: int | None = None) -> None:
        """The served state (``fragment``'s, with fragments) is about to change; downloads in flight end first (at
        most a share of the round, ``core.chunks.ServeWait``, and never past ``state_download_timeout_s``, a
        joiner's own limit)."""
        if self.server is not None:
            self.server.withdraw(self.cfg.state_download_timeout_s, fragment=fragment)

    def withdraw_update(self) -> None:
        """The served update's buffers are about to be overwritten (see ``StateServer.withdraw_update``)."""
        if self.server is not None:
            self.server.withdraw_update(self.cfg.state_download_timeout_s)

    def download_update(self, templates: Sequence[torch.Tensor], base_sha: str, base_epoch: int,
                        timeout: float, trusted: frozenset[str] | None = None) -> SwarmUpdate | None:
        """The last round's update from state ``base_sha`` (epoch ``base_epoch``), from every donor serving
        it, ``trusted`` donors first; see ``swarm.catchup``."""
        return download_update(self.averager, templates, base_sha, base_epoch, timeout=timeout, trusted=trusted)

    def fresh_buffers(self, fragment: int = 0) -> list[torch.Tensor] | None:
        """The averager's shared fresh buffers (``fragment``'s views, with fragments), to write a pseudo-gradient
        into (None while a round holds them); pass them to :meth:`average` as ``delta`` and no copy is made."""
        with self.averager.fresh_buffers(0.0, fragment=fragment) as buffers:
            return buffers

    def download(self, templates: Sequence[torch.Tensor], min_epoch: int, timeout: float | None = None,
                 trusted: frozenset[str] | None = None, backed: dict[str, int] | None = None,
                 fragment: int | None = None) -> SwarmState | None:
        """The swarm's verified state of ``min_epoch`` or newer (parameters and momentum), or None;
        ``trusted`` and ``backed`` as in ``state.download_state``. ``fragment``: that fragment's state only
        (``templates`` are its tensors, ``min_epoch`` its epoch)."""
        # the momentum has the anchors' shapes and dtypes: the templates serve twice (only those are read)
        if fragment is None:
            return download_state(self.averager, templates, templates, min_epoch=min_epoch, timeout=timeout,
                                  trusted=trusted, partial_dir=self.partial_dir, backed=backed)
        partial = self.partial_dir / f"fragment-{fragment}" if self.partial_dir is not None else None
        return download_state(self.averager, templates, templates, min_epoch=min_epoch, timeout=timeout,
                              trusted=trusted, partial_dir=partial, backed=backed,
                              selector=fragment_selector(fragment), run_id=self.fragment_ids[fragment])

    def average(self, delta: Sequence[torch.Tensor], weight: float, staleness: int, epoch: int,
                stale: Sequence[torch.Tensor] | None, stale_weight: float, copy_out: bool = True,
                left_behind: Callable[[bool], bool] | None = None, fragment: int = 0,
                seen: Sequence[PeerProgress] | None = None,
                vouched: Callable[[str], bool] | None = None) -> RoundResult:
        """One round; the group forms as soon as every peer due in it has joined. Who is due comes from the
        records the round policy's observation just read (:meth:`records`, or ``seen``: a fragment's), see
        ``swarm.quorum``. ``copy_out=False``: the fresh mean is a view of the shared buffer; ``left_behind``:
        asked while no group has formed, ``True`` asks the averager process to give the round up, which it does
        only if no group has formed by then (both: see ``RoundAverager.average``). ``fragment``: with
        fragments, the one this round averages at its ``epoch``. ``vouched``: the peers whose records, written
        again after a round cut them, prove them alive (``core.deadlines``; ``Evidence.trusts``), none without."""
        seen = list(self._seen if seen is None else seen)
        due = due_peers(seen, epoch)
        self._warn_above_target(len(due), epoch)
        # A client never declares, so it can join only a leader whose declaration ends before its own: one that
        # stepped back (``quorum.EarlyAssembly``) would turn it away. With a client due, nobody steps back.
        step_back = not self.cfg.client_mode and not any(r.client_mode for r in seen if r.peer_id in due)
        return self.averager.average(delta, weight, staleness, epoch, stale=stale, stale_weight=stale_weight,
                                     due=due, copy_out=copy_out, left_behind=left_behind, step_back=step_back,
                                     fragment=fragment, published=None if vouched is None else
                                     {r.peer_id: r.expiration_time for r in seen if vouched(r.peer_id)})

    def _warn_above_target(self, due: int, epoch: int) -> None:
        """Say so when more peers are due than one group holds (once per 50 rounds): the swarm then splits into
        groups whose averages differ, and each round the minority groups download the state (measured in
        BENCHMARKS.md "Swarm scale with churn"). Counted from signed records, so Sybils can raise it: it is a
        warning to the operator, never an input to a decision."""
        if due <= self.cfg.target_group_size or epoch < self._warned_epoch + 50:
            return
        self._warned_epoch = epoch
        logger.warning("%d peers are due in round %d, more than --target-group-size %d: rounds split into several "
                       "groups whose averages differ, and the minority downloads the state every round. Raise "
                       "--target-group-size on every peer to at least %d", due, epoch,
                       self.cfg.target_group_size, due)
