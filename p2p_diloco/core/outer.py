"""The outer optimizer: how the averaged pseudo-gradient moves the shared parameters.

The outer optimizer owns the *anchors*: fp32 copies of the shared parameters θ(t) that every
peer starts a round from. They are kept apart from the model's own parameters because the
model drifts during the inner steps (and may be bf16), while θ(t) must stay exact until the
round's average arrives.

The update is ``torch.optim.SGD`` with Nesterov momentum, no dampening and no weight decay,
which in PyTorch's convention reads::

    m ← μ·m + Δ
    θ ← θ − η·(Δ + μ·m)

Choosing lr (η) and momentum (μ) (details and measurements: peers/README.md, "Round length, outer lr and momentum"):

* ``η = 0.7, μ = 0.9`` (the DiLoCo paper, H = 500, hundreds of rounds) is the default and was
  robust across the paper's grid; decaying the outer lr did not help there.
* ``η = 1, μ = 0`` is FedAvg: θ(t) becomes the plain average of the peers' models. The paper
  found it clearly worse than Nesterov at H = 500; it has no state.
* When consecutive pseudo-gradients agree, the step moves θ by up to about η/(1−μ) times Δ.
  At small H (tens of steps) they agree strongly, so keep η/(1−μ) near 1: at H = 20, k = 4,
  10 rounds, the paper's values (η/(1−μ) = 7) ended 10% worse than FedAvg, the best there.
  ``python -m p2p_diloco.simulate sweep`` finds the values for a given H and k.
* Keep μ below 1; values above 0.9 amplify stale or noisy rounds for a long time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "MOMENTUM_KEY_PREFIX",
    "OuterOptimizer",
    "build_outer_optimizer",
    "fedavg_outer_optimizer",
    "make_anchors",
    "nesterov_outer_optimizer",
]

logger = logging.getLogger(__name__)

MOMENTUM_KEY_PREFIX = "outer.momentum."


def make_anchors(params: Iterable[Tensor], device: torch.device | str | None = None) -> list[Tensor]:
    """Detached fp32 copies of ``params`` to serve as the outer optimizer's anchors.

    ``device=None`` keeps each copy on its parameter's device. Pass ``"cpu"`` to keep the
    anchors (and the momentum, which has the same size) off a GPU that is short of memory;
    the outer step then runs on the CPU once per round, which is cheap next to H inner steps.
    """
    return [p.detach().to(device=device or p.device, dtype=torch.float32, copy=True) for p in params]


class OuterOptimizer:
    """SGD (optionally Nesterov) over a list of fp32 anchor tensors.

    Args:
        anchors: the fp32 outer parameters, updated in place by every step. Build them with
            :func:`make_anchors`.
        lr: outer learning rate η, finite and > 0.
        momentum: μ in [0, 1). With μ > 0 the step uses Nesterov momentum; with μ = 0 it is
            plain SGD (FedAvg when η = 1).
    """

    def __init__(self, anchors: Sequence[Tensor], lr: float, momentum: float = 0.0) -> None:
        anchors = list(anchors)
        if not anchors:
            raise ValueError("OuterOptimizer needs at least one anchor tensor")
        for index, anchor in enumerate(anchors):
            if anchor.dtype != torch.float32:
                raise ValueError(f"anchor {index} is {anchor.dtype}; anchors must be torch.float32")
            if anchor.requires_grad:
                raise ValueError(f"anchor {index} requires grad; build anchors with make_anchors()")
        _check_lr(lr)
        if not (math.isfinite(momentum) and 0.0 <= momentum < 1.0):
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        self._anchors = anchors
        self._momentum = float(momentum)
        # foreach=False: the multi-tensor Nesterov path adds the momentum into .grad in place,
        # which would silently modify the caller's pseudo-gradient tensors.
        self._sgd = torch.optim.SGD(
            anchors,
            lr=lr,
            momentum=self._momentum,
            dampening=0.0,
            weight_decay=0.0,
            nesterov=self._momentum > 0.0,
            foreach=False,
        )

    @property
    def anchors(self) -> list[Tensor]:
        """The outer parameters θ, updated in place."""
        return self._anchors

    @property
    def lr(self) -> float:
        return float(self._sgd.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        _check_lr(value)
        self._sgd.param_groups[0]["lr"] = float(value)

    @property
    def momentum(self) -> float:
        return self._momentum

    def _checked(self, delta: Sequence[Tensor], what: str) -> list[Tensor]:
        if len(delta) != len(self._anchors):
            raise ValueError(f"{what}: expected {len(self._anchors)} tensors, got {len(delta)}")
        converted = []
        for index, (anchor, d) in enumerate(zip(self._anchors, delta, strict=True)):
            if d.shape != anchor.shape:
                raise ValueError(
                    f"{what}: tensor {index} has shape {tuple(d.shape)}, expected {tuple(anchor.shape)}"
                )
            converted.append(d.detach().to(device=anchor.device, dtype=torch.float32))
        return converted

    @torch.no_grad()
    def step(self, delta: Sequence[Tensor]) -> None:
        """One outer step with ``delta`` used as the gradient; momentum is updated."""
        grads = self._checked(delta, "OuterOptimizer.step")
        for anchor, grad in zip(self._anchors, grads, strict=True):
            anchor.grad = grad
        try:
            self._sgd.step()
        finally:
            for anchor in self._anchors:
                anchor.grad = None

    @torch.no_grad()
    def apply_momentum_free(self, delta: Sequence[Tensor], scale: float = 1.0) -> None:
        """``θ ← θ − η·scale·delta`` without reading or updating the momentum.

        This is the non-momentum term of Delayed Nesterov: work that should move the
        parameters once but must not keep echoing through the momentum (stale pseudo-gradients).
        """
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
        updates = self._checked(delta, "OuterOptimizer.apply_momentum_free")
        alpha = -self.lr * float(scale)
        for anchor, update in zip(self._anchors, updates, strict=True):
            anchor.add_(update, alpha=alpha)

    def momentum_buffers(self) -> list[Tensor | None]:
        """The live momentum buffers (None before the first step or when μ = 0)."""
        return [self._sgd.state.get(a, {}).get("momentum_buffer") for a in self._anchors]

    def reset_momentum(self) -> None:
        """Forget the momentum, e.g. after the anchors were replaced by a downloaded state."""
        self._sgd.state.clear()

    def state_tensors(self) -> dict[str, Tensor]:
        """Snapshot of the momentum as ``{"outer.momentum.{i}": tensor}`` on the CPU.

        The tensors are copies, safe to hand to ``safetensors.torch.save_file`` while training
        continues. Empty before the first step and for μ = 0.
        """
        state = {}
        for index, buffer in enumerate(self.momentum_buffers()):
            if buffer is not None:
                state[f"{MOMENTUM_KEY_PREFIX}{index}"] = buffer.detach().to("cpu", copy=True).contiguous()
        return state

    @torch.no_grad()
    def load_state_tensors(self, tensors: Mapping[str, Tensor], *, validate_only: bool = False,
                           take: bool = False) -> None:
        """Restore the momentum from :meth:`state_tensors` output (e.g. ``safetensors`` ``load_file``).

        Keys not starting with ``outer.momentum.`` are ignored, so a checkpoint that also holds
        the model can be passed whole. The momentum keys must be either absent (the momentum
        is reset) or exactly one per anchor, each fp32, of the anchor's shape and finite.
        Nothing is changed when validation fails; ``validate_only`` checks and changes nothing. Existing
        momentum buffers are overwritten in place (no second model-sized allocation during a resync);
        ``take=True`` adopts the given tensors as the buffers where there are none yet (the caller hands them
        over, e.g. a verified download, instead of keeping both).

        Raises:
            ValueError: on missing, unknown, misshapen, non-fp32 or non-finite entries, or on
                momentum given to an optimizer with μ = 0.
        """
        loaded: dict[int, Tensor] = {}
        for key, tensor in tensors.items():
            if not key.startswith(MOMENTUM_KEY_PREFIX):
                continue
            suffix = key[len(MOMENTUM_KEY_PREFIX) :]
            if not suffix.isdigit() or int(suffix) >= len(self._anchors):
                raise ValueError(f"unexpected outer state key {key!r} for {len(self._anchors)} anchors")
            index = int(suffix)
            anchor = self._anchors[index]
            if not isinstance(tensor, Tensor):
                raise ValueError(f"{key}: expected a tensor, got {type(tensor).__name__}")
            if tensor.dtype != torch.float32:
                raise ValueError(f"{key}: dtype {tensor.dtype}, expected torch.float32")
            if tensor.shape != anchor.shape:
                raise ValueError(f"{key}: shape {tuple(tensor.shape)}, expected {tuple(anchor.shape)}")
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{key}: holds NaN or infinite values")
            loaded[index] = tensor
        if not loaded:
            if not validate_only:
                self.reset_momentum()
            return
        if self._momentum == 0.0:
            raise ValueError("momentum state given to an outer optimizer without momentum (momentum=0)")
        missing = sorted(set(range(len(self._anchors))) - set(loaded))
        if missing:
            raise ValueError(
                f"outer state lacks momentum for anchors {missing[:8]}{'...' if len(missing) > 8 else ''}"
            )
        if validate_only:
            return
        kept = self.momentum_buffers()
        self._sgd.state.clear()
        for index, anchor in enumerate(self._anchors):
            buffer = kept[index]
            if buffer is not None and buffer.data_ptr() != loaded[index].data_ptr():
                buffer.copy_(loaded[index])
            elif buffer is None:
                buffer = loaded[index].to(device=anchor.device, copy=not take)
            self._sgd.state[anchor]["momentum_buffer"] = buffer
        logger.debug("loaded outer momentum for %d anchors", len(self._anchors))

    @torch.no_grad()
    def copy_to(self, params: Sequence[Tensor]) -> None:
        """Write the anchors into the model's parameters (casting to their dtype and device)."""
        if len(params) != len(self._anchors):
            raise ValueError(f"copy_to: expected {len(self._anchors)} parameters, got {len(params)}")
        for index, (param, anchor) in enumerate(zip(params, self._anchors, strict=True)):
            if param.shape != anchor.shape:
                raise ValueError(f"copy_to: parameter {index} has shape {tuple(param.shape)}")
            param.copy_(anchor)


def _check_lr(lr: float) -> None:
    if not (math.isfinite(lr) and lr > 0.0):
        raise ValueError(f"outer lr must be finite and > 0, got {lr}")


def nesterov_outer_optimizer(
    anchors: Sequence[Tensor], lr: float = 0.7, momentum: float = 0.9
) -> OuterOptimizer:
    """DiLoCo's outer optimizer: Nesterov SGD with the paper's lr 0.7 and momentum 0.9."""
    if momentum <= 0.0:
        raise ValueError("Nesterov needs momentum > 0; use fedavg_outer_optimizer for plain averaging")
    return OuterOptimizer(anchors, lr=lr, momentum=momentum)


def fedavg_outer_optimizer(anchors: Sequence[Tensor]) -> OuterOptimizer:
    """FedAvg: lr 1, no momentum, so θ(t) is exactly the average of the peers' models."""
    return OuterOptimizer(anchors, lr=1.0, momentum=0.0)


def build_outer_optimizer(
    kind: str, anchors: Sequence[Tensor], lr: float | None = None, momentum: float | None = None
) -> OuterOptimizer:
    """Build an outer optimizer by name: ``"nesterov"`` or ``"fedavg"``.

    ``lr``/``momentum`` override the defaults of the chosen kind; FedAvg accepts an ``lr``
    override (plain SGD) but no momentum.
    """
    if kind == "nesterov":
        return nesterov_outer_optimizer(
            anchors, lr=0.7 if lr is None else lr, momentum=0.9 if momentum is None else momentum
        )
    if kind == "fedavg":
        if momentum not in (None, 0.0):
            raise ValueError("fedavg has no momentum; use kind='nesterov' for momentum")
        return OuterOptimizer(anchors, lr=1.0 if lr is None else lr, momentum=0.0)
    raise ValueError(f"unknown outer optimizer {kind!r}; choose 'nesterov' or 'fedavg'")
