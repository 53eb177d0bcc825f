"""The ``streaming`` mode: Streaming DiLoCo, fragments synchronised at staggered times (``core.fragments``).

Every worker drives the core's :class:`~p2p_diloco.core.fragments.StreamingRounds`, the very object a swarm peer
would drive: one :class:`~p2p_diloco.core.round_driver.RoundDriver` and one outer state per fragment. Only the
port differs: at a fragment's sync step the simulator takes every worker's pseudo-gradient of that fragment,
reduces them as the swarm's reducers do (:class:`~p2p_diloco.core.robust.GroupReduction`, through the codec
and its reply encoding, as the ``diloco`` mode does), and hands each worker's port the result; τ steps later each
worker's driver runs the fragment's round on it (decisions, outer step, α-merge). With F = 1, τ = 0 and α = 0 the
run is the ``diloco`` mode's, bit for bit (``tests/unit/test_fragments.py``).

**Bytes per second per peer.** Each fragment all-reduce moves, per peer, the bandwidth-optimal all-reduce's
bytes of the codec's exact sizes (:func:`~p2p_diloco.simulate.engine.allreduce_bytes`). With free communication
(``bandwidth_mbps`` 0) those bytes are spread evenly over the time the schedule gives the all-reduce: the τ
inner steps it overlaps, or one inner step when it blocks (τ = 0, which is how plain DiLoCo is measured). The
*peak* is the largest rate at any moment of the run (all-reduces that overlap add up): the link speed a peer
needs for no all-reduce to hold training up by more than one step. The *mean* is every byte over the run's
virtual time. With a link speed given, an all-reduce takes the bandwidth bound and runs at the link's speed
(the peak is then the link speed), and the part of it that τ steps do not hide stops the clock.

Final evaluation: the first honest worker's own parameters, as in every mode; at the end of a run the fragments
other than fragment 0 hold up to (F−1)/F·H steps of work not yet synchronised. ``consensus_eval_loss`` also
reports the workers' mean parameters (what a plain final average would export).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from p2p_diloco.config import TrainConfig
from p2p_diloco.core.delayed import StalenessPolicy
from p2p_diloco.core.fragments import FragmentSchedule, StreamingRounds, assign_fragments
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.robust import GroupReduction
from p2p_diloco.core.round_driver import Collected
from p2p_diloco.core.rounds import Observation, Outcome, RoundPolicy, RoundResult
from p2p_diloco.simulate.engine import (
    RoundRecord,
    SimConfig,
    SimResult,
    Worker,
    allreduce_bytes,
    allreduce_seconds,
    build_workers,
    group_reduction,
    record_bans,
    sent_by,
    train_round,
)
from p2p_diloco.trainer import evaluate_model

logger = logging.getLogger(__name__)


@dataclass
class StreamingSimResult(SimResult):
    fragments: int = 1
    fragment_delay: int = 0
    fragment_alpha: float = 0.0
    fragment_numels: list[int] = field(default_factory=list)
    """Values per fragment (the assignment of ``core.fragments``)."""
    peak_bytes_per_s: float = 0.0
    """Per peer, the largest send rate at any moment (see the module docstring)."""
    mean_bytes_per_s: float = 0.0
    """Per peer, every byte sent over the run's virtual time."""
    traffic: list[list[float]] = field(default_factory=list)
    """Per peer, one ``[start_s, end_s, bytes]`` per fragment all-reduce, on the virtual clock."""
    consensus_eval_loss: float = float("nan")
    """Eval loss of the workers' mean parameters at the end of the run."""
    fragment_outcomes: dict[str, int] = field(default_factory=dict)
    """Fragment rounds by outcome, over every worker."""


def peak_rate(traffic: Sequence[Sequence[float]]) -> float:
    """The largest sum of the rates of the intervals ``[start, end, bytes]`` that overlap at one moment."""
    events: list[tuple[float, int, float]] = []
    for start, end, nbytes in traffic:
        if end <= start or nbytes <= 0:
            continue
        rate = nbytes / (end - start)
        # At a shared boundary the interval that ends leaves before the one that starts joins (-1 sorts first).
        events += [(start, 1, rate), (end, -1, -rate)]
    peak = current = 0.0
    for _, _, change in sorted(events):
        current += change
        peak = max(peak, current)
    return peak


class GroupPort:
    """One worker's fragment, as its round driver sees the world: the simulator reduced the group already.

    Every worker runs in lockstep, so nobody is ahead (``swarm_epoch`` is the fragment's own epoch) and a round
    whose result is missing or skipped is carried, as in the swarm when nobody advanced.
    """

    def __init__(self, state: OuterState, peers: int) -> None:
        self.state, self.peers = state, peers
        self.result: RoundResult | None = None
        self.sent: list[torch.Tensor] | None = None

    def deliver(self, sent: list[torch.Tensor], result: RoundResult) -> None:
        self.sent, self.result = sent, result

    def observe(self, epoch: int) -> Observation:
        return Observation(epoch, epoch, self.peers, unseen_s=0.0)

    def in_minority(self, epoch: int) -> bool:
        return False  # the workers apply bit-identical results

    def swarm_epoch(self) -> int | None:
        return self.state.epoch

    def averaging(self, epoch: int) -> None:
        pass

    def before_allreduce(self) -> None:
        pass

    def average(self, delta: Sequence[torch.Tensor], weight: float, staleness: int, epoch: int,
                stale: Sequence[torch.Tensor] | None, stale_weight: float) -> RoundResult:
        result, sent = self.result, self.sent
        self.result = self.sent = None
        if result is None or sent is None or len(delta) != len(sent) or any(
                a is not b for a, b in zip(delta, sent, strict=True)):
            return RoundResult(Outcome.SKIPPED, "no group reduced this work", epoch)
        return result

    def resync(self, min_epoch: int) -> bool:
        return False  # lockstep: nobody is ever ahead to download from

    def published(self, epoch: int, update: object = None) -> None:
        pass

    def collect(self, epoch: int, timeout: float) -> Collected:
        raise NotImplementedError("streaming rounds overlap through the fragment delay, not --overlap eager")

    def launch(self, *args: object) -> bool:
        raise NotImplementedError("streaming rounds overlap through the fragment delay, not --overlap eager")

    def discard(self, why: str) -> None:
        pass

    def delta_buffers(self) -> list[torch.Tensor] | None:
        return None

    def withdraw(self) -> None:
        pass


class StreamingSimulation:
    """``sim.workers`` workers running Streaming DiLoCo for ``sim.rounds × H`` inner steps each."""

    def __init__(self, cfg: TrainConfig, sim: SimConfig) -> None:
        if any(s != sim.speeds[0] for s in sim.speeds):
            logger.info("streaming: workers run in lockstep at the slowest worker's speed")
        self.cfg, self.sim = cfg, sim
        outer = cfg.outer
        self.schedule = FragmentSchedule(outer.local_steps, outer.fragments, outer.fragment_delay)
        self.workers = build_workers(cfg, sim, lr=outer.lr, momentum=outer.momentum)
        self.policy = RoundPolicy(StalenessPolicy(outer.staleness_decay, outer.max_staleness))
        names = [name for name, _ in self.workers[0].local.model.named_parameters()]
        self.groups = assign_fragments(names, [p.numel() for p in self.workers[0].params], outer.fragments)
        self.ports: list[list[GroupPort]] = []
        self.peers = [self._peer(w, names) for w in self.workers]
        self.reductions = [group_reduction(sim, fragment.state) for fragment in self.peers[0].fragments]
        self.judge = next(w for w in self.workers if w.index not in sim.byzantine)

    def _peer(self, worker: Worker, names: list[str]) -> StreamingRounds:
        outer, ports = self.cfg.outer, []
        self.ports.append(ports)

        def make_state(f: int, params: list[torch.Tensor]) -> OuterState:
            return OuterState(params, lr=outer.lr, momentum=outer.momentum, policy=self.policy.staleness,
                              codec=outer.compression, error_feedback=outer.error_feedback,
                              error_feedback_decay=outer.error_feedback_decay, chunk_size=outer.topk_chunk_size,
                              k=outer.topk_k)

        def make_port(f: int, state: OuterState, params: list[torch.Tensor]) -> GroupPort:
            ports.append(GroupPort(state, self.sim.workers))
            return ports[-1]

        return StreamingRounds(worker.params, names, self.schedule, self.policy, make_state, make_port,
                               f"sim-worker-{worker.index}", alpha=outer.fragment_alpha, groups=self.groups)

    def _reduce(self, f: int, step: int, result: StreamingSimResult) -> tuple[int, int]:
        """Take every worker's work of fragment ``f``, reduce it and deliver each its result; returns the bytes
        one peer sends and the reply's bytes."""
        sent_all, weights, nbytes = [], [], 0
        for worker, peer, ports in zip(self.workers, self.peers, self.ports, strict=True):
            work = peer.sync(f, step)
            decoded, size = peer.fragments[f].state.encode(work.delta)
            nbytes = max(nbytes, size)
            sent_all.append(sent_by(self.sim, worker, decoded))
            weights.append(work.weight)
            ports[f].sent = work.delta
        reduction: GroupReduction = self.reductions[f]
        mean = reduction.reduce(sent_all, weights)
        record_bans(result, reduction, step)
        for _, sender, _ in reduction.new_bans:  # a rejected part's residual is not sent again
            feedback = self.peers[sender].fragments[f].state.feedback
            if feedback is not None:
                feedback.reset()
        if reduction.faults:
            logger.warning("Fragment %d at step %d: parts reduced to zeros: %s", f, step, "; ".join(reduction.faults))
        reply = self.peers[0].fragments[f].state.codec.reply_codec
        data = [reply.encode(t) for t in mean]
        replied = [reply.decode(d, t.shape) for d, t in zip(data, mean, strict=True)]
        ids = tuple(peer.peer_id for peer in self.peers)
        epoch = self.peers[0].fragments[f].state.epoch
        for ports in self.ports:
            delivered = RoundResult(Outcome.AVERAGED, "", epoch, contributors=ids, weights=tuple(weights),
                                    stale_weights=(0.0,) * len(ids), stalenesses=(0,) * len(ids),
                                    fresh_mean=replied)
            ports[f].deliver(ports[f].sent or [], delivered)
        return nbytes, sum(len(d) for d in data)

    def _finish(self, f: int, result: StreamingSimResult) -> None:
        for peer in self.peers:
            report = peer.finish(f)
            result.fragment_outcomes[report.outcome.value] = result.fragment_outcomes.get(report.outcome.value, 0) + 1

    def _consensus_loss(self) -> float:
        trainer = self.judge.local.trainer
        model = copy.deepcopy(trainer.model)
        honest = [w for w in self.workers if w.index not in self.sim.byzantine]
        with torch.no_grad():
            for index, p in enumerate(model.parameters()):
                p.copy_(torch.stack([w.params[index].float() for w in honest]).mean(0))
        return evaluate_model(model, self.judge.local.eval_batches, trainer.device, trainer.amp_dtype)

    def run(self, progress: Callable[[RoundRecord], None] | None = None) -> StreamingSimResult:
        cfg, sim, schedule = self.cfg, self.sim, self.schedule
        H, k, tau = cfg.outer.local_steps, sim.workers, schedule.delay
        judge = self.judge
        result = StreamingSimResult(
            mode=sim.mode, workers=k, local_steps=H, speeds=list(sim.speeds), compression=cfg.outer.compression,
            model=cfg.model.model, seed=cfg.run.seed,
            initial_eval_loss=judge.local.trainer.evaluate(judge.local.eval_batches),
            aggregation=sim.aggregation, byzantine=dict(sim.byzantine), norm_outlier_factor=sim.norm_outlier_factor,
            fragments=schedule.fragments, fragment_delay=tau, fragment_alpha=cfg.outer.fragment_alpha,
            fragment_numels=[fragment.numel for fragment in self.peers[0].fragments])
        step_s = sim.step_time_s / min(sim.speeds)
        total = sim.rounds * H
        step, clock, sent, inner = 0, 0.0, 0, 0
        for peer in self.peers:
            peer.begin()
        next_record = H
        while step < total:
            target = min(schedule.next_event(step), total, next_record)
            stats = train_round(self.workers, target - step)
            for peer, s in zip(self.peers, stats, strict=True):
                peer.trained(s.samples)
            inner += (target - step) * k
            clock += (target - step) * step_s
            step = target
            for f in schedule.merges(step):
                if self.peers[0].fragments[f].synced is not None:
                    self._finish(f, result)
            for f in schedule.syncs(step):
                nbytes, reply_nbytes = self._reduce(f, step, result)
                per_peer = allreduce_bytes(nbytes, k, reply_nbytes)
                seconds = allreduce_seconds(nbytes, k, sim.bandwidth_mbps, reply_nbytes)
                window = seconds if sim.bandwidth_mbps > 0 else max(tau, 1) * step_s
                if per_peer:
                    result.traffic.append([clock, clock + window, float(per_peer)])
                clock += max(0.0, seconds - tau * step_s)  # what the τ steps do not hide holds training up
                sent += per_peer
                if tau == 0:
                    self._finish(f, result)
            if step == total:
                # All-reduces still overlapping when training ends are merged as they arrive, so no synced
                # work is lost to the end of the run.
                for f, fragment in enumerate(self.peers[0].fragments):
                    if fragment.synced is not None:
                        self._finish(f, result)
            if step == next_record:
                rec = RoundRecord(step // H, judge.local.trainer.evaluate(judge.local.eval_batches), clock, sent,
                                  inner)
                result.rounds.append(rec)
                result.final_eval_loss, result.virtual_time_s = rec.eval_loss, clock
                result.total_bytes_sent_per_worker, result.total_inner_steps = sent, inner
                if progress:
                    progress(rec)
                next_record += H
        result.peak_bytes_per_s = peak_rate(result.traffic)
        result.mean_bytes_per_s = sent / clock if clock > 0 else 0.0
        result.consensus_eval_loss = self._consensus_loss()
        return result


def run_streaming(cfg: TrainConfig, sim: SimConfig,
                  progress: Callable[[RoundRecord], None] | None = None) -> StreamingSimResult:
    """Run the ``streaming`` mode; deterministic for a given ``cfg.run.seed``."""
    return StreamingSimulation(cfg, sim).run(progress)
