"""The ``streaming`` mode: Streaming DiLoCo, fragments synchronised at staggered times (``core.fragments``).

Every worker drives the core's :class:`~p2p_diloco.core.fragments.StreamingRounds`, the very object a swarm peer
would drive: one :class:`~p2p_diloco.core.round_driver.RoundDriver` and one outer state per fragment. Only the
port differs: at a fragment's sync step the simulator takes every worker's pseudo-gradient of that fragment,
reduces them as the swarm's reducers do (:class:`~p2p_diloco.core.robust.GroupReduction`, through the codec
and its reply encoding, as the ``diloco`` mode does), and hands each worker's port the result; τ steps later each
worker's driver runs the fragment's round on it (decisions, outer step, α-merge). With F = 1, τ = 0 and α = 0 the
run is the ``diloco`` mode's, bit for bit (``tests/unit/test_fragments.py``).

The checksum vote runs per fragment (:class:`FragmentBoard`): after each fragment round every worker publishes
the digest of that fragment's state at its new epoch; a worker whose fragment differs from what most published
stays out of the fragment's group, resyncs that fragment alone from a majority worker, and its work of the
phase is folded late into the fragment's next round, by the swarm's formula.

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
import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from p2p_diloco.config import TrainConfig
from p2p_diloco.core.delayed import StalenessPolicy
from p2p_diloco.core.fragments import FragmentSchedule, StreamingRounds, assign_fragments
from p2p_diloco.core.lease import BufferLease
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


def state_digest(state: OuterState) -> str:
    """sha256 of a fragment's state (anchors, then momentum): what peers compare in the checksum vote."""
    digest = hashlib.sha256()
    for tensor in [*state.anchors, *(m for m in state.outer.momentum_buffers() if m is not None)]:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class FragmentBoard:
    """What the DHT holds per fragment: each worker's published digest at each of the fragment's epochs, and
    its state to download (every worker serves its fragments)."""

    def __init__(self) -> None:
        self.digests: dict[tuple[int, int], dict[int, str]] = {}
        self.states: dict[tuple[int, int], OuterState] = {}

    def publish(self, fragment: int, worker: int, state: OuterState) -> None:
        self.states[(fragment, worker)] = state
        self.digests.setdefault((fragment, state.epoch), {})[worker] = state_digest(state)

    def minority(self, fragment: int, epoch: int, worker: int, state: OuterState) -> bool:
        """A strict majority of the workers that published for (fragment, epoch) published another digest."""
        votes = self.digests.get((fragment, epoch), {})
        mine = state_digest(state)
        return sum(1 for digest in votes.values() if digest != mine) > len(votes) / 2

    def donor(self, fragment: int, min_epoch: int, exclude: int) -> OuterState | None:
        """A worker holding the fragment's newest state of ``min_epoch`` or later that the most workers
        published for that epoch."""
        offers = [(state.epoch, worker) for (f, worker), state in self.states.items()
                  if f == fragment and worker != exclude and state.epoch >= min_epoch]
        if not offers:
            return None
        epoch = max(e for e, _ in offers)
        votes = self.digests.get((fragment, epoch), {})
        if not votes:
            return None
        majority, _ = Counter(votes.values()).most_common(1)[0]
        for e, worker in sorted(offers):
            state = self.states[(fragment, worker)]
            if e == epoch and state_digest(state) == majority:
                return state
        return None


class GroupPort:
    """One worker's fragment, as its round driver sees the world: the simulator reduced the group already.

    Every worker runs in lockstep, so nobody is ahead (``swarm_epoch`` is the fragment's own epoch) and a round
    whose result is missing or skipped is carried, as in the swarm when nobody advanced. The checksum vote is
    per fragment: a worker whose fragment state differs from the digest most workers published for that
    fragment's epoch resyncs that fragment alone from one of them (``FragmentBoard``), and its work becomes the
    fragment's late work, folded into the fragment's next round.
    """

    def __init__(self, state: OuterState, params: list[torch.Tensor], peers: int, board: FragmentBoard,
                 fragment: int, worker: int) -> None:
        self.state, self.params, self.peers = state, params, peers
        self.board, self.fragment, self.worker = board, fragment, worker
        self.result: RoundResult | None = None
        self.sent: list[torch.Tensor] | None = None

    def deliver(self, sent: list[torch.Tensor], result: RoundResult) -> None:
        self.sent, self.result = sent, result

    def observe(self, epoch: int) -> Observation:
        return Observation(epoch, epoch, self.peers, unseen_s=0.0)

    def in_minority(self, epoch: int) -> bool:
        return self.board.minority(self.fragment, epoch, self.worker, self.state)

    def swarm_epoch(self) -> int | None:
        return self.state.epoch

    def averaging(self, epoch: int) -> None:
        pass

    def before_allreduce(self) -> None:
        pass

    def average(self, lease: BufferLease, weight: float, staleness: int, epoch: int,
                stale_weight: float) -> RoundResult:
        delta, _ = lease.in_flight()
        result, sent = self.result, self.sent
        self.result = self.sent = None
        if result is None or sent is None or len(delta) != len(sent) or any(
                a is not b for a, b in zip(delta, sent, strict=True)):
            return RoundResult(Outcome.SKIPPED, "no group reduced this work", epoch)
        return result

    def resync(self, min_epoch: int) -> bool:
        donor = self.board.donor(self.fragment, min_epoch, self.worker)
        if donor is None:
            return False
        self.state.load_state_tensors({k: t.clone() for k, t in donor.state_tensors().items()}, donor.epoch)
        self.state.begin(self.params)
        self.published(self.state.epoch)
        return True

    def published(self, epoch: int, update: object = None) -> None:
        self.board.publish(self.fragment, self.worker, self.state)

    def collect(self, epoch: int, timeout: float) -> Collected:
        raise NotImplementedError("streaming rounds overlap through the fragment delay, not --overlap eager")

    def launch(self, *args: object) -> bool:
        raise NotImplementedError("streaming rounds overlap through the fragment delay, not --overlap eager")

    def discard(self, why: str) -> None:
        pass

    def lease(self) -> BufferLease | None:
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
        self.board = FragmentBoard()
        self.members: dict[int, list[int]] = {}
        """Per fragment, the workers in its last group (the others resync it)."""
        self.ports: list[list[GroupPort]] = []
        self.peers = [self._peer(w, names) for w in self.workers]
        for ports in self.ports:
            for port in ports:
                port.published(0)
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
            ports.append(GroupPort(state, params, self.sim.workers, self.board, f, worker.index))
            return ports[-1]

        return StreamingRounds(worker.params, names, self.schedule, self.policy, make_state, make_port,
                               f"sim-worker-{worker.index}", alpha=outer.fragment_alpha, groups=self.groups)

    def _reduce(self, f: int, step: int, result: StreamingSimResult) -> tuple[int, int]:
        """Take every worker's work of fragment ``f``, reduce it and deliver each its result; returns the bytes
        one peer sends and the reply's bytes."""
        sent_all, weights, nbytes, members = [], [], 0, []
        late: list[tuple[list[torch.Tensor] | None, float, int]] = []
        for worker, peer, ports in zip(self.workers, self.peers, self.ports, strict=True):
            work = peer.sync(f, step)
            fragment = peer.fragments[f]
            if ports[f].in_minority(fragment.state.epoch):
                continue  # its driver resyncs this fragment instead of averaging (the vote gives it the same answer)
            members.append(worker.index)
            self.members[f] = members
            decoded, size = fragment.state.encode(work.delta)
            nbytes = max(nbytes, size)
            sent_all.append(sent_by(self.sim, worker, decoded))
            weights.append(work.weight)
            late.append(fragment.driver.pending.late_term(fragment.state.epoch, self.policy.staleness))
            ports[f].sent = work.delta
        if len(members) < 2:
            return 0, 0  # no group: every member's driver carries its work
        reduction: GroupReduction = self.reductions[f]
        if len(members) != self.sim.workers:
            reduction = GroupReduction(len(members), method=self.sim.aggregation,
                                       norm_factor=self.sim.norm_outlier_factor,
                                       values_per_part=reduction.values_per_part, sparse=reduction.sparse)
        mean = reduction.reduce(sent_all, weights)
        record_bans(result, reduction, step)
        for _, sender, _ in reduction.new_bans:  # a rejected part's residual is not sent again
            feedback = self.peers[members[sender]].fragments[f].state.feedback
            if feedback is not None:
                feedback.reset()
        if reduction.faults:
            logger.warning("Fragment %d at step %d: parts reduced to zeros: %s", f, step, "; ".join(reduction.faults))
        reply = self.peers[0].fragments[f].state.codec.reply_codec
        data = [reply.encode(t) for t in mean]
        replied = [reply.decode(d, t.shape) for d, t in zip(data, mean, strict=True)]
        stale_term = self._late_term(f, late, sum(weights))
        ids = tuple(self.peers[i].peer_id for i in members)
        epoch = self.peers[members[0]].fragments[f].state.epoch
        for i in members:
            delivered = RoundResult(Outcome.AVERAGED, "", epoch, contributors=ids, weights=tuple(weights),
                                    stale_weights=tuple(w for _, w, _ in late),
                                    stalenesses=tuple(s for _, _, s in late), with_stale=stale_term is not None,
                                    fresh_mean=replied, stale_term=stale_term)
            self.ports[i][f].deliver(self.ports[i][f].sent or [], delivered)
        return nbytes, sum(len(d) for d in data)

    def _late_term(self, f: int, late: list[tuple[list[torch.Tensor] | None, float, int]],
                   fresh_total: float) -> list[torch.Tensor] | None:
        """The members' late work of fragment ``f`` (after a resync), by the swarm's formula
        (``swarm.group.GroupPlan.local_scales``, as ``simulate.swarm_mode.SimGroup``): Σ s_j E_j / max(W_f, Σ s_j),
        each E_j through the codec."""
        late_total = sum(weight for delta, weight, _ in late if delta is not None)
        if late_total <= 0:
            return None
        codec = self.peers[0].fragments[f].state.codec
        denominator = max(fresh_total, late_total)
        term: list[torch.Tensor] | None = None
        for delta, weight, _ in late:
            if delta is None:
                continue
            sent = [codec.roundtrip(t) for t in delta] if codec.name != "none" else delta
            if term is None:
                term = [torch.zeros_like(t, dtype=torch.float32) for t in sent]
            for out, e in zip(term, sent, strict=True):
                out.add_(e.float(), alpha=weight / denominator)
        return term

    def _finish(self, f: int, result: StreamingSimResult) -> None:
        # The group's members first: a worker the vote left out then finds their new state to download.
        members = self.members.pop(f, [])
        for index in [*members, *(i for i in range(len(self.peers)) if i not in members)]:
            report = self.peers[index].finish(f)
            result.fragment_outcomes[report.outcome.value] = result.fragment_outcomes.get(report.outcome.value, 0) + 1

    def _consensus_loss(self) -> float:
        trainer = self.judge.local.trainer
        model = copy.deepcopy(trainer.model)
        honest = [w for w in self.workers if w.index not in self.sim.byzantine]
        with torch.no_grad():
            for index, p in enumerate(model.parameters()):
                p.copy_(torch.stack([w.params[index].float() for w in honest]).mean(0))
        return evaluate_model(model, self.judge.local.eval_batches, trainer.device, trainer.amp_dtype)

    def run(self, progress: Callable[[RoundRecord], None] | None = None,
            after_step: Callable[[int], None] | None = None) -> StreamingSimResult:
        """Run the grid of steps; ``after_step(step)`` is called after each step's rounds (tests inject faults
        there)."""
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
            if after_step is not None:
                after_step(step)
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
