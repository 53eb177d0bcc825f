"""The inner training loop: plain PyTorch AdamW steps on one peer's data.

The swarm never owns this loop. Between rounds the algorithm core reads the model's parameters through
:meth:`InnerTrainer.parameters` (the live tensors, no copies) and writes the new outer parameters back
in place with :meth:`InnerTrainer.load_parameters`. AdamW's state stays local to the peer, as in the
DiLoCo paper: averaging it did not help and would triple the traffic.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from transformers import PreTrainedModel
from transformers.optimization import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
)

from p2p_diloco.config import InnerConfig
from p2p_diloco.device import autocast, autocast_dtype, select_device
from p2p_diloco.inner_stats import InnerStats

logger = logging.getLogger(__name__)


def make_adamw(
    named_params: Sequence[tuple[str, torch.Tensor]], cfg: InnerConfig, *, fused: bool = False,
    ndims: Sequence[int] | None = None,
) -> torch.optim.AdamW:
    """The inner AdamW: betas (0.9, 0.95), decoupled weight decay on matrices only.

    ``ndims`` gives each parameter's own rank when the tensors carry an extra leading dimension (the
    simulator's stacked workers), so the decay groups are the same as for one model.
    """
    decay, no_decay = [], []
    for index, (name, p) in enumerate(named_params):
        ndim = p.ndim if ndims is None else ndims[index]
        # Norm gains and biases are not decayed: shrinking them towards zero only hurts.
        (no_decay if ndim < 2 or "norm" in name else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        fused=fused,
    )


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: InnerConfig,
                   last_step: int = -1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` over ``total_steps`` (constant when 0),
    positioned after inner step ``last_step`` (-1: before the first; otherwise the optimizer must already
    have had a schedule, which records each group's ``initial_lr``).

    The schedule runs over the peer's whole training, not one round: the step count carries across
    rounds, so warmup happens once and the cosine never restarts.
    """
    if cfg.total_steps > 0:
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, cfg.warmup_steps, max(cfg.total_steps, cfg.warmup_steps + 1), min_lr_rate=cfg.min_lr_ratio,
            last_epoch=last_step,
        )
    return get_constant_schedule_with_warmup(optimizer, cfg.warmup_steps, last_epoch=last_step)


def place_model(model: torch.nn.Module, cfg: InnerConfig) -> torch.device:
    """Move ``model`` to the training device of ``cfg`` (and to bf16 there with ``weights_dtype="bf16"``), in
    place: its Parameter objects stay the same, so a session already holding them follows. Returns the device;
    ``ValueError`` names a device this machine lacks.

    ``run_peer`` calls it before the swarm's processes are forked, not only the trainer: a CPU copy of the
    weights alive at the fork would stay in each forked process after the move (see
    ``SwarmSession.start``)."""
    device = select_device(cfg.device)
    if cfg.weights_dtype == "bf16":
        if device.type != "cuda":
            raise ValueError("weights_dtype: bf16 weights need a CUDA device; use --weights-dtype fp32 here")
        # the same Parameter objects, now bf16 on the GPU: the session's anchors stay fp32 on the host
        model.to(device, dtype=torch.bfloat16)
    else:
        model.to(device)
    return device


class InnerTrainer:
    """AdamW with warmup + cosine decay, gradient accumulation, clipping and bf16 autocast on CUDA."""

    def __init__(self, model: PreTrainedModel, cfg: InnerConfig, batches: Iterable[torch.Tensor]) -> None:
        self.cfg = cfg
        self.device = place_model(model, cfg)
        self.amp_dtype = autocast_dtype(self.device, cfg.precision)
        self.model = model
        if cfg.gradient_checkpointing:
            # non-reentrant: works with inputs that need no grad and is what torch recommends. transformers 5
            # names it activation checkpointing (the gradient_ name is its deprecated alias).
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.config.use_cache = False
        self.model.train()
        self._batches = iter(batches)
        self.optimizer = make_adamw(list(self.model.named_parameters()), cfg, fused=self.device.type == "cuda")
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.step_count = 0

    def resume_at(self, step: int) -> None:
        """Continue at inner step ``step`` (``--resume``): the learning rate is the schedule's at that step.
        Optimizer moments start fresh (they are not checkpointed).

        The schedule is rebuilt at that position rather than stepped ``step`` times: stepping it before any
        optimizer step is what torch warns about ("lr_scheduler.step() before optimizer.step()").
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.step_count = step
        if step > 0:
            self.scheduler = make_scheduler(self.optimizer, self.cfg, last_step=step - 1)

    def parameters(self) -> list[torch.Tensor]:
        """The model's live parameter tensors, in a fixed order shared by every peer of the run."""
        return [p for p in self.model.parameters()]

    @torch.no_grad()
    def load_parameters(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite the model's parameters in place (after an outer step or a state download)."""
        params = self.parameters()
        if len(params) != len(tensors):
            raise ValueError(f"expected {len(params)} tensors, got {len(tensors)}")
        for p, t in zip(params, tensors, strict=True):
            if p.shape != t.shape:
                raise ValueError(f"shape mismatch: parameter {tuple(p.shape)} vs tensor {tuple(t.shape)}")
            p.copy_(t, non_blocking=True)

    def train_steps(self, n: int, on_step: Callable[[int, float], None] | None = None) -> InnerStats:
        """Run ``n`` optimizer steps; ``on_step(step_in_phase, loss)`` is called after each (for progress)."""
        micro = self.cfg.micro_batch
        accum = self.cfg.batch_size // micro
        losses: list[float] = []
        samples = tokens = 0
        start = time.perf_counter()
        for i in range(n):
            batch = next(self._batches).to(self.device, non_blocking=True)
            step_loss = 0.0
            chunks = batch.split(micro)
            for j, chunk in enumerate(chunks):
                with self._grad_sync(last=j == len(chunks) - 1):
                    with autocast(self.device, self.amp_dtype):
                        loss = self.model(input_ids=chunk, labels=chunk).loss
                    (loss / accum).backward()
                step_loss += loss.item() / accum
            if not math.isfinite(step_loss):
                raise FloatingPointError(
                    f"inner loss became {step_loss} at step {self.step_count}; lower --inner-lr or check the data"
                )
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step_count += 1
            samples += batch.shape[0]
            tokens += batch.numel()
            losses.append(step_loss)
            if on_step is not None:
                on_step(i + 1, step_loss)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        mean = sum(losses) / len(losses) if losses else float("nan")
        return InnerStats(n, samples, tokens, seconds, mean, losses[-1] if losses else float("nan"))

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Data-parallel models (a multi-GPU node) average gradients on the last micro-batch only: DDP's
        ``no_sync`` before it, FSDP2's ``set_requires_gradient_sync``. A plain model: nothing to do."""
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(last)
        elif hasattr(self.model, "no_sync") and not last:  # DDP
            return self.model.no_sync()
        return contextlib.nullcontext()

    def evaluate(self, batches: Sequence[torch.Tensor]) -> float:
        """Mean token loss over ``batches`` of the held-out split."""
        return evaluate_model(self.model, batches, self.device, self.amp_dtype)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


@torch.no_grad()
def evaluate_model(
    model: PreTrainedModel, batches: Sequence[torch.Tensor], device: torch.device, amp_dtype: torch.dtype | None
) -> float:
    """Mean token loss of ``model`` over ``batches`` (NaN for none: evaluation is off); restores training
    mode afterwards."""
    if not batches:
        return float("nan")
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for batch in batches:
            batch = batch.to(device)
            with autocast(device, amp_dtype):
                total += model(input_ids=batch, labels=batch).loss.item()
        return total / max(1, len(batches))
    finally:
        model.train(was_training)
