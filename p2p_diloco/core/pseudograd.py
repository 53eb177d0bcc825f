"""Pseudo-gradients: how far the inner optimizer moved a peer during one outer round.

DiLoCo's outer step treats the displacement of the parameters over a round as a gradient::

    Δ_i = θ(t-1) − θ_i(t)          (anchor minus current: old minus new)

With this sign, feeding Δ to SGD with learning rate 1 and no momentum lands exactly on
``θ_i(t)``, so the outer optimizer "continues" in the direction the inner steps went.

Everything here works in fp32, whatever the model's dtype: pseudo-gradients are small
differences of large numbers, and bf16 would round most of them away.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["all_finite", "check_same_shapes", "pseudo_gradient", "weighted_mean"]


def check_same_shapes(reference: Sequence[Tensor], other: Sequence[Tensor], what: str) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``other`` has the tensor count and shapes of ``reference``."""
    if len(reference) != len(other):
        raise ValueError(f"{what}: expected {len(reference)} tensors, got {len(other)}")
    for index, (ref, tensor) in enumerate(zip(reference, other, strict=True)):
        if ref.shape != tensor.shape:
            raise ValueError(
                f"{what}: tensor {index} has shape {tuple(tensor.shape)}, expected {tuple(ref.shape)}"
            )


@torch.no_grad()
def pseudo_gradient(
    anchor: Sequence[Tensor], current: Sequence[Tensor], out: list[Tensor] | None = None
) -> list[Tensor]:
    """Return ``Δ = anchor − current`` per tensor, in fp32.

    Args:
        anchor: the shared parameters θ(t-1) every peer started the round from (fp32).
        current: the peer's parameters after its inner steps; any floating dtype and device.
        out: optional fp32 buffers, one per tensor, to write into. A long run does this once
            per round on the whole model, so pass the previous round's buffers to avoid
            allocating a model-sized list every round. The result lives on ``out``'s devices
            (on ``anchor``'s devices when ``out`` is None).

    Returns:
        ``out`` (filled) or a new list of fp32 tensors.
    """
    check_same_shapes(anchor, current, "pseudo_gradient(current)")
    if out is None:
        out = [torch.empty(a.shape, dtype=torch.float32, device=a.device) for a in anchor]
    else:
        check_same_shapes(anchor, out, "pseudo_gradient(out)")
        for index, buffer in enumerate(out):
            if buffer.dtype != torch.float32:
                raise ValueError(
                    f"pseudo_gradient(out): buffer {index} is {buffer.dtype}, expected torch.float32"
                )
    for a, c, o in zip(anchor, current, out, strict=True):
        # copy_ converts dtype and device in one pass; the subtraction then runs in place on `o`.
        o.copy_(c.detach())
        start = a.detach()
        if c.dtype != torch.float32 and c.is_floating_point():
            # Low-precision weights (bf16 on a GPU) started the round from the anchor rounded to their dtype:
            # measure from that start, or the rounding itself would be sent as work every round.
            start = start.to(c.dtype)
        torch.sub(start.to(device=o.device, dtype=torch.float32), o, out=o)
    return out


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """True when no tensor holds a NaN or an infinity.

    Check a pseudo-gradient before sending it: one diverged peer would otherwise poison
    every peer's parameters through the average.
    """
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _validated_weights(weights: Sequence[float], count: int) -> list[float]:
    if len(weights) != count:
        raise ValueError(f"weighted_mean: {count} contributions but {len(weights)} weights")
    if count == 0:
        raise ValueError("weighted_mean: no contributions to average")
    checked = []
    for index, weight in enumerate(weights):
        weight = float(weight)
        if not math.isfinite(weight):
            raise ValueError(f"weighted_mean: weight {index} is not finite ({weight})")
        if weight < 0:
            raise ValueError(f"weighted_mean: weight {index} is negative ({weight})")
        checked.append(weight)
    if sum(checked) <= 0:
        raise ValueError("weighted_mean: the weights sum to zero; there is nothing to average")
    return checked


@torch.no_grad()
def weighted_mean(
    deltas: Sequence[Sequence[Tensor]], weights: Sequence[float], out: list[Tensor] | None = None
) -> list[Tensor]:
    """Weighted mean ``Σ_i w_i Δ_i / Σ_i w_i`` of several peers' pseudo-gradients, in fp32.

    Choosing weights: uniform weights reproduce the DiLoCo paper. When peers did unequal
    work (DyLU gives slow peers fewer inner steps), weight by samples or tokens processed
    so that a peer's influence matches the data it actually saw.

    Args:
        deltas: one list of tensors per peer; all lists must have the same shapes.
        weights: one finite, non-negative weight per peer; the sum must be positive.
            Peers with weight 0 are skipped entirely, so a zero-weight entry holding
            NaNs cannot leak into the result.
        out: optional fp32 buffers to write into (see :func:`pseudo_gradient`).

    Raises:
        ValueError: on mismatched counts or shapes, or on invalid weights.
    """
    checked = _validated_weights(weights, len(deltas))
    reference = deltas[0]
    for index, delta in enumerate(deltas[1:], start=1):
        check_same_shapes(reference, delta, f"weighted_mean(contribution {index})")
    total = sum(checked)
    if out is None:
        out = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in reference]
    else:
        check_same_shapes(reference, out, "weighted_mean(out)")
        for index, buffer in enumerate(out):
            if buffer.dtype != torch.float32:
                raise ValueError(
                    f"weighted_mean(out): buffer {index} is {buffer.dtype}, expected torch.float32"
                )
            buffer.zero_()
    for delta, weight in zip(deltas, checked, strict=True):
        if weight == 0.0:
            continue
        coefficient = weight / total
        for o, d in zip(out, delta, strict=True):
            o.add_(d.to(device=o.device, dtype=torch.float32), alpha=coefficient)
    return out
