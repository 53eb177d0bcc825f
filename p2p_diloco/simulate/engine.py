"""The simulator's pieces: workers with real models and data, a virtual clock, and the result record.

Each worker is what a swarm peer is, minus the network: a model, an :class:`InnerTrainer` over its own
data shard and an :class:`OuterState`. Compute runs for real; only time is virtual: a worker with speed
factor ``s`` spends ``step_time_s / s`` virtual seconds per inner step, and an all-reduce of ``S`` bytes
over ``B`` bit/s costs the bandwidth-optimal bound ``2 (k-1)/k * S * 8 / B`` (0 when no bandwidth is
given, i.e. free communication).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass, field

import torch

from p2p_diloco.build import LocalSetup, build_local
from p2p_diloco.config import TrainConfig
from p2p_diloco.core.delayed import StalenessPolicy
from p2p_diloco.core.peer_state import OuterState

logger = logging.getLogger(__name__)

MODES = ("ddp", "diloco", "fedavg", "async", "async-dn", "eager")


@dataclass
class SimConfig:
    """What to simulate; the training settings themselves come from :class:`TrainConfig`."""

    mode: str = "diloco"
    """One of ddp, diloco, fedavg, async, async-dn, eager."""
    workers: int = 4
    """k, the number of simulated peers."""
    rounds: int = 10
    """Outer rounds (for async modes: the same total inner compute as this many synchronous rounds)."""
    speeds: list[float] = field(default_factory=list)
    """Per-worker speed factors (1.0 = one inner step per step_time_s); default all 1.0."""
    step_time_s: float = 1.0
    """Virtual seconds an inner step takes at speed 1.0."""
    bandwidth_mbps: float = 0.0
    """Per-peer link speed for the all-reduce time; 0 makes communication free."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers: must be in [1, 64], got {self.workers}")
        if not 1 <= self.rounds <= 100_000:
            raise ValueError(f"rounds: must be in [1, 100000], got {self.rounds}")
        if not self.speeds:
            self.speeds = [1.0] * self.workers
        if len(self.speeds) != self.workers:
            raise ValueError(f"speeds: need {self.workers} values (one per worker), got {len(self.speeds)}")
        if any(not (0.0 < s <= 100.0) for s in self.speeds):
            raise ValueError(f"speeds: each must be in (0, 100], got {self.speeds}")
        if not self.step_time_s > 0:
            raise ValueError(f"step_time_s: must be > 0, got {self.step_time_s}")
        if self.bandwidth_mbps < 0:
            raise ValueError(f"bandwidth_mbps: must be >= 0, got {self.bandwidth_mbps}")


@dataclass
class RoundRecord:
    round: int
    eval_loss: float
    virtual_time_s: float
    bytes_sent_per_worker: int
    inner_steps: int


@dataclass
class SimResult:
    mode: str
    workers: int
    local_steps: int
    speeds: list[float]
    compression: str
    model: str
    seed: int
    initial_eval_loss: float
    final_eval_loss: float = float("nan")
    total_inner_steps: int = 0
    total_bytes_sent_per_worker: int = 0
    virtual_time_s: float = 0.0
    rounds: list[RoundRecord] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class Worker:
    """One simulated peer: real model, real data shard, its own outer state."""

    def __init__(self, index: int, local: LocalSetup, state: OuterState, speed: float) -> None:
        self.index = index
        self.local = local
        self.state = state
        self.speed = speed
        self.clock = 0.0
        self.bytes_sent = 0

    @property
    def params(self) -> list[torch.Tensor]:
        return self.local.trainer.parameters()


def build_workers(cfg: TrainConfig, sim: SimConfig, *, lr: float, momentum: float) -> list[Worker]:
    """k workers with identical initial weights (same seed) and disjoint data (peer id per worker)."""
    policy = StalenessPolicy(cfg.outer.staleness_decay, cfg.outer.max_staleness)
    workers = []
    for i in range(sim.workers):
        local = build_local(copy.deepcopy(cfg), peer_id=f"sim-worker-{i}")
        state = OuterState(
            local.trainer.parameters(),
            lr=lr,
            momentum=momentum,
            policy=policy,
            codec=cfg.outer.compression,
            error_feedback=cfg.outer.error_feedback,
        )
        workers.append(Worker(i, local, state, sim.speeds[i]))
    return workers


def allreduce_seconds(nbytes: int, workers: int, bandwidth_mbps: float) -> float:
    """The bandwidth-optimal all-reduce time bound for ``nbytes`` per peer."""
    if bandwidth_mbps <= 0 or workers < 2:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes * 8 / (bandwidth_mbps * 1e6)


def allreduce_bytes(nbytes: int, workers: int) -> int:
    """Bytes each peer sends in a bandwidth-optimal all-reduce of ``nbytes`` (reduce-scatter + gather)."""
    if workers < 2:
        return 0
    return int(round(2 * (workers - 1) / workers * nbytes))
