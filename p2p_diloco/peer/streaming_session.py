"""Streaming DiLoCo on the swarm: the session whose rounds are fragment rounds (``--fragments F``).

The training loop is ``SwarmSession``'s, unchanged (``run_peer`` calls the same methods); what differs is what a
round is. The model's parameters are split into F fragments (``core.fragments.assign_fragments``), each with its
own outer state (anchors, momentum, epoch), and :class:`~p2p_diloco.core.fragments.StreamingRounds`, the code
the simulator runs, drives one round driver per fragment over its own port. Each port talks to one
fragment's view of the swarm (``swarm.fragment_swarm``): its records, checksum votes, served state and rounds
are the fragment's. So each fragment round is a round of the round policy, for that fragment alone: a failed or
partial all-reduce is never applied and the work is carried, a fragment left behind or outvoted resyncs alone
(downloading 8/F bytes per parameter), late work is folded per fragment.

**The schedule.** Fragment f synchronises every H steps, offset by ⌊f·H/F⌋ (``FragmentSchedule``); one inner
phase here is the run of steps up to the next fragment's sync (H/F), and each ``end_round`` runs that
fragment's round. Steps are counted in the schedule's terms: DyLU shortens a slow peer's phases (it trains
fewer inner steps per phase, as a whole round would), not the schedule. A peer's place in the schedule
follows from its fragments' epochs (``FragmentSchedule.position``), so a joiner or a restart takes it from the
state it downloaded or loaded; no step counter is taken from another peer.

**The overlap** (``--fragment-delay`` τ > 0). An inner phase then ends at a fragment's merge step, and that
fragment's sync, τ steps earlier, happens inside the phase (:meth:`StreamingSession.on_inner_step`; a slow
peer's phase is scaled as a whole, so its sync falls at the same share of its steps): its pseudo-gradient is
taken and its round opened on the training thread, the round's decision and all-reduce run on a thread of their
own while the next steps train (``RoundDriver.exchange``: it changes neither the outer state nor the
parameters), and at the merge step the training thread waits for it, if it is not done, and lands it (the
outer step and the α-merge, a catch-up, or the work carried: ``RoundDriver.land``). Since τ is at most H/F,
at most one fragment is in flight, as the averager's one buffer needs; a checkpoint is written between phases,
with none in flight. A round still in flight when the peer stops is waited for (bounded) and not applied.

**What is not built yet** (``run_peer`` refuses it): a node of several GPUs with fragments. A fragment's round
update is not served to joiners (a fragment left behind downloads the fragment instead).

**Memory.** The fragments' anchors and momentum are one model's (8 bytes per parameter, in shared memory as a
whole round's); the averager's buffer holds the largest fragment (4/F bytes per parameter,
``swarm.buffer_layout``); a fragment's pseudo-gradient is taken into tensors of its size (4/F, for the round).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from p2p_diloco.core.dylu import late_start_steps
from p2p_diloco.core.evidence import Evidence
from p2p_diloco.core.fragments import FragmentSchedule, StreamingRounds, assign_fragments
from p2p_diloco.core.outer import MOMENTUM_KEY_PREFIX
from p2p_diloco.core.peer_state import ANCHOR_KEY_PREFIX, OuterState
from p2p_diloco.core.round_driver import RoundPort
from p2p_diloco.core.rounds import STALL_HINTS, Outcome, RoundPolicy, RoundReport, Stall
from p2p_diloco.data.loader import DataPosition
from p2p_diloco.host_memory import trim_before_fork
from p2p_diloco.inner_stats import InnerStats
from p2p_diloco.peer.admission import refuse_other_models, share_host_state, warn_other_versions
from p2p_diloco.peer.config import PeerConfig, swarm_wait_bound_s
from p2p_diloco.peer.faults import NO_FAULTS, FaultHooks
from p2p_diloco.peer.port import SwarmPort
from p2p_diloco.peer.report import SessionListener
from p2p_diloco.peer.session import SwarmSession
from p2p_diloco.swarm.fragment_swarm import FragmentSwarm

logger = logging.getLogger(__name__)

__all__ = ["StreamingSession", "merge_fragment_tensors", "split_fragment_tensors"]

_KEYS = (ANCHOR_KEY_PREFIX, MOMENTUM_KEY_PREFIX)


def merge_fragment_tensors(parts: Sequence[dict[str, torch.Tensor]],
                           groups: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """The fragments' outer states (``OuterState.state_tensors``, each numbered in its fragment's order) as one
    model's, numbered by parameter: a checkpoint of a fragment peer is read by ``export`` and ``eval`` as any."""
    out: dict[str, torch.Tensor] = {}
    for part, group in zip(parts, groups, strict=True):
        for key, tensor in part.items():
            prefix = next((p for p in _KEYS if key.startswith(p)), None)
            if prefix is None:
                raise ValueError(f"a fragment's state holds {key!r}, which fragments do not keep")
            out[f"{prefix}{group[int(key[len(prefix):])]}"] = tensor
    return out


def split_fragment_tensors(tensors: dict[str, torch.Tensor],
                           groups: Sequence[Sequence[int]]) -> list[dict[str, torch.Tensor]]:
    """:func:`merge_fragment_tensors` undone: each fragment's part, numbered in its order (absent keys stay
    absent: ``OuterState.load_state_tensors`` names what is missing)."""
    parts = []
    for group in groups:
        part = {}
        for i, index in enumerate(group):
            for prefix in _KEYS:
                if f"{prefix}{index}" in tensors:
                    part[f"{prefix}{i}"] = tensors[f"{prefix}{index}"]
        parts.append(part)
    return parts


class StreamingSession(SwarmSession):
    """``SwarmSession``'s contract, with fragment rounds (see the module docstring).

    Args:
        cfg: the peer's configuration (``cfg.outer.fragments`` > 1).
        params: the model's live parameters, in ``model.parameters()`` order.
        fingerprint: the model's architecture digest.
        names: the parameters' names, for the assignment rule (layers dealt out strided); without them, tensor by
            tensor.
        listeners: receivers of progress (metrics, terminal display).
        faults: injected faults (tests and drills only).
    """

    def __init__(self, cfg: PeerConfig, params: list[torch.Tensor], fingerprint: str,
                 names: Sequence[str] | None = None, listeners: list[SessionListener] | None = None,
                 faults: FaultHooks = NO_FAULTS) -> None:
        outer = cfg.outer
        if outer.fragments < 2:
            raise ValueError("StreamingSession runs --fragments > 1")
        self._setup(cfg, params, fingerprint, faults)
        names = list(names) if names is not None else [f"tensor{i}" for i in range(len(params))]
        self.groups = assign_fragments(names, [p.numel() for p in params], outer.fragments)
        self.schedule = FragmentSchedule(outer.local_steps, outer.fragments, outer.fragment_delay)
        policy = self.staleness_policy()
        self.states = [OuterState([params[i] for i in group], lr=outer.lr, momentum=outer.momentum, policy=policy,
                                  device="cpu") for group in self.groups]
        anchors: list[torch.Tensor] = [torch.empty(0)] * len(params)
        for group, state in zip(self.groups, self.states, strict=True):
            for index, anchor in zip(group, state.anchors, strict=True):
                anchors[index] = anchor
        self.swarm = self._make_swarm(anchors, self.groups)
        self.listeners: list[SessionListener] = list(listeners or [])
        trusted = self.trusted_peers()
        self.ports: list[SwarmPort] = []

        def make_port(f: int, state: OuterState, own: list[torch.Tensor]) -> RoundPort:
            port = SwarmPort(FragmentSwarm(self.swarm, f), state, own, self.listeners, faults, False,
                             Evidence(trusted=trusted))
            self.ports.append(port)
            return port

        self.streaming = StreamingRounds(params, names, self.schedule, RoundPolicy(policy, cfg.swarm.solo_after_s),
                                         lambda f, own: self.states[f], make_port, "", alpha=outer.fragment_alpha,
                                         groups=self.groups)
        self.position = 0
        """The schedule step this peer trained up to (``FragmentSchedule.position`` of its epochs at start)."""
        self._event = 0
        """The schedule step the inner phase under way ends at (the next fragment's merge; with τ = 0, its sync)."""
        self._sync_after: int | None = None
        """τ > 0: the inner steps of this phase after which its fragment syncs (None: done, or τ = 0)."""
        self._synced_samples = 0
        """Samples of this phase trained before its sync (they count toward the synced round)."""
        self._exchanges: dict[int, threading.Thread] = {}
        """τ > 0: the fragment whose round is in flight, and the thread running its exchange."""

    # ------------------------------------------------------------------ state

    @property
    def epoch(self) -> int:
        """Fragment rounds done: the sum of the fragments' epochs (what progress and checkpoints are numbered by)."""
        return sum(self.fragment_epochs)

    @property
    def fragment_epochs(self) -> list[int]:
        return [state.epoch for state in self.states]

    def params_sha256(self) -> str:
        """A digest of every fragment's anchors (each fragment's alone is in its round's report)."""
        shas = "".join(port.serving.anchors_sha() for port in self.ports)
        return hashlib.sha256(shas.encode()).hexdigest()

    def add_listener(self, listener: SessionListener) -> None:
        self.listeners.append(listener)  # the ports' views share this list

    def _notify(self, method: str, *args: Any) -> None:
        self.ports[0].view.notify(method, *args)

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """``SwarmSession.state_dict``, with the fragments' states merged into one model's (numbered by parameter)
        and ``fragment_epochs``; ``epoch`` is the fragment rounds done."""
        position = self._stream.position if self._stream is not None else self.data_position
        outer = merge_fragment_tensors([s.state_tensors(copy=copy) for s in self.states], self.groups)
        return {"epoch": self.epoch, "fragment_epochs": self.fragment_epochs, "outer": outer,
                "inner_step": self.inner_step, "data_id": self.data_id,
                "data_position": (position or DataPosition()).as_dict()}

    def save_in_background(self, write: Callable[[dict[str, Any]], None]) -> threading.Thread:
        """As ``SwarmSession.save_in_background``: every fragment's next change waits for the write."""
        for port in self.ports:
            port.serving.wait_writer()
        state = self.state_dict(copy=False)
        thread = threading.Thread(target=write, args=(state,), name="checkpoint-writer", daemon=True)
        thread.start()
        for port in self.ports:
            port.serving.writer = thread
        return thread

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s output; ``ValueError`` names what is wrong (a checkpoint of a run
        without fragments, or of another F, is refused: its epochs are not this schedule's)."""
        epochs = state.get("fragment_epochs")
        if not isinstance(epochs, list) or len(epochs) != len(self.states):
            raise ValueError(f"the checkpoint holds no epochs of {len(self.states)} fragments (it was written by a "
                             f"peer with another --fragments); resume with that value, or start from another "
                             f"--checkpoint-dir")
        counters = self._resume_counters(state)
        parts = split_fragment_tensors(state["outer"], self.groups)
        for part, fragment_state, epoch in zip(parts, self.states, epochs, strict=True):
            fragment_state.load_state_tensors(part, epoch)
        self._resumed_at(*counters)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Start the DHT and averager, then bring each fragment up to the swarm's (a download per fragment that
        is behind, each verified against its own votes). Returns how it started."""
        share_host_state(self.states, self.params)
        trim_before_fork()
        self.swarm.start()
        self.streaming.peer_id = self.peer_id
        for fragment in self.streaming.fragments:
            fragment.driver.peer_id = self.peer_id
        for port in self.ports:
            port.view.start()
        how = f"resumed at fragment epochs {self.fragment_epochs}" if self._resumed else "fresh"
        refuse_other_models(self.swarm, self.ports[0].evidence, self.fingerprint, self.cfg.swarm.run_id)
        warn_other_versions(self.swarm, self.cfg.swarm.run_id)
        for port in self.ports:
            port.serving.serve(checksum=False)
        self._publish_progress()
        joined = []
        for f, (port, fragment) in enumerate(zip(self.ports, self.streaming.fragments, strict=True)):
            swarm_epoch = port.swarm_epoch()
            if swarm_epoch is not None and swarm_epoch > fragment.state.epoch:
                port.view.notify("status", "syncing", swarm_epoch)
                if port.catchup.join(swarm_epoch) is not None:
                    fragment.driver.new_state()
                    joined.append(f)
        self.streaming.begin()  # every fragment's parameters are its anchors
        self.position = self.schedule.position(self.fragment_epochs)
        if joined:
            how = f"joined at fragment epochs {self.fragment_epochs}"
        return how

    def close(self) -> None:
        self._wait_exchanges()
        for port in self.ports:
            port.serving.wait_writer()
        self.swarm.close()

    def _wait_exchanges(self) -> None:
        """A round still in flight when the peer stops: wait for its exchange (bounded by the swarm's own round
        bound), so that the averager shuts down between rounds; it is not applied."""
        for f, thread in list(self._exchanges.items()):
            thread.join(swarm_wait_bound_s(self.cfg.swarm))
            if thread.is_alive():
                logger.warning("The round of fragment %d still runs after %.0f s; stopping without it", f,
                               swarm_wait_bound_s(self.cfg.swarm))
        self._exchanges.clear()

    # ------------------------------------------------------------------ per round

    def local_steps(self) -> int:
        """Inner steps up to the next fragment's sync: H/F for the fastest peer, proportionally fewer for slower
        ones (DyLU, from trusted peers' speeds: a published speed is a free claim)."""
        for port in self.ports:
            for peer, steps_per_s in port.view.trusted_speeds():
                self.dylu.observe(peer, steps_per_s)
        self._event = self.schedule.next_merge(self.position)
        logical = self._event - self.position
        steps = self.dylu.local_steps(self.my_speed)
        h = self.cfg.outer.local_steps
        self.planned_steps = max(1, round(logical * steps / h))
        # a fragment caught up (at start or in a round) started after the swarm's phase began: as
        # SwarmSession.local_steps, plan fewer steps so as to arrive with the others (each fragment's records
        # carry the same phase time, the one of the phase up to the next fragment's sync)
        late_s = max(port.sync.late_start_s for port in self.ports)
        for port in self.ports:
            port.sync.late_start_s = 0.0
        if late_s > 0:
            floor = min(self.planned_steps, max(1, round(logical * self.cfg.outer.min_local_steps / h)))
            planned = late_start_steps(self.planned_steps, late_s, self.my_speed or self.dylu.fastest(None), floor)
            logger.info("Started %.1f s after the swarm (state download): %d inner steps instead of %d", late_s,
                        planned, self.planned_steps)
            self.planned_steps = planned
        self._synced_samples = 0
        if self.schedule.delay > 0:
            # the sync's share of the phase, in this peer's own steps: τ logical steps before the phase's end
            self._sync_after = round(self.planned_steps * (logical - self.schedule.delay) / logical)
            self._sync_if_due(0)  # τ = H/F: the sync is at the phase's start, right after the last merge
        return self.planned_steps

    def on_inner_step(self, step: int, loss: float) -> None:
        """``SwarmSession.on_inner_step``; with τ > 0 the phase's fragment syncs after its share of the steps."""
        super().on_inner_step(step, loss)
        self._sync_if_due(step)

    def _sync_if_due(self, done: int) -> None:
        """After ``done`` inner steps of this phase: take the phase's fragment's pseudo-gradient and start its
        round's exchange on a thread of its own, once (module docstring, the overlap)."""
        if self._sync_after is None or done < self._sync_after:
            return
        self._sync_after = None
        step = self._event - self.schedule.delay
        self._synced_samples = done * self.cfg.inner.batch_size
        self.streaming.trained(float(self._synced_samples))
        seconds = 0.0 if self._phase_began is None else time.monotonic() - self._phase_began
        for f in self.schedule.syncs(step):
            if f in self._exchanges:  # not reached: τ <= H/F lands each round before the next sync
                raise RuntimeError(f"fragment {f} synced at step {step} with its last round still in flight")
            self.streaming.sync(f, step)
            exchange = self.streaming.launch(f, seconds)
            thread = threading.Thread(target=exchange, name=f"fragment-{f}-round", daemon=True)
            thread.start()
            self._exchanges[f] = thread

    def begin_round(self) -> None:
        """Start an inner phase: the parameters train on (each fragment's round resets only its own)."""
        self.swarm.check_alive()
        self.faults.set_epoch(self.epoch)
        self.faults.before_phase(self._visible_peers)
        self._phase_began = time.monotonic()
        self._notify("status", "training", self.epoch)

    def end_round(self, stats: InnerStats) -> RoundReport:
        """Run the round of the fragment whose sync step this phase reached (the round policy's, for it alone)."""
        self.rounds_done += 1
        self._phase_began = None
        if stats.steps and stats.seconds > 0:
            self.my_speed = stats.steps_per_second
            self.dylu.observe(self.peer_id, self.my_speed)
            self._last_rates = (stats.steps_per_second, stats.samples / stats.seconds, stats.tokens_per_second)
        self.streaming.trained(float(max(0, stats.samples - self._synced_samples)))
        self._synced_samples = 0
        self.position = self._event
        began = time.monotonic()
        waited = self._land_exchanges()
        for port in self.ports:
            port.view.network_s = 0.0
        if self.schedule.delay == 0:
            reports = self.streaming.step(self.position, stats.seconds)
        else:
            reports = [self.streaming.finish(f, stats.seconds) for f in self.schedule.merges(self.position)
                       if self.streaming.fragments[f].flight is not None]
            for report in reports:
                report.blocked_seconds = waited  # what the overlap did not hide: the wait at the merge step
        network_s = waited + sum(port.view.network_s for port in self.ports)
        for report in reports:
            report.inner_steps, report.inner_seconds, report.train_loss = stats.steps, stats.seconds, stats.mean_loss
            if report.outcome is Outcome.SKIPPED:
                report.stall = self.swarm.diagnose_stall(report.epoch)
                if report.stall is not Stall.NONE:
                    report.reason = f"{report.reason}; {STALL_HINTS[report.stall]}"
            report.params_sha256 = self.ports[report.fragment].serving.anchors_sha()
        overhead = max(0.0, time.monotonic() - began - network_s)
        self._publish_progress()
        rejected, bans = self.swarm.take_record_report()
        for report in reports:
            report.overhead_seconds = overhead
            report.rejected_records, report.record_bans = rejected, bans
            self._notify("round", report, stats)
        if not reports:  # not reached: every phase ends at a fragment's merge (with τ = 0, its sync)
            raise RuntimeError(f"no fragment round at schedule step {self.position}")
        return reports[-1]

    def _land_exchanges(self) -> float:
        """τ > 0, at a merge step: wait for the exchanges of the fragments merging now (each bounded in time);
        returns the seconds waited."""
        began = time.monotonic()
        for f in self.schedule.merges(self.position):
            thread = self._exchanges.pop(f, None)
            if thread is not None:
                thread.join()  # RoundDriver.exchange is bounded (the swarm's round bound) and never raises
        return time.monotonic() - began

    def _publish_progress(self) -> None:
        rates = tuple(x if math.isfinite(x) else 0.0 for x in self._last_rates)
        phase_s = 0.0 if self._phase_began is None else time.monotonic() - self._phase_began
        self.swarm.publish_progress(epoch=self.epoch, inner_step=self.inner_step, rates=rates, phase_s=phase_s,
                                    fragment_epochs=self.fragment_epochs)
        self._last_progress = time.monotonic()
