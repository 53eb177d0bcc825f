"""The batched simulator (k workers as one vmapped model) gives the unbatched path's numbers."""

from __future__ import annotations

import math

import pytest

from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig
from p2p_diloco.simulate import SimConfig, run


def _cfg(micro: int | None = None) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig("tiny", seq_len=32),
        data=DataConfig(eval_batches=1),
        inner=InnerConfig(batch_size=4, micro_batch_size=micro, lr=2e-3, warmup_steps=1, total_steps=6,
                          grad_clip=0.05),
        outer=OuterConfig(local_steps=3, min_local_steps=1),
        run=RunConfig(seed=3),
    )


@pytest.mark.parametrize(("mode", "micro"), [("diloco", None), ("eager", 2)])
def test_batched_equals_unbatched(mode: str, micro: int | None) -> None:
    # grad_clip 0.05 makes the per-worker clip act on every step, so a clip shared across workers would show.
    plain = run(_cfg(micro), SimConfig(mode, workers=2, rounds=2))
    fast = run(_cfg(micro), SimConfig(mode, workers=2, rounds=2, batched=True))
    assert fast.total_inner_steps == plain.total_inner_steps == 2 * 2 * 3
    assert plain.final_eval_loss < plain.initial_eval_loss
    for a, b in zip(plain.rounds, fast.rounds, strict=True):
        assert math.isclose(a.eval_loss, b.eval_loss, rel_tol=1e-4), (a, b)
    assert plain.total_bytes_sent_per_worker == fast.total_bytes_sent_per_worker


def test_batched_params_are_views_of_the_stack() -> None:
    from p2p_diloco.simulate.engine import build_workers, train_round

    cfg = _cfg()
    workers = build_workers(cfg, SimConfig("diloco", workers=2, rounds=1, batched=True), lr=0.5, momentum=0.5)
    before = [p.detach().clone() for p in workers[1].params]
    stats = train_round(workers, 2)
    assert [s.steps for s in stats] == [2, 2] and all(s.samples == 8 for s in stats)
    moved = sum(float((p.detach() - q.detach()).abs().sum()) for p, q in zip(workers[1].params, before, strict=True))
    assert moved > 0
    # Workers read different data, so their parameters part.
    diff = sum(float((p.detach() - q.detach()).abs().sum()) for p, q in zip(workers[0].params, workers[1].params, strict=True))
    assert diff > 0
