"""The inner loop on a real preset: loss falls; parameters can be read and written in place."""

from __future__ import annotations

import torch

from p2p_diloco.build import build_local
from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig
from p2p_diloco.models import PRESETS, build_model, count_parameters, model_fingerprint


def tiny_config(steps: int = 40) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig("tiny", seq_len=64),
        data=DataConfig(eval_batches=2),
        inner=InnerConfig(batch_size=8, micro_batch_size=4, lr=2e-3, warmup_steps=5, total_steps=steps),
        outer=OuterConfig(local_steps=steps, min_local_steps=1),
        run=RunConfig(),
    )


def test_tiny_preset_trains_and_eval_loss_falls() -> None:
    torch.manual_seed(0)
    local = build_local(tiny_config(), peer_id="peer-a")
    before = local.trainer.evaluate(local.eval_batches)
    stats = local.trainer.train_steps(40)
    after = local.trainer.evaluate(local.eval_batches)
    assert stats.steps == 40 and stats.samples == 320 and stats.tokens == 320 * 64
    assert before > 5.0  # about ln(259) at initialisation
    assert after < before - 1.5, (before, after)


def test_parameters_are_live_and_loadable() -> None:
    local = build_local(tiny_config(), peer_id="peer-b")
    params = local.trainer.parameters()
    assert params[0] is next(local.model.parameters())
    snapshot = [p.detach().clone() for p in params]
    local.trainer.train_steps(2)
    assert any(not torch.equal(a, b) for a, b in zip(snapshot, params, strict=True))
    local.trainer.load_parameters(snapshot)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, params, strict=True))


def test_presets_sizes_and_same_seed_same_weights() -> None:
    tiny_a = build_model("tiny", 259, 64, seed=3)
    tiny_b = build_model("tiny", 259, 64, seed=3)
    assert 0.5e6 < count_parameters(tiny_a) < 1.5e6
    assert all(torch.equal(a, b) for a, b in zip(tiny_a.parameters(), tiny_b.parameters(), strict=True))
    assert model_fingerprint(tiny_a, "tiny") == model_fingerprint(tiny_b, "tiny")
    small = build_model("small", 259, 64)
    assert 15e6 < count_parameters(small) < 30e6
    assert model_fingerprint(small, "small") != model_fingerprint(tiny_a, "tiny")
    mini = build_model("mini", 259, 64)
    assert 3e6 < count_parameters(mini) < 7e6
    assert set(PRESETS) == {"tiny", "mini", "small", "150m"}


def test_unloadable_model_is_a_clear_error(tmp_path) -> None:
    import pytest

    from p2p_diloco.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="cannot load model"):
        build_model(str(tmp_path / "no-such-model"), 259, 64)
