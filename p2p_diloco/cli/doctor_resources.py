"""The preflight's local checks: device and dtype, memory and disk against what the model needs.

Used by ``run_peer doctor`` (:mod:`p2p_diloco.cli.doctor`); every estimate says what it counts, so that a
volunteer can tell which flag lowers it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from p2p_diloco.cli.doctor_report import Check
from p2p_diloco.cli.open_files import check_open_files
from p2p_diloco.shared_memory import SHM_PATH, shared_bytes, shm_fix, shm_free_bytes

GIB = 2**30

PROCESS_OVERHEAD_BYTES = int(0.65 * GIB)
"""Host memory the processes take besides tensors (interpreter, torch, the DHT and averager processes, the
p2p daemons): a peer of the 0.84M-parameter tiny preset, whole process tree, proportional set size, median
0.61 GiB and peak 0.61 GiB while training in a 2-peer swarm (benchmarks/memory.py, CPU build of torch 2.13)."""

HOST_BYTES_PER_PARAM = 12.0
"""Host bytes per parameter of the swarm side, steady: 11.3 measured while training at the ``150m`` preset
(2-peer swarm and a joiner) and 11.4 at 476M parameters (one peer), whole process tree PSS less the model
side and the runtime (benchmarks/memory.py). It is the anchors (4), the outer momentum (4) and the averager's
shared buffer (4: the pseudo-gradient is written into it; the state is served from the anchors themselves),
all in shared memory. On the CPU the training side (16) comes on top."""

HOST_PEAK_BYTES_PER_PARAM = 16.0
"""Host bytes per parameter of the swarm side at its peak: 15.9 measured on a joiner downloading the state at
the ``150m`` preset (the downloaded parameters and momentum sit beside its own until they are verified and
loaded), and 15.9 at 476M parameters (one peer, at a round's end); at most 14.1 in every other phase."""

GPU_BYTES_PER_PARAM = {"fp32": 16, "bf16": 8}
"""Training-device bytes per parameter by ``--weights-dtype``: weights, gradients and AdamW's two moments, all
in that dtype (fused AdamW on CUDA: no model-sized temporaries)."""




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


def training_bytes(shape: ModelShape, micro_batch: int, seq_len: int, low_precision: bool, *,
                   checkpointing: bool = False, weights_dtype: str = "fp32", fused_attention: bool = False) -> int:
    """What the training device holds: weights, gradients and AdamW's two moments
    (``GPU_BYTES_PER_PARAM``: 16 bytes per parameter in fp32, 8 with ``--weights-dtype bf16``), plus
    activations of one micro-batch.

    Activations follow Korthikanti et al. (2022): per layer ``s*b*h*(34 + 5*a*s/h)`` bytes in 16-bit, twice
    that in fp32, plus the logits and their gradient. It is an upper estimate: fused attention kernels skip
    the ``5*a*s/h`` term (``fused_attention=True`` leaves it out: transformers' SDPA attention on CUDA). With ``--gradient-checkpointing`` only each layer's input (``s*b*h``) is kept, and one
    layer's activations at a time are rebuilt in the backward pass. Lower ``--micro-batch-size`` (gradient
    accumulation keeps the batch) or ``--seq-len`` when it does not fit.
    """
    width = 2 if low_precision or weights_dtype == "bf16" else 4
    attention = 0.0 if fused_attention else 5 * shape.heads * seq_len / shape.hidden
    per_layer = seq_len * micro_batch * shape.hidden * (34 + attention) * width / 2
    if checkpointing:
        activations = shape.layers * seq_len * micro_batch * shape.hidden * width + per_layer
    else:
        activations = shape.layers * per_layer
    logits = 2 * micro_batch * seq_len * shape.vocab * 4
    return int(GPU_BYTES_PER_PARAM[weights_dtype] * shape.parameters + activations + logits)


def host_bytes(parameters: int, *, peak: bool = True) -> int:
    """Host memory the swarm side keeps (fp32, on the CPU even when training runs on a GPU), measured:
    ``HOST_PEAK_BYTES_PER_PARAM`` (or ``HOST_BYTES_PER_PARAM`` steady) plus the process overhead."""
    per_param = HOST_PEAK_BYTES_PER_PARAM if peak else HOST_BYTES_PER_PARAM
    return int(per_param * parameters) + PROCESS_OVERHEAD_BYTES


def gpu_options(shape: ModelShape, micro_batch: int, seq_len: int, low_precision: bool, free: int
                ) -> list[tuple[str, int]]:
    """The memory options in the order to try them, each as (flags, bytes needed), first the ones that fit:
    gradient checkpointing costs compute only, bf16 weights cost precision."""
    options = []
    for flags, checkpointing, dtype in (("--gradient-checkpointing", True, "fp32"),
                                        ("--weights-dtype bf16", False, "bf16"),
                                        ("--gradient-checkpointing --weights-dtype bf16", True, "bf16")):
        need = training_bytes(shape, micro_batch, seq_len, low_precision, checkpointing=checkpointing,
                              weights_dtype=dtype)
        options.append((flags, need))
    return sorted(options, key=lambda o: o[1] > free)


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
    train = training_bytes(shape, cfg.inner.micro_batch, cfg.model.seq_len, low,
                           checkpointing=cfg.inner.gradient_checkpointing, weights_dtype=cfg.inner.weights_dtype)
    host = host_bytes(shape.parameters) + (train if device.type != "cuda" else 0)
    available = psutil.virtual_memory().available
    checks.append(_fits("memory", host, available,
                        f"host RAM (swarm side {HOST_PEAK_BYTES_PER_PARAM:.0f} bytes/parameter at its peak"
                        + (", training side on the CPU too" if device.type != "cuda" else "") + ")",
                        "close other programs, or pick a smaller --model (the swarm side's host memory grows "
                        "with the parameters only)"))
    free_shm = shm_free_bytes()
    if free_shm is not None:  # a full /dev/shm kills the peer with SIGBUS (Docker's default is 64 MiB)
        # a CPU peer's weights, and the host copy rank 0 of an FSDP2 node keeps (peer/node_model.py), are shared
        host_weights = device.type == "cpu" or cfg.node.parallel == "fsdp2"
        need = shared_bytes(shape.parameters, weights_on_cpu=host_weights, peak=True)
        checks.append(_fits("shared memory", need, free_shm, f"free in {SHM_PATH}", shm_fix(need)))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        fix = ("lower --micro-batch-size (the batch is kept by accumulation) or --seq-len, or free the GPU "
               "(nvidia-smi shows who holds it)")
        if train > free:
            best = gpu_options(shape, cfg.inner.micro_batch, cfg.model.seq_len, low, free)[0]
            if best[1] <= free:
                fix = f"it fits with {best[0]} (about {best[1] / GIB:.2f} GiB); or " + fix
        checks.append(_fits("gpu memory", train, free, f"free on {device}", fix))
    checks.append(_check_disk(cfg, checkpoint_bytes(shape.parameters, cfg.outer.momentum)))
    checks.append(check_open_files())
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
