"""``--resume`` continues the inner learning-rate schedule at the saved step, without torch's warning."""

from __future__ import annotations

import warnings

import torch

from p2p_diloco.config import InnerConfig
from p2p_diloco.models import build_model
from p2p_diloco.trainer import InnerTrainer


def _trainer() -> InnerTrainer:
    cfg = InnerConfig(batch_size=2, warmup_steps=10, total_steps=100, device="cpu")
    batches = iter(lambda: torch.randint(0, 259, (2, 16)), None)
    return InnerTrainer(build_model("tiny", 259, 16), cfg, batches)


def test_resume_at_sets_the_schedules_rate_without_the_scheduler_warning() -> None:
    reference = _trainer()
    reference.train_steps(30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _trainer()
        resumed.resume_at(30)
        assert resumed.step_count == 30 and resumed.lr == reference.lr
        resumed.train_steps(2)  # the first real steps after the resume warn neither
        reference.train_steps(2)
    messages = [str(w.message) for w in caught]
    assert not any("lr_scheduler.step()" in m for m in messages), messages
    assert resumed.lr == reference.lr and resumed.step_count == reference.step_count == 32
