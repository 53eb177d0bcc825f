"""Late arrivals: the peer-to-peer delayed rule against server-style Delayed Nesterov, same schedule.

Every worker runs H inner steps per task (no DyLU), so a worker of speed ``s < 1`` finishes ``1/s``
rounds late. Rounds close every ``H * step_time_s`` virtual seconds (the fastest worker's task). At each
round close, every worker whose task has finished hands in its pseudo-gradient, computed from the
parameters it started from, and then starts its next task from the new parameters. Both rules see
exactly these contributions in exactly this order:

- ``p2p`` (what the swarm runs, :func:`core.delayed.aggregate_round`): the fresh contributions' weighted
  mean goes through the outer Nesterov step; late ones (staleness ``s`` = outer steps taken since their
  anchor) are applied once, momentum-free, with the share they would have had among the fresh ones.
- ``server`` (Liu et al.'s Delayed Nesterov, :class:`core.delayed.DelayedNesterov`, buffer N = k): each
  contribution is a push; momentum is updated every N pushes, whatever round they belong to.

With no late worker and k pushes per round the two coincide (both are synchronous DiLoCo).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from p2p_diloco.build import build_local
from p2p_diloco.config import TrainConfig
from p2p_diloco.core.delayed import (
    Contribution,
    DelayedNesterov,
    StalenessPolicy,
    aggregate_round,
    apply_round,
)
from p2p_diloco.core.outer import OuterOptimizer, make_anchors
from p2p_diloco.core.pseudograd import pseudo_gradient
from p2p_diloco.simulate.engine import RoundRecord, SimConfig, SimResult, allreduce_bytes
from p2p_diloco.trainer import evaluate_model

logger = logging.getLogger(__name__)
LATE_RULES = ("p2p", "server")


@dataclass
class _Task:
    start_epoch: int
    finish_s: float
    anchor: list[torch.Tensor]


def run_late_arrivals(
    cfg: TrainConfig, sim: SimConfig, rule: str, progress: Callable[[RoundRecord], None] | None = None
) -> SimResult:
    """Run ``sim.rounds`` round closes with workers of ``sim.speeds`` under ``rule`` (p2p or server)."""
    if rule not in LATE_RULES:
        raise ValueError(f"rule: must be one of {', '.join(LATE_RULES)}, got {rule!r}")
    torch.manual_seed(cfg.run.seed)
    H, k = cfg.outer.local_steps, sim.workers
    locals_ = [build_local(copy.deepcopy(cfg), peer_id=f"sim-worker-{i}") for i in range(k)]
    theta = make_anchors(locals_[0].trainer.parameters())
    policy = StalenessPolicy(cfg.outer.staleness_decay, cfg.outer.max_staleness)
    outer = OuterOptimizer(theta, lr=cfg.outer.lr, momentum=cfg.outer.momentum)
    server = DelayedNesterov(theta, buffer_size=k, beta=cfg.outer.momentum, lr=cfg.outer.lr)
    round_s = H * sim.step_time_s / max(sim.speeds)
    evaluator = locals_[0]
    judge = copy.deepcopy(evaluator.model)

    def evaluate() -> float:
        with torch.no_grad():
            for p, q in zip(judge.parameters(), theta, strict=True):
                p.copy_(q)
        return evaluate_model(judge, evaluator.eval_batches, evaluator.trainer.device, evaluator.trainer.amp_dtype)

    result = SimResult(sim.mode, k, H, list(sim.speeds), cfg.outer.compression, cfg.model.model, cfg.run.seed,
                       evaluate())
    result.mode = f"late-{rule}"
    nbytes = 4 * sum(t.numel() for t in theta)

    def start(i: int, epoch: int, now: float) -> _Task:
        locals_[i].trainer.load_parameters(theta)
        return _Task(epoch, now + H * sim.step_time_s / sim.speeds[i], [t.clone() for t in theta])

    tasks = [start(i, 0, 0.0) for i in range(k)]
    steps = sent = 0
    for rnd in range(1, sim.rounds + 1):
        now = rnd * round_s
        done = [i for i in range(k) if tasks[i].finish_s <= now + 1e-9]
        contributions = []
        for i in done:
            stats = locals_[i].trainer.train_steps(H)
            steps += H
            delta = pseudo_gradient(tasks[i].anchor, locals_[i].trainer.parameters())
            contributions.append(Contribution(delta, float(stats.samples), rnd - 1 - tasks[i].start_epoch,
                                              f"worker-{i}"))
        if contributions:
            if rule == "p2p":
                apply_round(outer, aggregate_round(contributions, policy))
            else:
                for c in contributions:
                    server.push(c.delta)
            sent += allreduce_bytes(nbytes, k)
        for i in done:
            tasks[i] = start(i, rnd, now)
        rec = RoundRecord(rnd, evaluate(), now, sent, steps)
        result.rounds.append(rec)
        result.final_eval_loss, result.virtual_time_s = rec.eval_loss, now
        result.total_inner_steps, result.total_bytes_sent_per_worker = steps, sent
        if progress:
            progress(rec)
    return result
