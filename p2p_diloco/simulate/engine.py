"""The simulator's pieces: workers with real models and data, a virtual clock, and the result record.

Each worker is what a swarm peer is, minus the network: a model, an :class:`InnerTrainer` over its own
data shard and an :class:`OuterState`. Compute runs for real; only time is virtual: a worker with speed
factor ``s`` spends ``step_time_s / s`` virtual seconds per inner step, and an all-reduce of ``S`` bytes
over ``B`` bit/s costs the bandwidth-optimal bound ``2 (k-1)/k * S * 8 / B`` (0 when no bandwidth is
given, i.e. free communication).

The all-reduce modes (diloco, fedavg, eager) average through :class:`core.robust.GroupReduction`: the
swarm reducers' own rule, part by part, with the norm screen and bans. Byzantine workers send their
pseudo-gradient multiplied by a scale there (the swarm fault ``byzantine@E=SCALE``, in every round), so the
loss of a run with an attacker measures what ``SwarmConfig.aggregation`` protects.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from p2p_diloco.build import LocalSetup, build_local
from p2p_diloco.config import TrainConfig
from p2p_diloco.core.delayed import StalenessPolicy
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.robust import (
    AGGREGATION_CHOICES,
    NORM_OUTLIER_FACTOR,
    PART_SIZE_BYTES,
    GroupReduction,
    part_size_values,
)
from p2p_diloco.core.sparse import TopKCodec
from p2p_diloco.inner_stats import InnerStats

if TYPE_CHECKING:
    from p2p_diloco.simulate.batched import BatchedInnerTrainer

logger = logging.getLogger(__name__)

MODES = ("ddp", "diloco", "fedavg", "async", "async-dn", "eager", "swarm", "streaming")
ALLREDUCE_MODES = ("diloco", "fedavg", "eager", "streaming")
"""Modes whose workers average with each other (the others have a server or average gradients)."""


@dataclass
class SimConfig:
    """What to simulate; the training settings themselves come from :class:`TrainConfig`."""

    mode: str = "diloco"
    """One of ddp, diloco, fedavg, async, async-dn, eager, swarm (DiLoCo rounds run by the swarm's own round
    policy, under a fault schedule: ``simulate.swarm_mode``), or streaming (Streaming DiLoCo: the model
    synchronised in ``--fragments`` fragments at staggered times, ``simulate.streaming``)."""
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
    aggregation: str = "auto"
    """How the all-reduce combines the workers' pseudo-gradients, as ``SwarmConfig.aggregation``: ``mean``
    (exact, trusting), ``trimmed-mean`` or ``centered-clip`` (bound what a hostile worker can do; see
    ``core.robust``), or ``auto``: as an open swarm resolves it (``core.robust.default_aggregation``:
    ``centered-clip`` with a sparse codec, else ``mean``). Other than ``mean`` and ``auto`` only in the
    all-reduce modes (diloco, fedavg, eager)."""
    byzantine: dict[int, float] = field(default_factory=dict)
    """Hostile workers: worker index -> the scale it multiplies the pseudo-gradient it sends by, in every
    round (its own copy stays honest), e.g. ``{4: -20.0}`` for a scaled sign flip. The swarm fault
    ``byzantine@E=SCALE`` does the same for one epoch. At least one worker must stay honest (the first
    honest one is evaluated); all-reduce modes only."""
    norm_outlier_factor: float = NORM_OUTLIER_FACTOR
    """``SwarmConfig.norm_outlier_factor``: reducers drop (and ban for the run) a worker whose part is longer
    than this many times the group's median, before the aggregation; 0 disables the screen (to compare the
    aggregation rules alone), otherwise at least 2."""
    part_size_bytes: int = PART_SIZE_BYTES
    """``SwarmConfig.part_size_bytes``: the all-reduce reduces parts of this many wire bytes one at a time
    (the screen and the robust rules act per part), 1 KiB-64 MiB."""
    batched: bool = False
    """Train the k workers of a synchronous round (diloco, fedavg, eager) as one stacked model through
    ``torch.func.vmap`` (:mod:`.batched`). Same numbers up to float rounding; faster where a step is bound
    by kernel launches (small models on a GPU); on a CPU, where the matrix products dominate, 1.2-1.5x less
    CPU time per step at the tiny preset's small batches and none at 8 x 128 or on the mini preset
    (BENCHMARKS.md, "Simulator speed"). The other modes ignore it."""
    credit_undelivered: bool = True
    """With a sparse codec and error feedback (ignored otherwise): after each round every honest worker
    returns to its residual the entries it sent that the reducers' re-sparsified reply dropped
    (``core.codecs.ErrorFeedback.credit_undelivered``), so they are delayed instead of lost. The swarm does
    the same by default (``OuterConfig.credit_undelivered``, ``swarm.hivemind_codecs``), so the default keeps
    the simulator equal to the swarm; the CLI sets it from the same flag, ``--credit-undelivered [BOOL]``
    (``OuterConfig.credit_undelivered``): ``false`` measures what it gains
    (BENCHMARKS.md, "Sparse-codec": at outer lr 1, +19.9% eval loss against none without, +15.4% with).
    diloco, fedavg and eager modes."""

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
        if self.aggregation not in AGGREGATION_CHOICES:
            raise ValueError(
                f"aggregation: must be one of {', '.join(AGGREGATION_CHOICES)}, got {self.aggregation!r}"
            )
        self.byzantine = {int(i): float(scale) for i, scale in self.byzantine.items()}
        if any(not 0 <= i < self.workers for i in self.byzantine):
            raise ValueError(
                f"byzantine: worker indices must be in [0, {self.workers}), got {sorted(self.byzantine)}"
            )
        if any(not math.isfinite(scale) for scale in self.byzantine.values()):
            raise ValueError(f"byzantine: scales must be finite numbers, got {self.byzantine}")
        if len(self.byzantine) >= self.workers:
            raise ValueError("byzantine: at least one worker must stay honest")
        if (self.byzantine or self.aggregation not in ("mean", "auto")) and self.mode not in ALLREDUCE_MODES:
            raise ValueError(
                f"aggregation and byzantine apply to the all-reduce modes ({', '.join(ALLREDUCE_MODES)}), "
                f"not to {self.mode}"
            )
        if not (self.norm_outlier_factor == 0 or 2 <= self.norm_outlier_factor <= 1e12):
            raise ValueError(
                f"norm_outlier_factor: must be 0 (off) or in [2, 1e12], got {self.norm_outlier_factor}"
            )
        if not 1024 <= self.part_size_bytes <= 64 * 2**20:
            raise ValueError(f"part_size_bytes: must be in [1024, {64 * 2**20}], got {self.part_size_bytes}")


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
    aggregation: str = "mean"
    byzantine: dict[int, float] = field(default_factory=dict)
    norm_outlier_factor: float = NORM_OUTLIER_FACTOR
    final_eval_loss: float = float("nan")
    total_inner_steps: int = 0
    total_bytes_sent_per_worker: int = 0
    virtual_time_s: float = 0.0
    rounds: list[RoundRecord] = field(default_factory=list)
    bans: list[str] = field(default_factory=list)
    """"reducer R banned worker W in round N: reason", one entry per ban (the norm screen's catches)."""

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
        self.batched: BatchedInnerTrainer | None = None

    @property
    def params(self) -> list[torch.Tensor]:
        return self.local.trainer.parameters()


def build_workers(cfg: TrainConfig, sim: SimConfig, *, lr: float, momentum: float) -> list[Worker]:
    """k workers with identical initial weights (same seed) and their own data (peer id per worker).

    With ``sim.batched`` (synchronous modes) their parameters become slices of one stacked model, trained
    by :func:`train_round`.
    """
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
            error_feedback_decay=cfg.outer.error_feedback_decay,
            chunk_size=cfg.outer.topk_chunk_size,
            k=cfg.outer.topk_k,
        )
        workers.append(Worker(i, local, state, sim.speeds[i]))
    if sim.batched and sim.mode in ALLREDUCE_MODES and len(workers) > 1:
        from p2p_diloco.simulate.batched import BatchedInnerTrainer

        batched = BatchedInnerTrainer([w.local.model for w in workers], [w.local.stream for w in workers],
                                      cfg.inner)
        for w in workers:
            w.batched = batched
    return workers


def train_round(workers: Sequence[Worker], steps: int) -> list[InnerStats]:
    """Every worker runs ``steps`` inner steps: in one stacked model when they share one, else in turn."""
    batched = workers[0].batched
    if batched is not None:
        return batched.train_steps(steps)
    return [w.local.trainer.train_steps(steps) for w in workers]


def allreduce_seconds(nbytes: int, workers: int, bandwidth_mbps: float, reply_nbytes: int | None = None) -> float:
    """The bandwidth-optimal all-reduce time bound for ``nbytes`` per peer (see :func:`allreduce_bytes`)."""
    if bandwidth_mbps <= 0 or workers < 2:
        return 0.0
    return allreduce_bytes(nbytes, workers, reply_nbytes) * 8 / (bandwidth_mbps * 1e6)


def allreduce_bytes(nbytes: int, workers: int, reply_nbytes: int | None = None) -> int:
    """Bytes each peer sends in a bandwidth-optimal all-reduce of ``nbytes`` (reduce-scatter + gather).

    ``reply_nbytes``: the size of the whole reduced vector as the reducers send it back, when it differs from
    ``nbytes`` (the sparse codecs: the aggregate's own top-k, whose all-zero chunks are smaller). A peer sends ``(n-1)/n`` of its own
    vector and its ``1/n`` of the reply to ``n-1`` members; by symmetry it receives as much."""
    if workers < 2:
        return 0
    reply = nbytes if reply_nbytes is None else reply_nbytes
    return int(round((workers - 1) / workers * (nbytes + reply)))


def group_reduction(sim: SimConfig, state: OuterState) -> GroupReduction:
    """The all-reduce of ``sim.workers`` workers, cut into parts as the swarm cuts them for ``state``'s codec."""
    values = part_size_values(sim.part_size_bytes, state.codec.part_bits_per_value())
    return GroupReduction(
        sim.workers, method=sim.aggregation, norm_factor=sim.norm_outlier_factor, values_per_part=values,
        sparse=isinstance(state.codec, TopKCodec),
    )


def sent_by(sim: SimConfig, worker: Worker, decoded: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """What ``worker`` puts into the all-reduce: its decoded pseudo-gradient, scaled if it is Byzantine."""
    scale = sim.byzantine.get(worker.index)
    return decoded if scale is None else [t * scale for t in decoded]


def record_bans(result: SimResult, reduction: GroupReduction, rnd: int) -> None:
    """Add the bans of ``reduction``'s last round to ``result.bans``."""
    for reducer, worker, reason in reduction.new_bans:
        result.bans.append(f"reducer {reducer} banned worker {worker} in round {rnd}: {reason}")
