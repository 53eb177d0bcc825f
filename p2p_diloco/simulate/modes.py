"""The simulated training modes. Each drives the same core objects the swarm drives.

- ``ddp``: one model, k-times batch, gradients averaged every step (data parallel).
- ``diloco`` / ``fedavg``: synchronous rounds; everybody waits for the slowest worker.
- ``async``: server-style naive asynchronous Nesterov, every push is a Nesterov step.
- ``async-dn``: Delayed Nesterov with DyLU step counts (Liu et al.).
- ``eager``: synchronous rounds whose all-reduce overlaps the next inner phase (Kale et al.).
- ``swarm``: DiLoCo rounds decided by the swarm's own round policy, with drops, late arrivals, partial groups
  and joiners from a fault schedule (:mod:`p2p_diloco.simulate.swarm_mode`).
- ``streaming``: Streaming DiLoCo, fragments synchronised at staggered times (:mod:`p2p_diloco.simulate.streaming`).

Equal compute: every mode runs ``rounds x local_steps x workers`` inner steps in total (ddp: the same
number of per-worker batches), so final losses compare like for like; virtual times then differ.
"""

from __future__ import annotations

import copy
import heapq
import logging
import math
from collections.abc import Callable, Sequence

import torch

from p2p_diloco.config import TrainConfig
from p2p_diloco.core.codecs import Codec
from p2p_diloco.core.delayed import DelayedNesterov, NaiveAsyncNesterov, RoundAggregate, summarize_round
from p2p_diloco.core.dylu import DyLU
from p2p_diloco.core.robust import GroupReduction
from p2p_diloco.core.sparse import TopKCodec
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
from p2p_diloco.simulate.faults import FaultSchedule
from p2p_diloco.simulate.streaming import run_streaming
from p2p_diloco.simulate.swarm_mode import run_swarm
from p2p_diloco.trainer import InnerTrainer, evaluate_model

logger = logging.getLogger(__name__)
Progress = Callable[[RoundRecord], None]


def _eval(worker: Worker, params: list[torch.Tensor] | None = None) -> float:
    """Eval loss of ``params`` (default: the worker's own) on the shared held-out batches."""
    trainer = worker.local.trainer
    if params is None:
        return trainer.evaluate(worker.local.eval_batches)
    model = copy.deepcopy(trainer.model)
    with torch.no_grad():
        for p, q in zip(model.parameters(), params, strict=True):
            p.copy_(q)
    return evaluate_model(model, worker.local.eval_batches, trainer.device, trainer.amp_dtype)


def _result(cfg: TrainConfig, sim: SimConfig, initial: float) -> SimResult:
    return SimResult(
        mode=sim.mode,
        workers=sim.workers,
        local_steps=cfg.outer.local_steps,
        speeds=list(sim.speeds),
        compression=cfg.outer.compression,
        model=cfg.model.model,
        seed=cfg.run.seed,
        initial_eval_loss=initial,
        aggregation=sim.aggregation,
        byzantine=dict(sim.byzantine),
        norm_outlier_factor=sim.norm_outlier_factor,
    )


def _allreduce(
    reduction: GroupReduction,
    sent: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    result: SimResult,
    rnd: int,
    workers: Sequence[Worker] | None = None,
) -> list[torch.Tensor]:
    """The group's reduced pseudo-gradient, as the swarm's reducers compute it; bans go to the result, and a
    banned sender among ``workers`` forgets its error-feedback residual."""
    mean = reduction.reduce(sent, weights)
    record_bans(result, reduction, rnd)
    if workers is not None:
        for _, sender, _ in reduction.new_bans:  # a rejected part's residual is not sent again
            if workers[sender].state.feedback is not None:
                workers[sender].state.feedback.reset()
    if reduction.faults:
        logger.warning(
            "Round %d: parts reduced to zeros (the swarm would skip the round): %s",
            rnd,
            "; ".join(reduction.faults),
        )
    return mean


def _record(
    result: SimResult,
    rnd: int,
    loss: float,
    time_s: float,
    bytes_sent: int,
    steps: int,
    progress: Progress | None,
) -> None:
    rec = RoundRecord(rnd, loss, time_s, bytes_sent, steps)
    result.rounds.append(rec)
    result.final_eval_loss, result.virtual_time_s = loss, time_s
    result.total_bytes_sent_per_worker, result.total_inner_steps = bytes_sent, steps
    if progress:
        progress(rec)


def _reply(codec: Codec, mean: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """What every member decodes from the reducers' replies, and their bytes (the whole vector's)."""
    reply = codec.reply_codec
    data = [reply.encode(t) for t in mean]
    return [reply.decode(d, t.shape) for d, t in zip(data, mean, strict=True)], sum(len(d) for d in data)


def _credit_undelivered(sim: SimConfig, workers: Sequence[Worker], decoded: Sequence[Sequence[torch.Tensor]],
                        replied: Sequence[torch.Tensor], banned: set[int]) -> None:
    """``SimConfig.credit_undelivered``: each honest, unbanned worker takes back what the reply dropped. Sparse
    codecs only, as in the swarm (``CodecCompression.credit_undelivered``): a dense reply drops nothing, and
    an entry it rounds to zero was delivered, not dropped."""
    if not sim.credit_undelivered or not workers or not isinstance(workers[0].state.codec, TopKCodec):
        return
    for w, sent in zip(workers, decoded, strict=True):
        if w.state.feedback is None or w.index in sim.byzantine or w.index in banned:
            continue
        for index, (t, r) in enumerate(zip(sent, replied, strict=True)):
            w.state.feedback.credit_undelivered(index, t, r)


def run_sync(cfg: TrainConfig, sim: SimConfig, progress: Progress | None = None) -> SimResult:
    """diloco and fedavg: every worker runs H steps from the shared anchors, then one outer step."""
    lr, momentum = (1.0, 0.0) if sim.mode == "fedavg" else (cfg.outer.lr, cfg.outer.momentum)
    workers = build_workers(cfg, sim, lr=lr, momentum=momentum)
    reduction = group_reduction(sim, workers[0].state)
    judge = next(w for w in workers if w.index not in sim.byzantine)
    H = cfg.outer.local_steps
    result = _result(cfg, sim, _eval(judge))
    clock, steps, sent = 0.0, 0, 0
    for rnd in range(1, sim.rounds + 1):
        sent_all, own_all, weights, nbytes = [], [], [], 0
        for w, stats in zip(workers, train_round(workers, H), strict=True):
            decoded, nbytes = w.state.encode(w.state.pseudo_gradient(w.params))
            own_all.append(decoded)
            sent_all.append(sent_by(sim, w, decoded))
            weights.append(float(stats.samples))
            steps += H
        mean = _allreduce(reduction, sent_all, weights, result, rnd, workers)
        stats = summarize_round(
            weights, [0] * sim.workers, workers[0].state.policy, [str(i) for i in range(sim.workers)]
        )
        # The reduced result travels back through the codec's reply encoding.
        replied, reply_nbytes = _reply(workers[0].state.codec, mean)
        _credit_undelivered(sim, workers, own_all, replied, {b for _, b, _ in reduction.new_bans})
        aggregate = RoundAggregate(replied, None, stats)
        for w in workers:
            w.state.apply(aggregate, w.params)
        phase = max(H * sim.step_time_s / w.speed for w in workers)
        clock += phase + allreduce_seconds(nbytes, sim.workers, sim.bandwidth_mbps, reply_nbytes)
        sent += allreduce_bytes(nbytes, sim.workers, reply_nbytes)
        _record(result, rnd, _eval(judge), clock, sent, steps, progress)
    return result


def run_eager(cfg: TrainConfig, sim: SimConfig, progress: Progress | None = None) -> SimResult:
    """Eager: round t's average is used in round t+1, with the own term always fresh."""
    workers = build_workers(cfg, sim, lr=cfg.outer.lr, momentum=cfg.outer.momentum)
    reduction = group_reduction(sim, workers[0].state)
    judge = next(w for w in workers if w.index not in sim.byzantine)
    H = cfg.outer.local_steps
    result = _result(cfg, sim, _eval(judge))
    clock, steps, sent = 0.0, 0, 0
    prev_avg: list[torch.Tensor] | None = None
    prev_shares: list[float] = []
    for rnd in range(1, sim.rounds + 1):
        fresh, decoded_all, decoded_all_own, weights, nbytes = [], [], [], [], 0
        for w, stats in zip(workers, train_round(workers, H), strict=True):
            delta = [t.clone() for t in w.state.pseudo_gradient(w.params)]
            decoded, nbytes = w.state.encode(delta)
            decoded_all_own.append(decoded)
            fresh.append(delta)
            decoded_all.append(sent_by(sim, w, decoded))
            weights.append(float(stats.samples))
            steps += H
        for w, own in zip(workers, fresh, strict=True):
            share = prev_shares[w.index] if prev_avg is not None else None
            w.state.apply_eager(own, prev_avg, sim.workers, w.params, own_share=share)
        # Launched now, used next round: the all-reduce hides behind the next inner phase.
        mean = _allreduce(reduction, decoded_all, weights, result, rnd, workers)
        prev_avg, reply_nbytes = _reply(workers[0].state.codec, mean)
        _credit_undelivered(sim, workers, decoded_all_own, prev_avg, {b for _, b, _ in reduction.new_bans})
        prev_shares = [x / sum(weights) for x in weights]
        phase = max(H * sim.step_time_s / w.speed for w in workers)
        clock += max(phase, allreduce_seconds(nbytes, sim.workers, sim.bandwidth_mbps, reply_nbytes))
        sent += allreduce_bytes(nbytes, sim.workers, reply_nbytes)
        _record(result, rnd, _eval(judge), clock, sent, steps, progress)
    return result


def run_ddp(cfg: TrainConfig, sim: SimConfig, progress: Progress | None = None) -> SimResult:
    """Data parallel: one model, a k-times batch made of every worker's batch, averaged every step."""
    workers = build_workers(cfg, sim, lr=cfg.outer.lr, momentum=cfg.outer.momentum)
    base = workers[0]
    inner = copy.deepcopy(cfg.inner)
    inner.micro_batch_size = cfg.inner.micro_batch
    inner.batch_size = cfg.inner.batch_size * sim.workers
    streams = [w.local.stream for w in workers]

    def batches():
        while True:
            yield torch.cat([s.next_batch() for s in streams])

    trainer = InnerTrainer(base.local.model, inner, batches())
    H = cfg.outer.local_steps
    grad_bytes = 4 * base.state.numel
    step_time = sim.step_time_s / min(sim.speeds) + allreduce_seconds(
        grad_bytes, sim.workers, sim.bandwidth_mbps
    )
    result = _result(cfg, sim, trainer.evaluate(base.local.eval_batches))
    clock, steps, sent = 0.0, 0, 0
    for rnd in range(1, sim.rounds + 1):
        trainer.train_steps(H)
        clock += H * step_time
        steps += H * sim.workers
        sent += H * allreduce_bytes(grad_bytes, sim.workers)
        _record(result, rnd, trainer.evaluate(base.local.eval_batches), clock, sent, steps, progress)
    return result


def run_async(cfg: TrainConfig, sim: SimConfig, progress: Progress | None = None) -> SimResult:
    """Server-style asynchronous training: each worker pushes when done and pulls the new θ at once.

    ``async`` applies every push as a Nesterov step with lr/k (so k pushes move about as far as one
    synchronous step); ``async-dn`` uses Delayed Nesterov (buffer k) and DyLU step counts.
    A record is written every k pushes; the run stops at the synchronous modes' total compute.
    """
    workers = build_workers(cfg, sim, lr=cfg.outer.lr, momentum=cfg.outer.momentum)
    H, k = cfg.outer.local_steps, sim.workers
    theta = [a.clone() for a in workers[0].state.anchors]
    if sim.mode == "async":
        server: NaiveAsyncNesterov | DelayedNesterov = NaiveAsyncNesterov(
            theta, lr=cfg.outer.lr / k, momentum=cfg.outer.momentum
        )
    else:
        server = DelayedNesterov(theta, buffer_size=k, beta=cfg.outer.momentum, lr=cfg.outer.lr)
    dylu = DyLU(H, min_steps=cfg.outer.min_local_steps, alpha=1.0, clock=lambda: 0.0)
    for w in workers:
        dylu.observe(str(w.index), w.speed / sim.step_time_s, now=0.0)
    result = _result(cfg, sim, _eval(workers[0]))
    budget = sim.rounds * H * k
    steps, pushes, sent = 0, 0, 0
    queue: list[tuple[float, int, list[torch.Tensor]]] = []

    def start(w: Worker, now: float) -> None:
        nonlocal steps
        n = H if sim.mode == "async" else dylu.local_steps(w.speed / sim.step_time_s, now=0.0)
        n = min(n, max(1, budget - steps))
        # Pull: the worker's anchors become the server's current θ.
        for a, t in zip(w.state.anchors, server.params, strict=True):
            a.copy_(t)
        w.state.begin(w.params)
        w.local.trainer.train_steps(n)
        steps += n
        decoded, nbytes = w.state.encode(w.state.pseudo_gradient(w.params))
        w.bytes_sent += nbytes
        heapq.heappush(queue, (now + n * sim.step_time_s / w.speed, w.index, decoded))

    for w in workers:
        start(w, 0.0)
    while queue:
        now, index, delta = heapq.heappop(queue)
        server.push(delta)
        pushes += 1
        if steps < budget:
            start(workers[index], now)
        if pushes % k == 0 or not queue:
            sent = max(w.bytes_sent for w in workers)
            loss = _eval(workers[0], server.params)
            _record(result, math.ceil(pushes / k), loss, now, sent, steps, progress)
    return result


def run(cfg: TrainConfig, sim: SimConfig, progress: Progress | None = None,
        faults: FaultSchedule | None = None) -> SimResult:
    """Run ``sim.mode`` on ``cfg``; deterministic for a given ``cfg.run.seed``. ``faults`` only for ``swarm``."""
    torch.manual_seed(cfg.run.seed)
    if faults is not None and faults.active and sim.mode != "swarm":
        raise ValueError(f"faults (drops, late arrivals, partial groups, joiners) need --mode swarm, not {sim.mode}")
    streaming = (cfg.outer.fragments, cfg.outer.fragment_delay, cfg.outer.fragment_alpha) != (1, 0, 0.0)
    if streaming and sim.mode != "streaming":
        raise ValueError(f"--fragments, --fragment-delay and --fragment-alpha need --mode streaming, not {sim.mode}")
    if sim.mode == "streaming":
        return run_streaming(cfg, sim, progress)
    if sim.mode == "swarm":
        return run_swarm(cfg, sim, faults, progress)
    if sim.mode == "ddp":
        return run_ddp(cfg, sim, progress)
    if sim.mode in ("diloco", "fedavg"):
        return run_sync(cfg, sim, progress)
    if sim.mode == "eager":
        return run_eager(cfg, sim, progress)
    return run_async(cfg, sim, progress)
