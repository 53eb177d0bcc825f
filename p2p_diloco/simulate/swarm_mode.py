"""The ``swarm`` mode: DiLoCo rounds decided by the swarm's own round policy, under a fault schedule.

Every worker runs the very :class:`p2p_diloco.core.round_driver.RoundDriver` a swarm peer runs; only the port
differs. :class:`SimPort` answers what the DHT and the averager answer on the network: the swarm's epoch
(the largest epoch a worker published), the peers visible, a state download (a copy of the newest published
state) and the all-reduce (:class:`SimGroup`, the swarm's formulas: a fresh mean weighted by samples plus
the late work's term). So skips, resyncs, carried work, late work, solo rounds and partial groups happen
here as they do in the swarm (see :mod:`p2p_diloco.simulate.faults` for the faults).

A round: the joining workers download the state; every present worker trains H steps; the workers on time
end their round together (one thread each, since an all-reduce needs every member at once); then the late
ones end theirs, finding the swarm ahead; the dropped ones restart from the swarm's state.

With ``--overlap eager`` the driver takes the eager action: it collects the previous round's background
all-reduce and launches this round's. Here the launches of the workers on time form the round's group
(:meth:`SimGroup.contribute`, reduced once the round ends), and the next round's collect hands each member
its result, as ``peer.eager.EagerOverlap`` does; a late worker's launch finds no group.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from p2p_diloco.build import build_local
from p2p_diloco.config import TrainConfig
from p2p_diloco.core.delayed import StalenessPolicy, fold_scales, group_stats
from p2p_diloco.core.lease import BufferLease
from p2p_diloco.core.outer import MOMENTUM_KEY_PREFIX
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.robust import aggregate
from p2p_diloco.core.round_driver import Collected, RoundDriver
from p2p_diloco.core.rounds import Observation, Outcome, RoundPolicy, RoundReport, RoundResult
from p2p_diloco.core.sync import Catchup, Digest, SyncPolicy
from p2p_diloco.simulate.engine import RoundRecord, SimConfig, SimResult, allreduce_bytes, allreduce_seconds
from p2p_diloco.simulate.faults import FaultSchedule

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 600.0
"""A simulated all-reduce waits at most this long for its members (they only compute, so never in practice)."""


@dataclass
class SwarmSimResult(SimResult):
    outcomes: dict[str, list[str | None]] = field(default_factory=dict)
    """Per worker, each round's outcome (None: absent or dropped that round)."""


class SimGroup:
    """One round's all-reduce among the workers on time; members of one epoch average together."""

    def __init__(self, expected: Sequence[int], partial: bool) -> None:
        self._cond = threading.Condition()
        self._waiting = set(expected)
        self._members: dict[int, tuple] = {}
        self._results: dict[int, RoundResult] | None = None
        self.partial = partial
        self.sizes: list[int] = []

    def leave(self, index: int) -> None:
        """``index`` finished its round (without averaging, or after)."""
        with self._cond:
            self._waiting.discard(index)
            self._cond.notify_all()

    def average(self, index: int, peer_id: str, delta: Sequence[torch.Tensor], weight: float, staleness: int,
                epoch: int, stale: Sequence[torch.Tensor] | None, stale_weight: float) -> RoundResult:
        with self._cond:
            self._members[index] = (peer_id, list(delta), weight, staleness, epoch, stale, stale_weight)
            self._waiting.discard(index)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: not self._waiting, timeout=GROUP_TIMEOUT_S):
                return RoundResult(Outcome.SKIPPED, "simulated group timed out", epoch)
            if self._results is None:
                self._results = self._reduce()
            return self._results[index]

    def contribute(self, index: int, peer_id: str, delta: Sequence[torch.Tensor], weight: float, staleness: int,
                   epoch: int, stale: Sequence[torch.Tensor] | None, stale_weight: float) -> None:
        """An eager member's launch: its work joins the group without waiting (copies: the caller trains on)."""
        with self._cond:
            self._members[index] = (peer_id, [t.detach().clone() for t in delta], weight, staleness, epoch,
                                    None if stale is None else [t.detach().clone() for t in stale], stale_weight)

    def close(self) -> None:
        """The round ended: reduce what the eager members launched (their results wait for :meth:`result`)."""
        with self._cond:
            if self._results is None:
                self._results = self._reduce()

    def result(self, index: int, epoch: int) -> RoundResult:
        """A closed group's result for member ``index``."""
        with self._cond:
            if self._results is None or index not in self._results:
                return RoundResult(Outcome.SKIPPED, "no group formed within matchmaking_timeout_s", epoch)
            return self._results[index]

    def _reduce(self) -> dict[int, RoundResult]:
        by_epoch: dict[int, list[int]] = {}
        for index in sorted(self._members):
            by_epoch.setdefault(self._members[index][4], []).append(index)
        results = {}
        for epoch, indices in by_epoch.items():
            members = [self._members[i] for i in indices]
            ids = tuple(m[0] for m in members)
            base = dict(contributors=ids, weights=tuple(m[2] for m in members),
                        stale_weights=tuple(m[6] if m[5] is not None else 0.0 for m in members),
                        stalenesses=tuple(m[3] for m in members))
            if len(members) < 2:
                for i in indices:
                    results[i] = RoundResult(Outcome.SKIPPED, "no group formed within matchmaking_timeout_s", epoch)
                continue
            if self.partial:
                for i in indices:
                    results[i] = RoundResult(Outcome.SKIPPED, "partial all-reduce: a member failed (scheduled)",
                                             epoch, **base)
                continue
            self.sizes.append(len(members))
            # The swarm's fold scales (core.delayed.fold_scales, as swarm.group.GroupPlan.local_scales): each
            # member pre-scales its fresh and late work, and the all-reduce takes the plain mean over members.
            stats = group_stats([m[2] for m in members], [m[6] if m[5] is not None else 0.0 for m in members],
                                [m[3] if m[5] is not None else 0 for m in members], list(ids))
            scales = [fold_scales(m[2], m[6] if m[5] is not None else 0.0, stats) for m in members]
            fresh = _mean_of_scaled([m[1] for m in members], [a for a, _ in scales])
            stale = None
            if stats.has_stale:
                stale = _mean_of_scaled([m[5] if m[5] is not None else [torch.zeros_like(t) for t in fresh]
                                         for m in members], [b if m[5] is not None else 0.0
                                                            for m, (_, b) in zip(members, scales, strict=True)])
            for i in indices:
                results[i] = RoundResult(Outcome.AVERAGED, "", epoch, with_stale=stale is not None,
                                         fresh_mean=[t.clone() for t in fresh],
                                         stale_term=None if stale is None else [t.clone() for t in stale], **base)
        return results


def _mean_of_scaled(contributions: Sequence[Sequence[torch.Tensor]], scales: Sequence[float]) -> list[torch.Tensor]:
    """The all-reduce's mean, in the swarm's arithmetic: each member scales its tensors in fp32, as
    ``swarm.round_process`` does before sending (zeros where its scale is 0), and the reducers take
    ``core.robust.aggregate``'s mean (in float64, rounded once to fp32). A plain running sum in fp32 rounds
    differently by an ulp, and training amplifies an ulp to 1e-5 within four rounds, so the simulator and
    the swarm would part ways on rounding alone."""
    scaled = [[torch.zeros_like(t, dtype=torch.float32) if s == 0.0 else t.float().mul(s) for t in tensors]
              for tensors, s in zip(contributions, scales, strict=True)]
    return [aggregate([member[i] for member in scaled], "mean") for i in range(len(scaled[0]))]


class SimWorker:
    """One simulated peer: its local setup, outer state and round driver."""

    def __init__(self, index: int, cfg: TrainConfig, data_id: str, policy: RoundPolicy, world: SwarmWorld) -> None:
        self.index, self.peer_id = index, data_id
        self.local = build_local(copy.deepcopy(cfg), peer_id=data_id)
        self.params = self.local.trainer.parameters()
        self.state = OuterState(self.params, lr=cfg.outer.lr, momentum=cfg.outer.momentum,
                                policy=policy.staleness, codec=cfg.outer.compression,
                                error_feedback=cfg.outer.error_feedback,
                                error_feedback_decay=cfg.outer.error_feedback_decay,
                                chunk_size=cfg.outer.topk_chunk_size, k=cfg.outer.topk_k, device="cpu")
        self.port = SimPort(world, self)
        # The swarm's catch-up (core.sync), on the simulator's port: no update is ever served, so it downloads.
        self.catchup = Catchup(self.state, self.params, SyncPolicy(), SimSync(world, self), default_timeout_s=0.0)
        self.driver = RoundDriver(self.state, self.params, policy, self.port, data_id)
        self.outcomes: list[str | None] = []


class SwarmWorld:
    """What the DHT holds: each worker's published epoch and servable state; and the round's group."""

    def __init__(self) -> None:
        self.published: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        self.present: set[int] = set()
        self.saw_others: set[int] = set()
        self.group: SimGroup | None = None
        self.launched: dict[int, _Launch] = {}
        """Eager: each worker's last background all-reduce."""
        self.lock = threading.Lock()

    def publish(self, worker: SimWorker) -> None:
        state = worker.state
        tensors = {f"param.{i}": a.detach().clone() for i, a in enumerate(state.anchors)}
        if state.outer.momentum > 0:
            tensors.update({f"outer.momentum.{i}": (m if m is not None else torch.zeros_like(a)).detach().clone()
                            for i, (m, a) in enumerate(zip(state.outer.momentum_buffers(), state.anchors,
                                                           strict=True))})
        with self.lock:
            self.published[worker.index] = (state.epoch, tensors)

    def swarm_epoch(self) -> int | None:
        with self.lock:
            epochs = [self.published[i][0] for i in self.present if i in self.published]
        return max(epochs) if epochs else None

    def donor(self, min_epoch: int, exclude: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self.lock:
            offers = sorted((-epoch, i) for i, (epoch, _) in self.published.items()
                            if i != exclude and i in self.present and epoch >= min_epoch)
            return self.published[offers[0][1]] if offers else None


@dataclass
class SimDownload:
    """A published state as a simulated joiner downloads it (``core.sync.DownloadedState``)."""

    params: list[torch.Tensor]
    opt_tensors: list[torch.Tensor]
    epoch: int
    donor: str
    state_sha256: str = ""
    params_manifest: None = None
    delivered: dict[str, int] | None = None


class SimSync:
    """The ``core.sync.SyncPort`` of one simulated worker: the swarm's catch-up, minus what needs a network.

    A download is a copy of the newest published state (every worker is honest and every copy exact, so there is
    nothing to verify, vote on or credit); no round update is served (the simulator's joiners take a state of
    any epoch), so :class:`core.sync.Catchup` downloads where the swarm would apply a missed round, and loads
    the state itself, as it does on the network."""

    def __init__(self, world: SwarmWorld, worker: SimWorker) -> None:
        self.world, self.worker = world, worker

    def swarm_epoch(self) -> int | None:
        return self.world.swarm_epoch()

    def trusted(self) -> None:
        return None

    def syncing(self, min_epoch: int) -> None:
        pass  # nothing is served from the simulator's anchors

    def resume_serving(self) -> None:
        pass

    def serve(self, manifest: object) -> None:
        self.world.publish(self.worker)

    def base_digest(self) -> str:
        return ""

    def fetch_update(self, *args: object) -> None:
        return None

    def download(self, min_epoch: int, timeout: float, trusted: object, backed: dict[str, int]) -> SimDownload | None:
        offer = self.world.donor(min_epoch, self.worker.index)
        if offer is None:
            return None
        epoch, tensors = offer
        n = len(self.worker.state.anchors)
        momentum = [tensors[f"{MOMENTUM_KEY_PREFIX}{i}"].clone() for i in range(n)
                    if f"{MOMENTUM_KEY_PREFIX}{i}" in tensors]
        return SimDownload([tensors[f"param.{i}"].clone() for i in range(n)], momentum, epoch, "simulated donor")

    def received(self, ok: bool) -> None:
        pass

    def digest(self, params: object, momentum: object) -> Digest:
        raise AssertionError("the simulator serves no round updates: there is nothing to check")

    def votes(self, epoch: int) -> dict[str, str]:
        return {}

    def credit(self, delivered: object, trusted: object) -> None:
        return None

    def unbacked(self, min_epoch: int, backed: dict[str, int]) -> dict[str, float]:
        return {}

    def started_late(self, epoch: int, floor_s: float) -> None:
        pass


@dataclass
class _Launch:
    """One eager worker's background all-reduce (``SimPort.launch``)."""

    epoch: int
    group: SimGroup | None
    """The round's group it joined; None when it launched after the group formed (a late worker)."""
    folded_stale: bool
    discarded: str = ""


class SimPort:
    """The ``RoundPort`` of one simulated worker (see ``core.round_driver``)."""

    def __init__(self, world: SwarmWorld, worker: SimWorker) -> None:
        self.world, self.worker = world, worker

    def observe(self, epoch: int) -> Observation:
        visible = len(self.world.present)
        if visible > 1:
            self.world.saw_others.add(self.worker.index)
        # The solo timer runs on wall time in the swarm; here a worker that saw others never goes solo.
        unseen = 0.0 if self.worker.index in self.world.saw_others else None
        return Observation(epoch, self.world.swarm_epoch(), visible, unseen_s=unseen)

    def in_minority(self, epoch: int) -> bool:
        return False  # simulated workers apply bit-identical averages

    def swarm_epoch(self) -> int | None:
        return self.world.swarm_epoch()

    def averaging(self, epoch: int) -> None:
        pass

    def before_allreduce(self) -> None:
        pass

    def average(self, lease: BufferLease, weight: float, staleness: int, epoch: int,
                stale_weight: float) -> RoundResult:
        delta, stale = lease.in_flight()
        group = self.world.group
        if group is None:
            return RoundResult(Outcome.SKIPPED, "no group formed within matchmaking_timeout_s (arrived late)", epoch)
        sent, stale_sent = self._wire(delta, stale)
        result = group.average(self.worker.index, self.worker.peer_id, sent, weight, staleness, epoch, stale_sent,
                               stale_weight)
        return self._reply(result)

    def _wire(self, delta: Sequence[torch.Tensor], stale: Sequence[torch.Tensor] | None
              ) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor] | None]:
        """What the group receives: both regions through the codec (as they are without one)."""
        codec = self.worker.state.codec
        if codec.name == "none":
            return delta, stale
        return self.worker.state.encode(delta)[0], None if stale is None else [codec.roundtrip(t) for t in stale]

    def _reply(self, result: RoundResult) -> RoundResult:
        """The reduced parts travel back through the codec's reply codec."""
        codec = self.worker.state.codec
        if codec.name == "none":
            return result
        reply = codec.reply_codec
        if result.fresh_mean is not None:
            result.fresh_mean = [reply.roundtrip(t) for t in result.fresh_mean]
        if result.stale_term is not None:
            result.stale_term = [reply.roundtrip(t) for t in result.stale_term]
        return result

    def resync(self, min_epoch: int) -> bool:
        return self.worker.catchup.run(min_epoch)

    def published(self, epoch: int, update: object = None) -> None:
        self.world.publish(self.worker)  # the simulator's joiners take a state of any epoch: no update served

    def collect(self, epoch: int, timeout: float) -> Collected:
        """Eager: the previous round's background all-reduce, by ``peer.eager.EagerOverlap.collect``'s rules
        (the simulator never waits: a group closed when its round ended)."""
        launch = self.world.launched.pop(self.worker.index, None)
        if launch is None:
            return Collected(None, "no all-reduce was launched for the previous round", 0.0)
        if launch.epoch != epoch or launch.discarded:
            why = launch.discarded or f"the last one launched was for epoch {launch.epoch}"
            return Collected(None, f"no usable all-reduce of epoch {epoch}: {why}", 0.0)
        result = (launch.group.result(self.worker.index, epoch) if launch.group is not None else
                  RoundResult(Outcome.SKIPPED, "no group formed within matchmaking_timeout_s (arrived late)", epoch))
        if not result.averaged or result.fresh_mean is None:
            return Collected(None, f"the all-reduce of epoch {epoch} did not complete: {result.reason}", 0.0)
        if self.worker.peer_id not in result.contributors:
            return Collected(None, f"the all-reduce of epoch {epoch} did not include this peer", 0.0)
        return Collected(self._reply(result), "", 0.0, folded_stale=launch.folded_stale)

    def launch(self, delta: Sequence[torch.Tensor], weight: float, staleness: int, epoch: int,
               stale: Sequence[torch.Tensor] | None, stale_weight: float) -> bool:
        """Eager: this round's work joins the round's group (none for a worker ending after it formed)."""
        group = self.world.group
        if group is not None:
            sent, stale_sent = self._wire(delta, stale)
            group.contribute(self.worker.index, self.worker.peer_id, sent, weight, staleness, epoch, stale_sent,
                             stale_weight)
        self.world.launched[self.worker.index] = _Launch(epoch, group, stale is not None)
        return True

    def discard(self, why: str) -> None:
        launch = self.world.launched.get(self.worker.index)
        if launch is not None:
            launch.discarded = why

    def lease(self) -> BufferLease | None:
        return None  # in-process: the driver's own buffers

    def withdraw(self) -> None:
        pass  # nothing is served from the simulator's anchors


class SwarmSimulation:
    """``sim.workers`` workers driving the round policy for ``sim.rounds`` rounds under ``faults``.

    Args:
        data_ids: each worker's data shard name (default ``sim-worker-{i}``); a swarm peer's is its peer id.
    """

    def __init__(self, cfg: TrainConfig, sim: SimConfig, faults: FaultSchedule | None = None,
                 data_ids: Sequence[str] | None = None) -> None:
        self.cfg, self.sim, self.faults = cfg, sim, faults or FaultSchedule()
        self.faults.check_workers(sim.workers)
        ids = list(data_ids or [f"sim-worker-{i}" for i in range(sim.workers)])
        if len(ids) != sim.workers:
            raise ValueError(f"data_ids: need {sim.workers}, got {len(ids)}")
        policy = RoundPolicy(StalenessPolicy(cfg.outer.staleness_decay, cfg.outer.max_staleness), solo_after_s=1.0,
                             eager=cfg.outer.overlap == "eager")
        self.world = SwarmWorld()
        self.workers = [SimWorker(i, cfg, ids[i], policy, self.world) for i in range(sim.workers)]
        for w in self.workers:
            self.world.publish(w)

    def _restart(self, worker: SimWorker) -> None:
        """A dropped worker lost its round's work and restarts from the swarm's newest state."""
        worker.driver.restart()

    def run(self, progress=None) -> SwarmSimResult:
        cfg, sim, H = self.cfg, self.sim, self.cfg.outer.local_steps
        judge = self.workers[0]
        result = SwarmSimResult(mode=sim.mode, workers=sim.workers, local_steps=H, speeds=list(sim.speeds),
                                compression=cfg.outer.compression, model=cfg.model.model, seed=cfg.run.seed,
                                initial_eval_loss=judge.local.trainer.evaluate(judge.local.eval_batches))
        clock, steps, sent = 0.0, 0, 0
        for rnd in range(sim.rounds):
            joining = [w for w in self.workers if w.index not in self.world.present
                       and self.faults.joined(w.index, rnd)]
            for w in joining:
                self.world.present.add(w.index)
                if rnd > 0 and w.port.resync(self.world.swarm_epoch() or 0):
                    w.driver.new_state()
            present = [w for w in self.workers if w.index in self.world.present]
            faults = self.faults.round_faults(rnd, self.world.swarm_epoch() or 0, sim.workers)
            samples = {}
            for w in present:
                w.driver.begin()
                samples[w.index] = w.local.trainer.train_steps(H).samples
                steps += H
            on_time = [w for w in present if w.index not in faults.late | faults.dropped]
            group = self.world.group = SimGroup([w.index for w in on_time], faults.partial)
            reports = self._end_together(on_time, samples)
            self.world.group = None
            group.close()  # eager: the launches of the workers on time formed the round's group
            for w in present:
                if w.index in faults.late:
                    reports[w.index] = w.driver.end(samples[w.index], RoundReport(epoch=w.state.epoch), 0.0)
                elif w.index in faults.dropped:
                    self._restart(w)
            for w in self.workers:
                report = reports.get(w.index)
                w.outcomes.append(report.outcome.value if report is not None else None)
            nbytes = judge.state.encoded_nbytes()
            size = max([0, *group.sizes])
            phase = max(H * sim.step_time_s / sim.speeds[w.index] for w in present)
            clock += phase + allreduce_seconds(nbytes, size, sim.bandwidth_mbps)
            sent += allreduce_bytes(nbytes, size)
            record = RoundRecord(rnd + 1, judge.local.trainer.evaluate(judge.local.eval_batches), clock, sent, steps)
            result.rounds.append(record)
            result.final_eval_loss, result.virtual_time_s = record.eval_loss, clock
            result.total_bytes_sent_per_worker, result.total_inner_steps = sent, steps
            if progress:
                progress(record)
        result.outcomes = {w.peer_id: list(w.outcomes) for w in self.workers}
        return result

    def _end_together(self, on_time: list[SimWorker], samples: dict[int, int]) -> dict[int, RoundReport]:
        """The on-time workers end their rounds at once (an all-reduce needs every member)."""
        reports: dict[int, RoundReport] = {}
        errors: list[BaseException] = []

        def end(w: SimWorker) -> None:
            try:
                reports[w.index] = w.driver.end(samples[w.index], RoundReport(epoch=w.state.epoch), 0.0)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread below
                errors.append(e)
            finally:
                self.world.group.leave(w.index)

        threads = [threading.Thread(target=end, args=(w,), name=f"sim-worker-{w.index}") for w in on_time]
        for t in threads:
            t.start()
        for t in threads:
            t.join(GROUP_TIMEOUT_S)
        if errors:
            raise errors[0]
        return reports


def run_swarm(cfg: TrainConfig, sim: SimConfig, faults: FaultSchedule | None = None,
              progress=None) -> SwarmSimResult:
    """Run the ``swarm`` mode; deterministic for a given ``cfg.run.seed`` and ``faults.seed``."""
    return SwarmSimulation(cfg, sim, faults).run(progress)
