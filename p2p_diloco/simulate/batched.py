"""Train the k simulated workers of a round together: one vmapped step instead of k model calls.

The workers of a synchronous round all run the same number of inner steps on the same architecture, so
their parameters can live in stacked tensors of shape ``[k, *shape]``. One inner step is then
``torch.func.vmap`` over ``torch.func.functional_call`` of the model with each worker's slice, one
backward pass over the sum of the k losses (worker i's loss depends only on slice i, so each slice gets
exactly its own worker's gradient), the global-norm clip computed per worker, and one AdamW over the
stacked tensors. AdamW is elementwise and all workers step in lockstep (same step count, same schedule),
so it updates every slice exactly as k separate optimizers would.

Each worker's model keeps its ``nn.Parameter`` objects, re-pointed at its slice of the stack, so
everything else the simulator does (pseudo-gradients, the outer step writing the anchors back,
evaluation) reads and writes the stack without knowing it is batched. The numbers agree with the
unbatched path up to float rounding (attention runs through the eager kernel, which vmap can batch).

When it pays off: the k steps become one call with k-times larger matrices, and AdamW runs fused over
about 20 stacked tensors instead of a Python loop over k x 20. On a GPU, where a small model's step is
bound by kernel launches, that divides the time per simulated step by up to k (not measured: no GPU
here). On a CPU the step is bound by the matrix products: on this machine (one thread, tiny preset, k = 4,
batch 4 x 64) the batched step took 1.2-1.3x less CPU time than the unbatched one, 1.5x with
``compile=True``, and no method that keeps the float32 arithmetic can reach 3x there, because the step's
matrix-product FLOPs alone at the core's peak throughput take 1/2.7 of the unbatched step
(``benchmarks/sim_profile.py``, BENCHMARKS.md "Simulator speed").
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence

import torch
from torch.func import functional_call, vmap
from transformers import PreTrainedModel

from p2p_diloco.config import InnerConfig
from p2p_diloco.data.loader import PeerTokenStream
from p2p_diloco.device import autocast, autocast_dtype
from p2p_diloco.inner_stats import InnerStats
from p2p_diloco.trainer import make_adamw, make_scheduler

logger = logging.getLogger(__name__)


class BatchedInnerTrainer:
    """k models of one architecture trained in lockstep as one stacked model.

    Args:
        models: the workers' models (same architecture); their parameters become views of the stack.
        streams: each worker's token stream, in the same order.
        cfg: the inner settings every worker shares (lr schedule, clip, batch and micro-batch).
        compile: run the vmapped forward and backward through ``torch.compile`` (inductor; needs a C++
            compiler on a CPU). Same arithmetic, fused elementwise kernels; the first step pays the
            compilation (about 15-45 s for the tiny preset on this CPU, less with a warm inductor cache).
    """

    def __init__(
        self, models: Sequence[PreTrainedModel], streams: Sequence[PeerTokenStream], cfg: InnerConfig,
        *, compile: bool = False,
    ) -> None:
        if len(models) != len(streams) or not models:
            raise ValueError(f"need one stream per model, got {len(models)} models and {len(streams)} streams")
        self.cfg = cfg
        self.k = len(models)
        self.streams = list(streams)
        named = [dict(m.named_parameters()) for m in models]
        self.names = list(named[0])
        device = named[0][self.names[0]].device
        self.device = device
        with torch.no_grad():
            self.stacked = {
                n: torch.stack([nm[n].detach() for nm in named]).requires_grad_(True) for n in self.names
            }
        for i, nm in enumerate(named):
            for n in self.names:
                nm[n].data = self.stacked[n].data[i]
        # The functional template: a copy whose own weights are never read, with vmap-able attention.
        self.template = copy.deepcopy(models[0])
        self.template.config._attn_implementation = "eager"
        self.template.train()
        self.amp_dtype = autocast_dtype(device, cfg.precision)
        ndims = [named[0][n].ndim for n in self.names]
        # The fused AdamW kernel (CPU and CUDA) updates the ~20 stacked tensors in one pass each: on the
        # tiny preset's k = 4 stack it takes a quarter of the per-tensor loop's time on this CPU.
        self.optimizer = make_adamw([(n, self.stacked[n]) for n in self.names], cfg, ndims=ndims,
                                    fused=device.type in ("cuda", "cpu"))
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.step_count = 0
        self._batched_loss = vmap(self._loss)
        if compile:
            self._batched_loss = torch.compile(self._batched_loss)

    def _loss(self, params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        return functional_call(self.template, params, (), {"input_ids": ids, "labels": ids}).loss

    @torch.no_grad()
    def _clip(self) -> None:
        """``clip_grad_norm_`` per worker: each slice is scaled by its own worker's global norm."""
        grads = [self.stacked[n].grad for n in self.names if self.stacked[n].grad is not None]
        norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), 2, dim=1) for g in grads], dim=1)
        total = torch.linalg.vector_norm(norms, 2, dim=1)
        coef = torch.clamp(self.cfg.grad_clip / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.view(-1, *[1] * (g.ndim - 1)))

    def train_steps(self, n: int) -> list[InnerStats]:
        """``n`` inner steps of every worker; one :class:`InnerStats` per worker."""
        micro = self.cfg.micro_batch
        accum = self.cfg.batch_size // micro
        losses: list[list[float]] = [[] for _ in range(self.k)]
        samples = tokens = 0
        start = time.perf_counter()
        for _ in range(n):
            batch = torch.stack([s.next_batch() for s in self.streams]).to(self.device)
            step_loss = torch.zeros(self.k)
            for chunk in batch.split(micro, dim=1):
                with autocast(self.device, self.amp_dtype):
                    loss = self._batched_loss(self.stacked, chunk)
                (loss.sum() / accum).backward()
                step_loss += loss.detach().float().cpu() / accum
            if not bool(torch.isfinite(step_loss).all()):
                raise FloatingPointError(
                    f"inner loss became {step_loss.tolist()} at step {self.step_count}; lower --inner-lr"
                )
            if self.cfg.grad_clip > 0:
                self._clip()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step_count += 1
            samples += batch.shape[1]
            tokens += batch[0].numel()
            for i in range(self.k):
                losses[i].append(float(step_loss[i]))
        seconds = time.perf_counter() - start
        return [
            InnerStats(n, samples, tokens, seconds, sum(ls) / len(ls) if ls else float("nan"),
                       ls[-1] if ls else float("nan"))
            for ls in losses
        ]
