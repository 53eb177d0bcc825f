"""The contract between a plain PyTorch training loop and the swarm: a few methods, state passed in.

This is the loop ``run_peer`` runs (:mod:`p2p_diloco.cli.run_peer`), less its printing, evaluation and
metrics; ``tests/unit/test_session_contract.py`` checks that each line below is in ``run_peer``::

    session = SwarmSession(cfg, list(model.parameters()), fingerprint, listeners=[display],
    session.load_state_dict(state_dict_of(ck))     # a checkpoint: outer state, epoch, inner step, data position
    how = session.start()                          # DHT, averager; download the swarm's state if behind
    local = build_local(cfg, session.data_id, session.data_position, parts=(tokenizer, model))
    session.bind_data(local.stream)                # its position goes into state_dict()
    trainer = local.trainer
    trainer.resume_at(session.inner_step)
    while not session.done:
        session.begin_round()                      # params = anchors (or train on after a skipped round)
        steps = session.local_steps()              # DyLU, from the speeds peers publish
        stats = trainer.train_steps(steps, session.on_inner_step)
        report = session.end_round(stats)          # the round policy; params updated in place
        if cfg.run.checkpoint_dir and session.rounds_done % cfg.run.checkpoint_every == 0:
            save_session(session, on_saved)        # in the background, from the live state (peer/resume.py)
    session.close()

What a round does is the round policy's (:mod:`p2p_diloco.core.rounds`, executed by
:class:`p2p_diloco.core.round_driver.RoundDriver`, the same code the simulator runs); the swarm side of each
action is :class:`p2p_diloco.peer.port.SwarmPort`, the hivemind side :class:`p2p_diloco.swarm.facade.Swarm`.

How this differs from hivemind's ``Optimizer``: there, peers accumulate gradients towards a global batch
and average after every epoch; late peers' gradients are discarded and the peer loads state. Here peers
average pseudo-gradients after hundreds of local steps, late work is folded into a later round, and the
averaged result is bitwise identical on every member so parameters stay provably in sync (checksums).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from p2p_diloco.core.delayed import StalenessPolicy
from p2p_diloco.core.dylu import DyLU, late_start_steps
from p2p_diloco.core.evidence import Evidence
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.round_driver import RoundDriver
from p2p_diloco.core.rounds import STALL_HINTS, Outcome, RoundPolicy, RoundReport, Stall
from p2p_diloco.data.loader import DataPosition
from p2p_diloco.host_memory import trim_before_fork
from p2p_diloco.inner_stats import InnerStats
from p2p_diloco.peer.admission import refuse_other_models, share_host_state, warn_other_versions
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.peer.eager import EagerOverlap
from p2p_diloco.peer.faults import NO_FAULTS, FaultHooks
from p2p_diloco.peer.port import SwarmPort
from p2p_diloco.peer.report import SessionListener
from p2p_diloco.swarm.config import read_allowed_peers
from p2p_diloco.swarm.facade import Swarm
from p2p_diloco.swarm.hivemind_codecs import wire_compression
from p2p_diloco.swarm.partial import drop_unused

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0
"""Publish progress at most this often during an inner phase (it is this peer's presence signal)."""


class DataStream(Protocol):
    position: DataPosition


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
                 listeners: list[SessionListener] | None = None, faults: FaultHooks = NO_FAULTS) -> None:
        self._setup(cfg, params, fingerprint, faults)
        policy = self.staleness_policy()
        # Anchors on the CPU: the averager shares them with its process and the outer step is cheap.
        self.state = OuterState(params, lr=cfg.outer.lr, momentum=cfg.outer.momentum, policy=policy, device="cpu")
        self.swarm = self._make_swarm(self.state.anchors)
        eager = cfg.outer.overlap == "eager"
        self.port = SwarmPort(self.swarm, self.state, params, list(listeners or []), faults, eager,
                              Evidence(trusted=self.trusted_peers()))
        self.driver = RoundDriver(self.state, params, RoundPolicy(policy, cfg.swarm.solo_after_s, eager),
                                  self.port, "", matchmaking_time_s=cfg.swarm.matchmaking_time_s)

    def _setup(self, cfg: PeerConfig, params: list[torch.Tensor], fingerprint: str, faults: FaultHooks) -> None:
        """What every session keeps besides its rounds: the configuration, the step counters and the data."""
        self.cfg, self.params, self.fingerprint, self.faults = cfg, params, fingerprint, faults
        self.dylu = DyLU(cfg.outer.local_steps, min_steps=cfg.outer.min_local_steps)
        self.my_speed: float | None = None
        self.rounds_done = 0
        self.inner_step = 0
        self.planned_steps = cfg.outer.local_steps
        self.data_position: DataPosition | None = None
        self._data_id: str | None = None
        self._resumed = False
        self._stream: DataStream | None = None
        self._last_progress = 0.0
        self._last_rates = (0.0, 0.0, 0.0)
        self._phase_began: float | None = None  # monotonic start of the inner phase under way, if one is

    def staleness_policy(self) -> StalenessPolicy:
        return StalenessPolicy(self.cfg.outer.staleness_decay, self.cfg.outer.max_staleness)

    def trusted_peers(self) -> tuple[str, ...] | frozenset[str]:
        """``--trusted-peers``, read (empty without)."""
        swarm = self.cfg.swarm
        return read_allowed_peers(swarm.trusted_peers, "trusted_peers") if swarm.trusted_peers else ()

    def _make_swarm(self, anchors: list[torch.Tensor], fragments: list[list[int]] | None = None) -> Swarm:
        """The swarm over ``anchors`` (the model's, in order), with the run's wire codec."""
        cfg = self.cfg
        swarm = Swarm(cfg.swarm, self.fingerprint, anchors,
                      wire_compression(cfg.outer.compression, cfg.outer.error_feedback,
                                       error_feedback_decay=cfg.outer.error_feedback_decay,
                                       chunk_size=cfg.outer.topk_chunk_size, k=cfg.outer.topk_k,
                                       credit_undelivered=cfg.outer.credit_undelivered),
                      self.faults.swarm_hook(), fragments=fragments)
        if cfg.run.checkpoint_dir:  # a state download cut by a restart resumes from its verified chunks
            swarm.partial_dir = Path(cfg.run.checkpoint_dir).expanduser() / "state-partial"
            drop_unused(swarm.partial_dir, len(fragments) if fragments else 1)
        return swarm

    def _notify(self, method: str, *args: Any) -> None:
        self.port.view.notify(method, *args)

    # ------------------------------------------------------------------ state

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def done(self) -> bool:
        return bool(self.cfg.run.max_rounds) and self.rounds_done >= self.cfg.run.max_rounds

    @property
    def peer_id(self) -> str:
        return self.swarm.peer_id

    @property
    def data_id(self) -> str:
        """Whose data shard this peer reads: its own peer id, or the one it resumed with."""
        return self._data_id or self.peer_id

    def params_sha256(self) -> str:
        """The sha256 of the anchors (what peers compare in the checksum vote)."""
        return self.port.serving.anchors_sha()

    @property
    def served_downloads(self) -> int:
        return self.swarm.served

    def add_listener(self, listener: SessionListener) -> None:
        self.port.view.listeners.append(listener)

    def bind_data(self, stream: DataStream) -> None:
        """The training data stream, whose position :meth:`state_dict` saves."""
        self._stream = stream

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """Everything a restart needs: the outer state (anchors, momentum, eager term) and its epoch, the inner
        step and the data stream's position. Late or carried work is not kept (a restart re-trains it).
        ``copy=False``: the live anchors and momentum, no copy (see :meth:`save_in_background`)."""
        position = self._stream.position if self._stream is not None else self.data_position
        return {"epoch": self.epoch, "outer": self.state.state_tensors(copy=copy), "inner_step": self.inner_step,
                "data_id": self.data_id, "data_position": (position or DataPosition()).as_dict()}

    def save_in_background(self, write: Callable[[dict[str, Any]], None]) -> threading.Thread:
        """Run ``write(state_dict)`` on a background thread, from the live anchors and momentum (no copy).

        The state dict is taken now; the anchors do not change until the next outer step or state download,
        and those wait for ``write`` to finish first, so what it writes is one consistent state. A previous
        write still running is waited for first. ``write`` must not raise (log instead)."""
        self.port.serving.wait_writer()
        state = self.state_dict(copy=False)
        thread = threading.Thread(target=write, args=(state,), name="checkpoint-writer", daemon=True)
        thread.start()
        self.port.serving.writer = thread
        return thread

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s output (before :meth:`start`); ``ValueError`` names what is wrong (a
        checkpoint written with ``--fragments``: its epoch is a sum of fragments' epochs, its parameters were at
        different epochs per fragment)."""
        if state.get("fragment_epochs") is not None:
            raise ValueError("the checkpoint was written by a peer with --fragments above 1; resume with that "
                             "value, or start from another --checkpoint-dir")
        counters = self._resume_counters(state)
        self.state.load_state_tensors(state["outer"], state["epoch"])
        self.state.begin(self.params)
        self._resumed_at(*counters)

    @staticmethod
    def _resume_counters(state: dict[str, Any]) -> tuple[int, str | None, DataPosition]:
        """A state dict's inner step, data id and data position, checked (``ValueError`` naming what is wrong)."""
        inner_step, data_id = state.get("inner_step", 0), state.get("data_id")
        if not isinstance(inner_step, int) or inner_step < 0:
            raise ValueError(f"inner_step must be a non-negative integer, got {inner_step!r}")
        if data_id is not None and not isinstance(data_id, str):
            raise ValueError(f"data_id must be a string, got {data_id!r}")
        return inner_step, data_id, DataPosition.from_dict(state.get("data_position") or {})

    def _resumed_at(self, inner_step: int, data_id: str | None, position: DataPosition) -> None:
        self.inner_step, self._data_id, self.data_position = inner_step, data_id, position
        self._resumed = True

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Start the DHT and averager, then bring the state up to the swarm's. Returns how it started.

        ``SwarmStartError`` when ``/dev/shm`` cannot hold the shared tensors (``p2p_diloco.shared_memory``)."""
        share_host_state(self.state, self.params)  # before the fork; SwarmStartError without room
        trim_before_fork()  # the private copies just freed must not be inherited (host_memory)
        self.swarm.start()
        self.driver.peer_id = self.peer_id
        self.port.view.start()
        if self.port.eager:
            self.port.overlap = EagerOverlap(self.swarm, self.swarm.peer_id)
        how = f"resumed at epoch {self.epoch}" if self._resumed else "fresh"
        refuse_other_models(self.swarm, self.port.evidence, self.fingerprint, self.cfg.swarm.run_id)
        warn_other_versions(self.swarm, self.cfg.swarm.run_id)
        self.port.serving.serve(checksum=False)
        self._publish_progress()
        swarm_epoch = self.port.swarm_epoch()
        if swarm_epoch is not None and swarm_epoch > self.epoch:
            # Download the swarm's state (``core.sync.Catchup.join``: retried while a donor may appear).
            self.port.view.notify("status", "syncing", swarm_epoch)
            if self.port.catchup.join(swarm_epoch) is not None:
                self.driver.new_state()
                how = f"joined at epoch {self.epoch}"
        return how

    def close(self) -> None:
        if self.port.overlap is not None:
            self.port.overlap.close(timeout=self.cfg.swarm.shutdown_timeout_s)
        self.port.serving.wait_writer()
        self.swarm.close()

    def visible_maddrs(self) -> list[str]:
        return self.swarm.visible_maddrs()

    # ------------------------------------------------------------------ per round

    def local_steps(self) -> int:
        """This round's inner steps: H for the fastest peer, proportionally fewer for slower ones.

        Only trusted peers' speeds count (``core.evidence``: peers this one averaged with, or
        ``--trusted-peers``): a published speed is a free claim, and one record claiming 10^12 steps/s
        would otherwise cut every honest peer down to ``min_local_steps``."""
        for peer, steps_per_s in self.port.view.trusted_speeds():
            self.dylu.observe(peer, steps_per_s)
        steps = self.dylu.local_steps(self.my_speed)
        late_s, self.port.sync.late_start_s = self.port.sync.late_start_s, 0.0
        self.planned_steps = steps
        if late_s > 0:
            speed = self.my_speed or self.dylu.fastest(None)
            self.planned_steps = late_start_steps(steps, late_s, speed, self.cfg.outer.min_local_steps)
            logger.info("Started %.1f s after the swarm (state download): %d inner steps instead of %d",
                        late_s, self.planned_steps, steps)
        return self.planned_steps

    def begin_round(self) -> None:
        """Start the inner phase from the anchors (unless the last round was skipped: then train on).
        ``SwarmStartError`` when the averager process died (see ``Swarm.check_alive``)."""
        self.swarm.check_alive()
        self.driver.begin()
        self.faults.set_epoch(self.epoch)
        self.faults.before_phase(self._visible_peers)
        self._phase_began = time.monotonic()
        self.port.view.notify("status", "training", self.epoch)

    def on_inner_step(self, step: int, loss: float) -> None:
        """Pass to ``InnerTrainer.train_steps``: keeps this peer's progress record fresh in the DHT."""
        self.inner_step += 1
        self._notify("inner_step", step, self.planned_steps, loss, self.epoch)
        self.faults.after_inner_step()
        if time.monotonic() - self._last_progress >= PROGRESS_EVERY_S:
            self._publish_progress()

    def _visible_peers(self) -> int:
        """Peers whose progress records of this run and model are visible, this one's included (the fault
        ``start_together`` waits on it); this peer's own record is republished when due, as while it trains."""
        if time.monotonic() - self._last_progress >= PROGRESS_EVERY_S:
            self._publish_progress()
        return len(self.swarm.records())

    def end_round(self, stats: InnerStats) -> RoundReport:
        """Average this phase's work with the swarm and apply the outer step (see the round policy)."""
        self.rounds_done += 1
        self._phase_began = None  # the record published after the outer step names the next epoch: phase 0
        if stats.steps and stats.seconds > 0:
            self.my_speed = stats.steps_per_second
            self.dylu.observe(self.peer_id, self.my_speed)
            self._last_rates = (stats.steps_per_second, stats.samples / stats.seconds, stats.tokens_per_second)
        report = RoundReport(epoch=self.epoch, inner_steps=stats.steps, inner_seconds=stats.seconds,
                             train_loss=stats.mean_loss)
        began, self.port.view.network_s = time.monotonic(), 0.0
        self.driver.end(float(stats.samples), report, stats.seconds)
        if report.outcome is Outcome.SKIPPED:
            report.stall = self.swarm.diagnose_stall(self.epoch)
            if report.stall is not Stall.NONE:
                report.reason = f"{report.reason}; {STALL_HINTS[report.stall]}"
        report.params_sha256 = self.params_sha256()
        report.overhead_seconds = max(0.0, time.monotonic() - began - self.port.view.network_s)
        self._publish_progress()
        report.rejected_records, report.record_bans = self.swarm.take_record_report()
        self.port.view.notify("round", report, stats)
        return report

    def _publish_progress(self) -> None:
        rates = tuple(x if math.isfinite(x) else 0.0 for x in self._last_rates)
        phase_s = 0.0 if self._phase_began is None else time.monotonic() - self._phase_began
        self.swarm.publish_progress(epoch=self.epoch, inner_step=self.inner_step, rates=rates, phase_s=phase_s)
        self._last_progress = time.monotonic()
