"""The preflight's local checks: device and dtype, memory and disk against what the model needs.

Used by ``run_peer doctor`` (:mod:`p2p_diloco.cli.doctor`); every estimate says what it counts, so that a
volunteer can tell which flag lowers it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from p2p_diloco.cli.doctor_report import Check

GIB = 2**30

PROCESS_OVERHEAD_BYTES = 1 * GIB
"""Host memory the processes take besides tensors (interpreter, torch, the DHT and averager processes, the
p2p daemons). A peer training the 0.84M-parameter tiny preset peaked at 0.72 GiB proportional set size, all
its processes together (Linux, CPU build of torch 2.13); 1 GiB rounds that up."""




def check_device(device_name: str, precision: str) -> tuple[Check, object | None]:
    """The device and autocast dtype, as the trainer will pick them; returns the torch device too."""
    import torch

    from p2p_diloco.device import autocast_dtype, select_device

    try:
        device = select_device(device_name)
        dtype = autocast_dtype(device, precision)
    except ValueError as e:
        return Check("device", "fail", str(e)), None
    compute = "bf16 autocast over fp32 weights" if dtype is not None else "fp32"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        return Check("device", "ok", f"{device} ({name}, torch {torch.__version__}), {compute}"), device
    detail = f"{device}, {compute} (torch {torch.__version__})"
    if shutil.which("nvidia-smi") and torch.version.cuda is None:
        return Check("device", "warn", f"{detail}; this machine has an NVIDIA driver but torch is a CPU build",
                     "install the CUDA build of torch: TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 "
                     "bash scripts/setup.sh (after removing .venv)"), device
    return Check("device", "ok", detail), device


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    layers: int
    hidden: int
    heads: int
    vocab: int


def model_shape(model: str, tokenizer: str | None, seq_len: int) -> ModelShape:
    """Parameter count and dimensions, from a model built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    from p2p_diloco.data.tokenizer import load_tokenizer
    from p2p_diloco.models import PRESETS, count_parameters, preset_config

    if model in PRESETS:
        vocab = load_tokenizer(tokenizer, model, tuple(PRESETS)).vocab_size
        config = preset_config(model, vocab, seq_len)
        with torch.device("meta"):
            built = LlamaForCausalLM(config)
    else:
        config = AutoConfig.from_pretrained(model)
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(config)
    text = getattr(config, "get_text_config", lambda: config)()
    return ModelShape(count_parameters(built), int(getattr(text, "num_hidden_layers", 1)),
                      int(getattr(text, "hidden_size", 1)), int(getattr(text, "num_attention_heads", 1)),
                      int(getattr(text, "vocab_size", 1)))


def model_fingerprint_of(cfg) -> str | None:
    """The architecture fingerprint ``run_peer`` would publish, for presets (built on the meta device).

    ``None`` for a Hugging Face model: its fingerprint depends on the loaded weights' dtypes and on
    embedding resizing, which only loading it would tell.
    """
    import torch
    from transformers import LlamaForCausalLM

    from p2p_diloco.data.tokenizer import load_tokenizer
    from p2p_diloco.models import PRESETS, model_fingerprint, preset_config

    if cfg.model.model not in PRESETS:
        return None
    vocab = load_tokenizer(cfg.data.tokenizer, cfg.model.model, tuple(PRESETS)).vocab_size
    with torch.device("meta"):
        model = LlamaForCausalLM(preset_config(cfg.model.model, vocab, cfg.model.seq_len))
    return model_fingerprint(model, cfg.model.model)


def training_bytes(shape: ModelShape, micro_batch: int, seq_len: int, low_precision: bool) -> int:
    """What the training device holds: fp32 weights, gradients and AdamW's two moments (16 bytes per
    parameter), plus activations of one micro-batch.

    Activations follow Korthikanti et al. (2022): per layer ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit, twice
    that in fp32, plus the logits and their gradient. It is an upper estimate: fused attention kernels skip
    the ``5*a*s/h`` term. Lower ``--micro-batch-size`` (gradient accumulation keeps the batch) or
    ``--seq-len`` when it does not fit.
    """
    width = 2 if low_precision else 4
    per_layer = seq_len * micro_batch * shape.hidden * (34 + 5 * shape.heads * seq_len / shape.hidden)
    activations = shape.layers * per_layer * width / 2
    logits = 2 * micro_batch * seq_len * shape.vocab * 4
    return int(16 * shape.parameters + activations + logits)


def host_bytes(parameters: int) -> int:
    """Host memory the swarm side keeps (all fp32, on the CPU even when training runs on a GPU): anchors,
    outer momentum, the averager's buffer and at most one late pseudo-gradient, plus process overhead."""
    return 16 * parameters + PROCESS_OVERHEAD_BYTES


def checkpoint_bytes(parameters: int, momentum: float) -> int:
    """One checkpoint: fp32 anchors, plus the outer momentum when momentum is used."""
    return 4 * parameters * (2 if momentum > 0 else 1)


def check_resources(cfg, device) -> list[Check]:
    """Memory on the training device and the host, and disk for checkpoints, against the model's needs."""
    import psutil
    import torch

    try:
        shape = model_shape(cfg.model.model, cfg.data.tokenizer, cfg.model.seq_len)
    except Exception as e:  # a hub id that cannot be resolved offline, a bad local folder, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [Check("model", "fail", f"cannot read the configuration of model {cfg.model.model!r}: {first}",
                      "use a preset (tiny, mini, small, 150m), a local folder with config.json, or a hub id while "
                      "online")]
    checks = [Check("model", "ok", f"{cfg.model.model}: {shape.parameters:,} parameters")]
    if device is None:
        return checks
    from p2p_diloco.device import autocast_dtype

    low = autocast_dtype(device, cfg.inner.precision) is not None
    train = training_bytes(shape, cfg.inner.micro_batch, cfg.model.seq_len, low)
    host = host_bytes(shape.parameters) + (train if device.type != "cuda" else 0)
    available = psutil.virtual_memory().available
    checks.append(_fits("memory", host, available, "host RAM",
                        "close other programs, lower --micro-batch-size or --seq-len, or pick a smaller --model"))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        checks.append(_fits("gpu memory", train, free, f"free on {device}",
                            "lower --micro-batch-size (the batch is kept by accumulation) or --seq-len, or "
                            "free the GPU (nvidia-smi shows who holds it)"))
    checks.append(_check_disk(cfg, checkpoint_bytes(shape.parameters, cfg.outer.momentum)))
    return checks


def _fits(name: str, need: int, have: int, where: str, fix: str) -> Check:
    detail = f"needs about {need / GIB:.2f} GiB, {have / GIB:.2f} GiB {where}"
    if have < need:
        return Check(name, "fail", detail, fix)
    if have < 1.25 * need:
        return Check(name, "warn", detail + " (little headroom)", fix)
    return Check(name, "ok", detail)


def _check_disk(cfg, one: int) -> Check:
    if not cfg.run.checkpoint_dir:
        return Check("disk", "ok", f"no --checkpoint-dir: nothing is saved (one checkpoint would be "
                                   f"{one / 2**20:.1f} MiB); pass one to be able to stop and --resume")
    # the newest checkpoint is written completely before the oldest is deleted
    need = (cfg.run.keep_checkpoints + 1) * one
    path = os.path.abspath(cfg.run.checkpoint_dir)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK):
        return Check("disk", "fail", f"{existing} is not writable, so checkpoints cannot go to {path}",
                     "choose a --checkpoint-dir you can write to")
    free = shutil.disk_usage(existing).free
    return _fits("disk", need, free, f"free under {existing} ({cfg.run.keep_checkpoints} checkpoints kept, "
                                     f"{one / 2**20:.1f} MiB each)",
                 "free disk space, lower --keep-checkpoints, or choose another --checkpoint-dir")
