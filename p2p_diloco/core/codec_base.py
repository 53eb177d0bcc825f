"""The codec interface (:class:`Codec`) and the helpers every codec shares; the codecs themselves live in
:mod:`p2p_diloco.core.codecs` (dense) and :mod:`p2p_diloco.core.sparse`."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

__all__ = ["Buffer", "Codec", "fit_two_levels"]

Buffer = bytes | bytearray | memoryview


def _as_bytes_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 0:
            raise ValueError(f"invalid shape {tuple(shape)}: dimensions must be integers >= 0")
        numel *= int(dim)
    if math.prod(max(int(dim), 1) for dim in shape) >= 2**62:  # torch cannot even compute such a shape's strides
        raise ValueError(f"invalid shape {tuple(shape)[:8]}: dimensions too large")
    return numel


def _flat_fp32(t: Tensor) -> Tensor:
    if not torch.is_floating_point(t):
        raise ValueError(f"codecs encode floating-point tensors, got {t.dtype}")
    flat = t.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("refusing to encode a tensor with NaN or infinite values")
    return flat


class Codec(ABC):
    """Turns an fp32 tensor into bytes and back. Stateless and thread-safe."""

    name: ClassVar[str]

    @abstractmethod
    def encoded_nbytes(self, numel: int) -> int:
        """The exact length of ``encode`` output for a tensor of ``numel`` values."""

    @abstractmethod
    def encode(self, t: Tensor) -> bytes:
        """Encode any floating tensor (any device); raises ValueError on NaN or infinity."""

    @abstractmethod
    def _decode_flat(self, view: memoryview, numel: int) -> Tensor:
        """Decode exactly ``encoded_nbytes(numel)`` validated-length bytes to a flat fp32 tensor."""

    def decode(self, data: Buffer, shape: Sequence[int]) -> Tensor:
        """Rebuild an fp32 CPU tensor of ``shape``; raises ValueError on malformed data."""
        numel = _numel(shape)
        view = _as_bytes_view(data)
        expected = self.encoded_nbytes(numel)
        if len(view) != expected:
            raise ValueError(
                f"{self.name} data for shape {tuple(shape)} must be {expected} bytes, got {len(view)}"
            )
        return self._decode_flat(view, numel).reshape(tuple(int(d) for d in shape))

    def bits_per_value(self, numel: int | None = None) -> float:
        """Wire bits per value; without ``numel``, the large-tensor limit."""
        if numel is None:
            numel = 1 << 24
        return 8.0 * self.encoded_nbytes(numel) / max(numel, 1)

    def part_bits_per_value(self) -> float:
        """The bits per value the all-reduce sizes its parts by (``core.robust.part_size_values``): the
        wire's, except for the sparse codecs (see ``core.sparse.TopKCodec.part_bits_per_value``)."""
        return self.bits_per_value()

    def roundtrip(self, t: Tensor) -> Tensor:
        """``decode(encode(t))``: what a receiver will see."""
        return self.decode(self.encode(t), t.shape)

    def selection_norm(self, t: Tensor) -> float:
        """A norm of ``t`` that bounds what this codec sends of it: ``|roundtrip(t)| <= gain * selection_norm(t)``
        with the codec's ``core.bounds.CODEC_NORM_GAIN``. It obeys the triangle inequality, so a sender with error
        feedback bounds ``|roundtrip(values + residual)|`` by ``gain * (|values| + selection_norm(residual))``.
        Dense codecs send every value: the L2 norm (float64). Sparse codecs measure only what they can select
        (``core.sparse.TopKCodec.selection_norm``)."""
        return float(torch.linalg.vector_norm(t.detach().to(device="cpu", dtype=torch.float64)))

    @property
    def reply_codec(self) -> Codec:
        """The codec a reducer sends its aggregate back with: the same one, except for the sparse codecs,
        whose aggregate goes back as its own top-k (``core.sparse.TopKCodec.reply_codec``)."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


LLOYD_ITERATIONS = 3
"""Lloyd iterations of :func:`fit_two_levels`: the levels move little after three (``core.sparse``)."""


def fit_two_levels(magnitude: Tensor, member: Tensor, threshold: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Two levels per row for the magnitudes where ``member`` is set, by ``LLOYD_ITERATIONS`` Lloyd iterations
    from ``threshold`` (one per row): a magnitude above the threshold takes the high level, each level is the
    mean of its group, and the threshold moves midway between them. Returns (low, high, whether each value takes
    the high level). Each level being its group's mean, a row never comes back longer (L2) than it went; an
    empty group takes the other's level, so the pair stays ordered and finite. Used by ``2bit`` (every value of
    a block) and ``topk`` (a chunk's kept values)."""
    high = member
    lo = hi = threshold
    for _ in range(LLOYD_ITERATIONS):
        high = member & (magnitude > threshold[:, None])
        low = member & ~high
        n_high, n_low = high.sum(dim=1), low.sum(dim=1)
        hi = (magnitude * high).sum(dim=1) / n_high.clamp(min=1)
        lo = (magnitude * low).sum(dim=1) / n_low.clamp(min=1)
        hi = torch.where(n_high > 0, hi, lo)
        lo = torch.where(n_low > 0, lo, hi)
        threshold = (lo + hi) / 2
    return lo, hi, high
