"""The contract between a plain PyTorch training loop and the swarm: a few methods, state passed in.

::

    session = SwarmSession(cfg, params, fingerprint)   # params: the model's live tensors
    session.start()                                     # DHT, averager; resume or download the swarm's state
    while not session.done:
        steps = session.local_steps()                   # DyLU, from the speeds peers publish
        stats = trainer.train_steps(steps, session.on_inner_step)
        report = session.end_round(stats)               # average, outer step; params updated in place
    session.close()

A round, from this peer's side (epoch ``e``: its anchors are θ(e)):

1. **Behind?** If the swarm's epoch ``G`` (the largest epoch peers publish in the DHT) is past ``e``, this
   peer missed round ``e``. Its pseudo-gradient is kept as late work (origin ``e``), it downloads the
   current state, and the work is folded into its next round with staleness ``G' - e`` through the core's
   delayed rule (momentum-free, see :mod:`p2p_diloco.core.delayed`). Outcome ``resynced``.
2. **Minority?** If a strict majority of peers published another checksum for epoch ``e`` than ours, our
   parameters drifted: same as above.
3. **Averaging.** Otherwise the peer joins matchmaking for epoch ``e`` with its fresh work (and any late
   work). When every member confirms a complete all-reduce, all apply the same outer step and publish the
   new checksum. Outcome ``averaged``, or ``folded_late`` when our late work went in.
4. **Skipped.** A failed or partial all-reduce is never applied. If the others advanced anyway, step 1
   applies next time. If nobody advanced, the peer keeps its local parameters and trains on from them, so
   the next pseudo-gradient covers both phases and no work is lost (outcome ``skipped``).
5. **Alone.** With no other live peer of this run and model in the DHT, the peer applies its own
   pseudo-gradient (DiLoCo with k = 1) so a lone volunteer still makes progress; a peer that saw others
   first carries its work for ``solo_after_s`` (a partition must not split the swarm), and without a donor
   to catch up from it trains on from its own parameters (step 4's rule), so an outage loses no work.

With ``--overlap eager`` step 3 changes (see :mod:`p2p_diloco.peer.eager`): the all-reduce of epoch ``e``
runs in the background during the next inner phase, and the outer step uses the core's eager rule with the
complete average of epoch ``e - 1`` (outcome ``averaged``) or, when that one was late, failed or partial,
the own term only (outcome ``own_only``). Peers' parameters then legitimately differ by their last own
term, so step 2 (checksum majority) is off and no checksums are published; with every round complete the
difference is exactly ``lr * share * (Δ_m(e) − Δ_m'(e))`` for plain SGD (momentum 0), and bounded by a
few such terms with momentum. A state download or a solo round resets the eager state.

How this differs from hivemind's ``Optimizer``: there, peers accumulate gradients towards a global batch
and average after every epoch; late peers' gradients are discarded and the peer loads state. Here peers
average pseudo-gradients after hundreds of local steps, late work is folded into a later round, and the
averaged result is bitwise identical on every member so parameters stay provably in sync (checksums).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from p2p_diloco.core.delayed import (
    Contribution,
    RoundAggregate,
    StalenessPolicy,
    aggregate_round,
    summarize_round,
)
from p2p_diloco.core.dylu import DyLU, late_start_steps
from p2p_diloco.core.hivemind_codecs import wire_compression
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.peer.eager import EagerOverlap, eager_round
from p2p_diloco.peer.faults import FaultPlan
from p2p_diloco.peer.report import LateWork, RoundReport, SessionListener
from p2p_diloco.swarm import (
    RoundAverager,
    StateServer,
    SwarmStartError,
    download_state,
    fetch_progress,
    majority_checksum,
    params_sha256,
    publish_checksum,
    publish_progress,
    run_validator,
    start_dht,
    visible_maddrs,
)
from p2p_diloco.swarm.signing import record_audit
from p2p_diloco.trainer import InnerStats

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0
"""Publish progress at most this often during an inner phase (it is this peer's presence signal)."""


class SwarmSession:
    """Joins the swarm and turns each inner phase into an outer step; owns no training state.

    Args:
        cfg: the peer's configuration.
        params: the model's live parameters; the session writes θ(t) into them in place.
        fingerprint: the model's architecture digest; peers of another model are never averaged with.
        listeners: receivers of progress (metrics, terminal display); see :class:`SessionListener`.
        faults: injected faults (tests and drills only; see :mod:`p2p_diloco.peer.faults`).
    """

    def __init__(self, cfg: PeerConfig, params: list[torch.Tensor], fingerprint: str,
                 listeners: list[SessionListener] | None = None, faults: FaultPlan | None = None) -> None:
        self.cfg = cfg
        self.faults = faults
        self.listeners = list(listeners or [])
        self.params = params
        self.fingerprint = fingerprint
        self.policy = StalenessPolicy(cfg.outer.staleness_decay, cfg.outer.max_staleness)
        # Anchors on the CPU: the averager shares them with its process and the outer step is cheap.
        self.state = OuterState(params, lr=cfg.outer.lr, momentum=cfg.outer.momentum, policy=self.policy,
                                device="cpu")
        self.dylu = DyLU(cfg.outer.local_steps, min_steps=cfg.outer.min_local_steps)
        self.late: LateWork | None = None
        self.carry_weight = 0.0
        self.continue_local = False
        self.my_speed: float | None = None
        self.rounds_done = 0
        self.peers_visible = 0
        self._last_seen_others: float | None = None
        self._late_start_s = 0.0
        self.inner_step = 0
        self.planned_steps = cfg.outer.local_steps
        self._last_progress = 0.0
        self._last_rates = (0.0, 0.0, 0.0)
        self.dht = None
        self.averager: RoundAverager | None = None
        self.server: StateServer | None = None
        self.overlap: EagerOverlap | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def done(self) -> bool:
        return bool(self.cfg.run.max_rounds) and self.rounds_done >= self.cfg.run.max_rounds

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58() if self.dht is not None else ""

    def start(self, resume_tensors: dict[str, torch.Tensor] | None = None, resume_epoch: int = 0) -> str:
        """Start the DHT and averager, then bring the state up to the swarm's. Returns how it started."""
        self.dht = start_dht(self.cfg.swarm, record_validators=[run_validator(self.cfg.swarm.run_id)])
        self.averager = RoundAverager(
            self.state.anchors, self.dht, self.cfg.swarm, fingerprint=self.fingerprint,
            compression=wire_compression(self.cfg.outer.compression, self.cfg.outer.error_feedback),
            fault_hook=self.faults.averager_hook if self.faults else None,
        )
        self.server = StateServer(self.averager)
        if self.cfg.outer.overlap == "eager":
            self.overlap = EagerOverlap(self.averager, self.peer_id)
        how = "fresh"
        if resume_tensors is not None:
            self.state.load_state_tensors(resume_tensors, resume_epoch)
            self.state.begin(self.params)
            how = f"resumed at epoch {resume_epoch}"
        self._refuse_other_models()
        self._serve_state()
        self._publish_progress()
        swarm_epoch = self._swarm_epoch()
        if swarm_epoch is not None and swarm_epoch > self.epoch:
            how = self._join(swarm_epoch) or how
        return how

    def _refuse_other_models(self) -> None:
        """Stop with a clear message when this run's peers all train another model than ours.

        Averaging could not mix them anyway (the fingerprint is part of the matchmaking key), but a peer
        that silently trains alone is the worst outcome for a volunteer.
        """
        others = [r for r in fetch_progress(self.dht, self.cfg.swarm.run_id) if r.peer_id != self.peer_id]
        if others and all(r.fingerprint != self.fingerprint for r in others):
            theirs = sorted({r.fingerprint for r in others})
            raise SwarmStartError(
                f"refused: the {len(others)} peer(s) of run {self.cfg.swarm.run_id!r} train a model with fingerprint "
                f"{', '.join(theirs)}, ours is {self.fingerprint}. Use the run's --model, --seq-len and "
                "--tokenizer, or another --run-id to start a separate run"
            )

    def _join(self, swarm_epoch: int) -> str | None:
        """Download the swarm's state; wait up to state_download_timeout_s for a donor to appear."""
        self._notify("status", "syncing", swarm_epoch)
        deadline = time.monotonic() + self.cfg.swarm.state_download_timeout_s
        while time.monotonic() < deadline:
            if self._resync(min_epoch=swarm_epoch, timeout=max(1.0, deadline - time.monotonic())):
                return f"joined at epoch {self.epoch}"
            logger.info("No peer shares the state of epoch %d yet; retrying", swarm_epoch)
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        logger.warning("No peer shared its state within %.0f s; training from our own state at epoch %d",
                       self.cfg.swarm.state_download_timeout_s, self.epoch)
        return None

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close(timeout=self.cfg.swarm.shutdown_timeout_s)
        if self.averager is not None:
            self.averager.shutdown()
        if self.dht is not None:
            self.dht.shutdown()

    def visible_maddrs(self) -> list[str]:
        return [a for a in visible_maddrs(self.dht) if "/p2p-circuit" not in a] if self.dht else []

    # ------------------------------------------------------------------ per round

    def local_steps(self) -> int:
        """This round's inner steps: H for the fastest peer, proportionally fewer for slower ones."""
        for record in self._records():
            if record.peer_id != self.peer_id and record.steps_per_s > 0:
                self.dylu.observe(record.peer_id, record.steps_per_s)
        steps = self.dylu.local_steps(self.my_speed)
        if self._late_start_s > 0:
            speed = self.my_speed or self.dylu.fastest(None)
            self.planned_steps = late_start_steps(steps, self._late_start_s, speed, self.cfg.outer.min_local_steps)
            logger.info("Started %.1f s after the swarm (state download): %d inner steps instead of %d",
                        self._late_start_s, self.planned_steps, steps)
            self._late_start_s = 0.0
        else:
            self.planned_steps = steps
        return self.planned_steps

    def begin_round(self) -> None:
        """Start the inner phase from the anchors (unless the last round was skipped: then train on)."""
        if not self.continue_local:
            self.state.begin(self.params)
        if self.faults:
            self.faults.set_epoch(self.epoch)
        self._notify("status", "training", self.epoch)

    def on_inner_step(self, step: int, loss: float) -> None:
        """Pass to ``InnerTrainer.train_steps``: keeps this peer's progress record fresh in the DHT."""
        self.inner_step += 1
        self._notify("inner_step", step, self.planned_steps, loss, self.epoch)
        if self.faults:
            self.faults.after_inner_step()
        now = time.monotonic()
        if now - self._last_progress >= PROGRESS_EVERY_S:
            self._publish_progress()

    def end_round(self, stats: InnerStats) -> RoundReport:
        """Average this phase's work with the swarm and apply the outer step (see the module docstring)."""
        self.rounds_done += 1
        if stats.steps and stats.seconds > 0:
            self.my_speed = stats.steps_per_second
            self.dylu.observe(self.peer_id, self.my_speed)
            self._last_rates = (stats.steps_per_second, stats.samples / stats.seconds, stats.tokens_per_second)
        weight = self.carry_weight + float(stats.samples)
        delta = [t.clone() for t in self.state.pseudo_gradient(self.params)]
        report = RoundReport(epoch=self.epoch, outcome="", inner_steps=stats.steps,
                             inner_seconds=stats.seconds, train_loss=stats.mean_loss)
        swarm_epoch = self._swarm_epoch()
        # Eager peers step without waiting for each other, so a peer one epoch ahead is normal there.
        slack = 1 if self.overlap is not None else 0
        behind = swarm_epoch is not None and swarm_epoch > self.epoch + slack
        # Eager peers differ by their own terms by design (see the module docstring): no checksum vote.
        drifted = not behind and self.overlap is None and self._in_minority()
        if behind or drifted:
            reason = (f"swarm is at epoch {swarm_epoch}, we are at {self.epoch}" if behind
                      else f"our parameters differ from the majority checksum of epoch {self.epoch}")
            synced = self._catch_up(delta, weight, min_epoch=swarm_epoch if behind else self.epoch)
            report.outcome, report.reason = "resynced" if synced else "skipped", reason
        elif self.peers_visible <= 1 and self._may_go_solo():
            self._apply_solo(delta, weight, report)
        elif self.overlap is not None:
            eager_round(self, delta, weight, report, stats.seconds)
        else:
            started = time.monotonic()
            self._average(delta, weight, report)
            report.blocked_seconds = time.monotonic() - started
        report.new_epoch = self.epoch
        report.params_sha256 = params_sha256(self.state.anchors)
        self._publish_progress()
        report.rejected_records, report.record_bans = record_audit(self.dht).take_report()
        self._notify("round", report, stats)
        return report

    # ------------------------------------------------------------------ internals

    def _late_for_round(self) -> tuple[list[torch.Tensor] | None, float, int]:
        """Our late work for this round as (delta, effective weight, staleness); dropped when too old."""
        if self.late is None:
            return None, 0.0, 0
        staleness = max(1, self.epoch - self.late.origin_epoch)
        factor = self.policy.factor(staleness)
        if factor == 0.0:
            logger.info("Dropping late work of epoch %d: %d rounds old (max %d)", self.late.origin_epoch,
                        staleness, self.policy.max_staleness)
            self.late = None
            return None, 0.0, 0
        return self.late.delta, factor * self.late.weight, staleness

    def _average(self, delta: list[torch.Tensor], weight: float, report: RoundReport) -> None:
        stale, stale_weight, staleness = self._late_for_round()
        self._notify("status", "averaging", self.epoch)
        if self.faults:
            self.faults.before_allreduce()
        result = self.averager.average(delta, weight, staleness, self.epoch, stale=stale, stale_weight=stale_weight)
        report.reason = result.reason
        report.group_size, report.contributors = result.group_size, list(result.contributors)
        report.weights = [w + s for w, s in zip(result.weights, result.stale_weights, strict=True)]
        report.staleness = list(result.stalenesses)
        report.rejected = list(result.rejected)
        report.allreduce_seconds, report.wait_seconds = result.allreduce_seconds, result.wait_seconds
        report.bytes_sent, report.bytes_received = result.bytes_sent, result.bytes_received
        if not result.averaged:
            report.outcome = "skipped"
            swarm_epoch = self._swarm_epoch() or 0
            if swarm_epoch > self.epoch:
                # The others completed the round without us: our work becomes late work.
                if self._catch_up(delta, weight, min_epoch=swarm_epoch):
                    report.outcome = "resynced"
            else:
                # Nobody advanced: keep training from the local parameters, so no work is lost.
                self.continue_local, self.carry_weight = True, weight
            return
        stats = summarize_round([w or s for w, s in zip(result.weights, result.stale_weights, strict=True)],
                                list(result.stalenesses), self.policy, list(result.contributors))
        self._apply(RoundAggregate(result.fresh_mean, result.stale_term, stats))
        report.late_folded = sum(1 for s in result.stalenesses if s > 0)
        if stale is not None:
            report.outcome = "folded_late"
            self.late = None
        else:
            report.outcome = "averaged"

    def _apply_solo(self, delta: list[torch.Tensor], weight: float, report: RoundReport) -> None:
        stale, stale_weight, staleness = self._late_for_round()
        contributions = [Contribution(delta, weight, 0, self.peer_id)]
        if stale is not None:
            contributions.append(Contribution(stale, stale_weight, staleness, self.peer_id))
        self._apply(aggregate_round(contributions, self.policy))
        report.group_size, report.contributors = 1, [self.peer_id]
        report.weights, report.staleness = [c.weight for c in contributions], [c.staleness for c in contributions]
        report.outcome = "folded_late" if stale is not None else "averaged"
        report.reason = "no other peer visible: applied our own pseudo-gradient"
        report.late_folded = int(stale is not None)
        self.late = None
        if self.overlap is not None:
            # Any background round belongs to the group we no longer average with.
            self.overlap.discard("this peer applied a solo round since")
            self.state.eager.reset()

    def _apply(self, aggregate: RoundAggregate) -> None:
        self.state.apply(aggregate, self.params)
        self.continue_local, self.carry_weight = False, 0.0
        sha = self._serve_state()
        if self.overlap is not None:
            return  # eager peers publish no checksums (see the module docstring)
        try:
            publish_checksum(self.dht, self.cfg.swarm.run_id, self.epoch, sha, ttl_s=self.cfg.swarm.checksum_ttl_s)
        except ValueError as e:
            logger.warning("Could not publish the checksum of epoch %d: %s", self.epoch, e)

    def _catch_up(self, delta: list[torch.Tensor], weight: float, min_epoch: int) -> bool:
        """Load the swarm's state and keep this round's work as late work; ``False`` if no donor answered.

        Without a donor (a partition, every donor busy) nothing is stashed: the peer trains on from its own
        parameters, so the next pseudo-gradient covers this round too and a long outage loses no work.
        Stashing first would restart every round from the old anchors and keep only the last one's work.
        """
        origin = self.epoch
        if not self._resync(min_epoch=min_epoch):
            self.continue_local, self.carry_weight = True, weight
            return False
        if self.late is not None:
            # Late again before the older late work was folded in (a peer that chases the swarm after an
            # outage): both phases' work goes in together, as a skipped round's work carries into the next,
            # and staleness counts from the older one. Replacing it would lose the older phase's work.
            logger.info("Adding the work of epoch %d to the late work of epoch %d", origin, self.late.origin_epoch)
            for kept, new in zip(self.late.delta, delta, strict=True):
                kept.add_(new)
            self.late.weight += weight
            return True
        self.late = LateWork(delta, weight, origin)
        return True

    def _may_go_solo(self) -> bool:
        """A peer that saw others recently waits ``solo_after_s`` before stepping alone (see SwarmConfig)."""
        if self._last_seen_others is None:
            return True
        unseen = time.monotonic() - self._last_seen_others
        if unseen >= self.cfg.swarm.solo_after_s:
            return True
        logger.info("No other peer visible for %.0f s; carrying our work for up to %.0f s before going on alone",
                    unseen, self.cfg.swarm.solo_after_s)
        return False

    def _resync(self, min_epoch: int, timeout: float | None = None) -> bool:
        """Download and load the swarm's verified state of ``min_epoch`` or newer."""
        self._notify("status", "syncing", min_epoch)
        templates = self.state.anchors
        began = time.monotonic()
        state = download_state(self.averager, templates, [torch.zeros_like(t) for t in templates],
                               min_epoch=min_epoch, timeout=timeout)
        self._notify("state_transfer", "received", state is not None)
        if state is None:
            logger.warning("Could not download the swarm's state (epoch >= %d); keeping ours", min_epoch)
            return False
        tensors = {f"param.{i}": t for i, t in enumerate(state.params)}
        if self.state.outer.momentum > 0:
            # Donors always serve a momentum (zeros when they have none); without momentum there is none to load.
            tensors.update({f"outer.momentum.{i}": t for i, t in enumerate(state.opt_tensors)})
        self.state.load_state_tensors(tensors, state.epoch)
        self.state.eager.reset()
        if self.overlap is not None:
            self.overlap.discard("this peer downloaded a new state since")
        self.state.begin(self.params)
        self.continue_local, self.carry_weight = False, 0.0
        self._serve_state()
        self._late_start_s = time.monotonic() - began
        logger.info("Synchronised to epoch %d from %s", state.epoch, state.donor)
        return True

    def _serve_state(self) -> str:
        momentum = [m if m is not None else torch.zeros_like(a)
                    for m, a in zip(self.state.outer.momentum_buffers(), self.state.anchors, strict=True)]
        return self.server.publish(self.state.anchors, momentum, self.epoch)

    def _records(self) -> list:
        records = [r for r in fetch_progress(self.dht, self.cfg.swarm.run_id) if r.fingerprint == self.fingerprint]
        for peer, reason in record_audit(self.dht).take_bans().items():  # the readers skip them already
            self.averager.ban(peer, reason)
        self.peers_visible = len(records)
        if any(r.peer_id != self.peer_id for r in records):
            self._last_seen_others = time.monotonic()
        epochs = [r.epoch for r in records if not r.client_mode]
        self._notify("swarm", self.peers_visible, max(epochs) if epochs else None)
        return records

    def _notify(self, method: str, *args: Any) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, method)(*args)
            except Exception:  # noqa: BLE001 - a display or metrics bug must not stop training
                logger.exception("listener %s.%s failed", type(listener).__name__, method)

    def _swarm_epoch(self) -> int | None:
        epochs = [r.epoch for r in self._records() if not r.client_mode]
        return max(epochs) if epochs else None

    def _in_minority(self) -> bool:
        sha, count, total = majority_checksum(self.dht, self.cfg.swarm.run_id, self.epoch)
        return sha is not None and 2 * count > total and sha != params_sha256(self.state.anchors)

    def _publish_progress(self) -> None:
        steps_s, samples_s, tokens_s = (x if math.isfinite(x) else 0.0 for x in self._last_rates)
        try:
            publish_progress(
                self.dht, self.cfg.swarm.run_id, epoch=self.epoch, inner_step=self.inner_step,
                steps_per_s=steps_s, samples_per_s=samples_s, tokens_per_s=tokens_s,
                fingerprint=self.fingerprint, client_mode=self.cfg.swarm.client_mode,
                ttl_s=self.cfg.swarm.progress_ttl_s,
            )
        except Exception as e:  # noqa: BLE001 - a missed progress update must not stop training
            logger.warning("Could not publish progress: %s", e)
        self._last_progress = time.monotonic()
