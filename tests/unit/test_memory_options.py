"""Memory options of the training device (gradient checkpointing, bf16 weights) and the host allocator setting.

CUDA-only paths (bf16 weights, fused AdamW) cannot run on this CPU machine; what can be checked here is that
they are refused on a CPU with one clear error, and the arithmetic they rely on.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2p_diloco.build import build_local
from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig
from p2p_diloco.core.pseudograd import pseudo_gradient
from p2p_diloco.host_memory import (
    CPU_THRESHOLD,
    DEFAULT_THRESHOLD,
    return_freed_memory,
    set_in_environment,
    threshold_for,
    trim_before_fork,
)


def _config(**inner: object) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig("tiny", seq_len=32), data=DataConfig(eval_batches=1),
        inner=InnerConfig(batch_size=2, lr=1e-3, warmup_steps=1, device="cpu", **inner),
        outer=OuterConfig(local_steps=2, min_local_steps=1), run=RunConfig(eval_every=0),
    )


def test_gradient_checkpointing_is_enabled_and_gives_the_same_step() -> None:
    plain = build_local(_config(), peer_id="p")
    checkpointed = build_local(_config(gradient_checkpointing=True), peer_id="p")
    assert checkpointed.model.is_activation_checkpointing and not plain.model.is_activation_checkpointing
    a, b = plain.trainer.train_steps(2), checkpointed.trainer.train_steps(2)
    # recomputation gives the same loss and the same updated weights (same seed, same data)
    assert a.mean_loss == pytest.approx(b.mean_loss, rel=1e-5)
    for p, q in zip(plain.trainer.parameters(), checkpointed.trainer.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_bf16_weights_are_refused_on_a_cpu_with_the_flag_to_use() -> None:
    with pytest.raises(ValueError, match="--weights-dtype fp32"):
        build_local(_config(weights_dtype="bf16"), peer_id="p")
    with pytest.raises(ValueError, match="weights_dtype"):
        dataclasses.replace(InnerConfig(), weights_dtype="fp16")


def test_pseudo_gradient_of_bf16_weights_is_measured_from_the_rounded_start() -> None:
    anchors = [torch.randn(64, 32), torch.randn(7)]
    start = [a.to(torch.bfloat16) for a in anchors]  # what copy_to leaves in bf16 weights
    assert all(float(d.abs().max()) == 0.0 for d in pseudo_gradient(anchors, start))  # no work, no delta
    moved = [s - 0.5 for s in start]  # the inner steps moved the bf16 weights
    expected = [(s.float() - m.float()) for s, m in zip(start, moved, strict=True)]
    for d, e in zip(pseudo_gradient(anchors, moved), expected, strict=True):
        assert torch.equal(d, e)
    # fp32 weights are unchanged: anchor - current exactly
    current = [a + 1.0 for a in anchors]
    for d, a, c in zip(pseudo_gradient(anchors, current), anchors, current, strict=True):
        assert torch.equal(d, a - c)


def test_the_allocator_setting_is_taken_on_linux_glibc() -> None:
    import platform
    import sys

    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert return_freed_memory() is True


def test_the_threshold_follows_the_device_and_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CUDA step allocates on the GPU: the host keeps the full saving. A CPU step's temporaries stay cheap.
    assert threshold_for("cuda") == DEFAULT_THRESHOLD and threshold_for("cpu") == CPU_THRESHOLD
    assert DEFAULT_THRESHOLD < CPU_THRESHOLD
    assert not set_in_environment({})
    assert set_in_environment({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert set_in_environment({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1:glibc.malloc.mmap_threshold=9"})
    assert not set_in_environment({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert return_freed_memory() is False  # the operator's choice is left as it is


def test_the_heap_is_trimmed_before_the_fork_on_glibc() -> None:
    import platform
    import sys

    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert trim_before_fork() is True
