"""Shared settings of the convergence benchmark and its sweeps (benchmarks/convergence.py)."""

from __future__ import annotations

from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig

MODEL = "tiny"
SEQ_LEN = 64
BATCH = 4
INNER_LR = 1e-3
WARMUP = 20
EVAL_BATCHES = 16
WORKERS = 4
SPEEDS = [1.0, 1.0, 1.0, 0.4]
H = 20
ROUNDS = 10
"""The tables: k = 4, H = 20, 10 rounds = 200 inner steps per worker (the sweeps' horizon, so the tuned
settings hold; what fits three seeds of every run in 45 minutes on 2 shared CPU cores)."""
SWEEP_ROUNDS = 10
"""The sweeps: 200 inner steps per worker at H = 20 (R x H constant across H)."""
SWEEP_LRS = [0.3, 0.7, 1.0]
SWEEP_MOMENTA = [0.0, 0.6, 0.9]
SWEEP_SEEDS = [0]
SWEEP_H = [5, 50]


def config(local_steps: int, rounds: int, seed: int, *, outer_lr: float = 0.7, outer_momentum: float = 0.9,
           compression: str = "none", inner_lr: float = INNER_LR, batch: int = BATCH) -> TrainConfig:
    """The benchmark's TrainConfig: the inner cosine schedule spans the run (rounds x H per worker)."""
    return TrainConfig(
        model=ModelConfig(MODEL, seq_len=SEQ_LEN),
        data=DataConfig(eval_batches=EVAL_BATCHES),
        inner=InnerConfig(batch_size=batch, micro_batch_size=BATCH, lr=inner_lr, warmup_steps=WARMUP,
                          total_steps=rounds * local_steps),
        outer=OuterConfig(local_steps=local_steps, min_local_steps=2, compression=compression, lr=outer_lr,
                          momentum=outer_momentum),
        run=RunConfig(seed=seed),
    )
