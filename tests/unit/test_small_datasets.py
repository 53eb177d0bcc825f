"""Small local datasets: evaluation shrinks to what the held-out split holds, or can be switched off."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from p2p_diloco.build import build_local
from p2p_diloco.config import TrainConfig
from p2p_diloco.config_loader import build


def _jsonl(path: Path, rows: int, words: int) -> Path:
    rng = random.Random(0)
    vocab = ["river", "stone", "light", "green", "the", "a", "walks", "sings", "under", "over"]
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))}) + "\n")
    return path


def _cfg(dataset: Path, **extra: object) -> TrainConfig:
    return build(TrainConfig, None, None, environ={}, base={"data.dataset": str(dataset), **extra})


def test_small_held_out_split_evaluates_on_one_smaller_batch(tmp_path: Path) -> None:
    # 600 lines, about 45 KB: 1% (6 rows) is held out, a few hundred tokens, less than one 16 x 128 batch
    data = _jsonl(tmp_path / "small.jsonl", 600, 12)
    assert 30_000 < data.stat().st_size < 60_000
    local = build_local(_cfg(data), "peer")
    assert len(local.eval_batches) == 1
    rows, seq_len = local.eval_batches[0].shape
    assert 1 <= rows < 16 and seq_len == 128
    assert local.trainer.evaluate(local.eval_batches) > 0


def test_eval_every_0_needs_no_held_out_split(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "tiny.jsonl", 40, 3)  # one held-out row of a few words: not one sequence
    with pytest.raises(ValueError, match=r"fewer than one sequence of --seq-len 128.*--eval-every 0"):
        build_local(_cfg(data), "peer")
    local = build_local(_cfg(data, **{"run.eval_every": 0}), "peer")
    assert local.eval_batches == []
    assert local.stream.next_batch().shape == (16, 128)
