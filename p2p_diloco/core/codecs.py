"""Pseudo-gradient codecs: how many bits each value costs on the wire.

Five dense codecs here, and two sparse ones (``topk``, ``topk-sign``: chunked top-k at 2 or 1 bits per kept
value, 1/140 and 1/153 of fp32 at 64 of 4096) in :mod:`p2p_diloco.core.sparse`; all chosen by name with
:func:`get_codec`:

========  =========================================  ===============================
name      format                                     bits/value (block 128)
========  =========================================  ===============================
``none``  fp32                                       32
``fp16``  fp16, clamped to ±65504                    16
``int8``  int8 in [-127, 127] × per-block scale      8 + 16/128 = 8.125
``4bit``  E3M0 4-bit float × per-block scale         4 + 16/128 = 4.125 (≈ 1/7.76 of fp32)
``2bit``  sign + low/high level, two levels/block    2 + 32/128 = 2.25 (≈ 1/14.2 of fp32)
========  =========================================  ===============================

Choosing a codec: fp16 is lossless in practice for pseudo-gradients (OpenDiLoCo); int8 was
used by INTELLECT-1 with no reported loss; 4-bit halves int8 again and matched full
precision in Streaming DiLoCo when accumulated in fp32. Prefer ``int8`` or ``4bit`` on home
links, and wrap a lossy codec in :class:`ErrorFeedback` when the same tensor is sent every
round, so what one round loses is sent the next. ``2bit`` (MuLoCo's setting) is for error
feedback only: every value is sent at one of two magnitudes, so without a residual its rounding
(relative RMS error 0.34 on Gaussian data at block 128) is lost every round.

Design decisions:

* **Block scales in bf16, rounded up.** A pseudo-gradient's block maximum can be 1e-4 or
  smaller, so ``absmax/127`` falls in fp16's subnormal range where only a few bits of the
  scale survive. bf16 has fp32's exponent range; rounding the scale *up* to a bf16 value
  keeps every ``|x|/scale`` within the code range, and since the encoder quantizes with the
  stored scale itself, the scale's own rounding adds no error (the grid is at most 0.8%
  coarser).
* **Block size 128** (configurable): a 2-byte scale per block costs 16/B bits per value
  (0.125 at 128, 0.25 at 64). Smaller blocks follow outliers more closely (one large value
  only coarsens its own block); larger ones save bytes. 64-256 are sensible.
* **4-bit = E3M0**, as Streaming DiLoCo sent: sign bit plus 3 exponent bits, magnitudes
  ``scale · {0, 2^-6, 2^-5, …, 2^-1, 1}``. Uniform int4 zeroes every value below
  ``absmax/14``; E3M0 keeps values down to ``absmax/128`` with at most 1/3 relative error.
  Relative RMS error at block 128: Gaussian data 0.19 (int4: 0.12), Student-t with 3
  degrees of freedom 0.17 (int4: 0.23, with 40% of the values zeroed). Pseudo-gradients are
  heavy-tailed and Streaming DiLoCo found zeroing coordinates harmful and E3M0 lossless in
  practice, so E3M0 it is. The code ``-0`` (0b1000) is never produced
  and rejected on decode. Two values per byte, the first in the low nibble.
* **Round to nearest**, in the linear domain (minimum absolute error per value), not
  stochastic rounding: it is deterministic (peers and tests reproduce it exactly), and its
  bias is removed by error feedback; across peers the rounding errors of different tensors
  largely average out.
* **Decoders validate everything** (length against the shape, scale finiteness and sign,
  unused codes, padding): their input comes from the network. Non-finite inputs are
  refused on encode, so a diverged peer cannot send NaN into the average. No pickle.

* **2-bit = sign + one of two levels per block**, the levels fitted to the block's magnitudes by
  three Lloyd iterations (threshold midway between the levels, each level the mean of its group),
  as the sparse ``topk`` codes its kept values. Four symmetric levels ``±lo, ±hi`` beat ternary
  ``{0, ±s}`` on Gaussian data (measured, 2^20 values: mean squared error 0.115 of the variance
  against 0.190 for ternary at its best threshold) and keep every value's sign. Each level is its group's mean, so a block
  never comes back longer (L2) than it went, but for the levels' bf16 rounding (up, at most 2^-7).

Layouts (little-endian): ``none``/``fp16``: the values. ``int8``/``4bit``: ``ceil(n/B)``
bf16 scales, then the codes (n bytes, resp. ``ceil(n/2)`` bytes). ``2bit``: ``ceil(n/B)`` pairs of
bf16 levels (low, high), then ``ceil(n/4)`` bytes of codes, four per byte from the low bits up
(bit 0 of a code: negative; bit 1: the high level).
"""

from __future__ import annotations

import logging
import math
import threading
from abc import abstractmethod
from collections.abc import Hashable
from typing import Literal, get_args

import numpy as np
import torch
from torch import Tensor

from p2p_diloco.core.codec_base import Codec, _flat_fp32, fit_two_levels
from p2p_diloco.core.sparse import DEFAULT_CHUNK_SIZE, DEFAULT_TOPK, SPARSE_CODEC_NAMES, TopKCodec

__all__ = [
    "CODEC_NAMES",
    "CodecName",
    "DEFAULT_BLOCK_SIZE",
    "Codec",
    "E3M0Codec",
    "ErrorFeedback",
    "Float16Codec",
    "Float32Codec",
    "Int8Codec",
    "TwoLevelCodec",
    "get_codec",
    "max_abs_error_bound",
]

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 128
MAX_BLOCK_SIZE = 1 << 16
CodecName = Literal["none", "fp16", "int8", "4bit", "2bit", "topk", "topk-sign"]
"""The one list of codec names: ``OuterConfig.compression`` is typed by it (so the CLI offers these), and
:data:`CODEC_NAMES` is read from it. ``topk`` and ``topk-sign`` are the sparse ones
(``core.sparse.SPARSE_CODEC_NAMES``); the others are ``_CODECS``' keys (a unit test checks both)."""
CODEC_NAMES: tuple[str, ...] = get_args(CodecName)
"""Every codec a sender may choose, in :data:`CodecName`'s order."""

class Float32Codec(Codec):
    """``none``: raw fp32, lossless."""

    name = "none"

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, t: Tensor) -> bytes:
        return _flat_fp32(t).numpy().astype("<f4", copy=False).tobytes()

    def _decode_flat(self, view: memoryview, numel: int) -> Tensor:
        values = torch.from_numpy(np.frombuffer(view, dtype="<f4", count=numel).astype(np.float32))
        if not bool(torch.isfinite(values).all()):
            raise ValueError("none data holds NaN or infinite values")
        return values


class Float16Codec(Codec):
    """``fp16``: values clamped to ±65504 (fp16's range) and rounded to nearest fp16."""

    name = "fp16"
    _FP16_MAX = float(torch.finfo(torch.float16).max)

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, t: Tensor) -> bytes:
        half = _flat_fp32(t).clamp_(-self._FP16_MAX, self._FP16_MAX).to(torch.float16)
        return half.numpy().astype("<f2", copy=False).tobytes()

    def _decode_flat(self, view: memoryview, numel: int) -> Tensor:
        values = torch.from_numpy(np.frombuffer(view, dtype="<f2", count=numel).astype(np.float32))
        if not bool(torch.isfinite(values).all()):
            raise ValueError("fp16 data holds NaN or infinite values")
        return values


def _round_up_to_bf16(values: Tensor) -> tuple[np.ndarray, Tensor]:
    """Round non-negative finite fp32 values up to bf16; returns (bf16 bits, fp32 values)."""
    bits = values.contiguous().view(torch.int32)
    # For non-negative floats the bit pattern grows with the value, so adding 0xFFFF before
    # truncating the low half rounds up. absmax/q is far below fp32's max: no overflow to inf.
    rounded = (bits + 0xFFFF) & ~0xFFFF
    return (rounded >> 16).numpy().astype("<u2"), rounded.view(torch.float32)


def _decode_bf16_scales(view: memoryview, count: int, codec: str) -> Tensor:
    raw = np.frombuffer(view, dtype="<u2", count=count).astype(np.uint32)
    if np.any(raw & 0x8000):
        raise ValueError(f"{codec} data holds a negative block scale")
    if np.any((raw & 0x7F80) == 0x7F80):
        raise ValueError(f"{codec} data holds a non-finite block scale")
    return torch.from_numpy((raw << 16).view(np.float32).copy())


class _BlockCodec(Codec):
    """Shared layout of the block-scaled codecs: bf16 scales, then the codes."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if (
            isinstance(block_size, bool)
            or not isinstance(block_size, int)
            or not 1 <= block_size <= MAX_BLOCK_SIZE
        ):
            raise ValueError(f"block_size must be an integer in [1, {MAX_BLOCK_SIZE}], got {block_size!r}")
        self.block_size = block_size

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    @abstractmethod
    def _code_nbytes(self, numel: int) -> int: ...

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * self.num_blocks(numel) + self._code_nbytes(numel)

    def _blocks(self, flat: Tensor) -> Tensor:
        padded = torch.zeros(self.num_blocks(flat.numel()) * self.block_size, dtype=torch.float32)
        padded[: flat.numel()] = flat
        return padded.view(-1, self.block_size)

    def _per_value_scales(self, scales: Tensor, numel: int) -> Tensor:
        return scales.repeat_interleave(self.block_size)[:numel]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"


class Int8Codec(_BlockCodec):
    """``int8``: ``round(x / s)`` in [-127, 127] with ``s = absmax/127`` per block.

    Error bound per value: ``s/2 ≤ absmax/254 · (1 + 2^-7)`` (the bf16 scale rounding).
    """

    name = "int8"

    def _code_nbytes(self, numel: int) -> int:
        return numel

    def encode(self, t: Tensor) -> bytes:
        flat = _flat_fp32(t)
        if flat.numel() == 0:
            return b""
        blocks = self._blocks(flat)
        scale_bits, scales = _round_up_to_bf16(blocks.abs().amax(dim=1) / 127.0)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        return scale_bits.tobytes() + codes.reshape(-1)[: flat.numel()].numpy().tobytes()

    def _decode_flat(self, view: memoryview, numel: int) -> Tensor:
        if numel == 0:
            return torch.zeros(0)
        nblocks = self.num_blocks(numel)
        scales = _decode_bf16_scales(view[: 2 * nblocks], nblocks, self.name)
        codes = np.frombuffer(view, dtype=np.int8, count=numel, offset=2 * nblocks)
        if np.any(codes == -128):
            raise ValueError("int8 data holds the unused code -128")
        values = torch.from_numpy(codes.astype(np.float32)).mul_(self._per_value_scales(scales, numel))
        if not bool(torch.isfinite(values).all()):  # a code of 127 at a scale above fp32's max / 127
            raise ValueError("int8 data decodes to infinite values: a block scale too large for its codes")
        return values


# E3M0 magnitudes (codes 0..7) and the midpoints between neighbours for round-to-nearest.
_E3M0_LEVELS = torch.tensor([0.0] + [2.0**-k for k in range(6, -1, -1)], dtype=torch.float32)
_E3M0_MIDPOINTS = (_E3M0_LEVELS[1:] + _E3M0_LEVELS[:-1]) / 2
_E3M0_NEGATIVE_ZERO = 0b1000


class E3M0Codec(_BlockCodec):
    """``4bit``: sign + 3-bit exponent, ``x ≈ ±s·2^(k-7)`` (k = 1..7) or 0, with ``s = absmax`` per block.

    Error bound per value: ``max(|x|/3, s/128)`` with ``s ≤ absmax · (1 + 2^-7)``.
    """

    name = "4bit"

    def _code_nbytes(self, numel: int) -> int:
        return (numel + 1) // 2

    def encode(self, t: Tensor) -> bytes:
        flat = _flat_fp32(t)
        numel = flat.numel()
        if numel == 0:
            return b""
        blocks = self._blocks(flat)
        scale_bits, scales = _round_up_to_bf16(blocks.abs().amax(dim=1))
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        ratio = (blocks.abs() / safe[:, None]).reshape(-1)[:numel]
        # Count the midpoints below each ratio: the index of the nearest level (ties go down).
        # Seven comparisons beat torch.bucketize, which is slow for tiny boundary tables.
        magnitude = torch.zeros(numel, dtype=torch.uint8)
        for midpoint in _E3M0_MIDPOINTS.tolist():
            magnitude.add_((ratio > midpoint).to(torch.uint8))
        negative = (flat < 0) & (magnitude > 0)
        codes = magnitude | (negative.to(torch.uint8) << 3)
        if numel % 2:
            codes = torch.cat([codes, torch.zeros(1, dtype=torch.uint8)])
        packed = codes[0::2] | (codes[1::2] << 4)
        return scale_bits.tobytes() + packed.numpy().tobytes()

    def _decode_flat(self, view: memoryview, numel: int) -> Tensor:
        if numel == 0:
            return torch.zeros(0)
        nblocks = self.num_blocks(numel)
        scales = _decode_bf16_scales(view[: 2 * nblocks], nblocks, self.name)
        packed = torch.from_numpy(np.frombuffer(view, dtype=np.uint8, offset=2 * nblocks).copy())
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)
        if numel % 2 and int(codes[-1]) != 0:
            raise ValueError("4bit data has a non-zero padding nibble")
        codes = codes[:numel]
        if bool((codes == _E3M0_NEGATIVE_ZERO).any()):
            raise ValueError("4bit data holds the unused code -0")
        values = _E3M0_LEVELS[(codes & 0x07).long()]
        values = torch.where(codes >= 8, -values, values)
        return values.mul_(self._per_value_scales(scales, numel))


class TwoLevelCodec(_BlockCodec):
    """``2bit``: per value its sign and whether it takes its block's low or high level (module docstring).

    Error bound per value: the block's largest magnitude times ``1 + 2^-7`` (a value and its code share their
    sign, and both magnitudes lie in ``[0, absmax]`` but for the levels' rounding up). Relative RMS error at
    block 128 (2^20 values): Gaussian data 0.34, Student-t with 3 degrees of freedom 0.51 (``4bit``: 0.19,
    0.17); use it with error feedback.
    """

    name = "2bit"

    def _code_nbytes(self, numel: int) -> int:
        return (numel + 3) // 4

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * self.num_blocks(numel) + self._code_nbytes(numel)

    def encode(self, t: Tensor) -> bytes:
        flat = _flat_fp32(t)
        numel = flat.numel()
        if numel == 0:
            return b""
        blocks = self._blocks(flat)
        valid = torch.zeros(blocks.numel(), dtype=torch.bool)
        valid[:numel] = True  # the last block's padding takes no part in its levels
        valid = valid.view_as(blocks)
        magnitude = blocks.abs()
        threshold = magnitude.sum(dim=1) / valid.sum(dim=1).to(torch.float32)
        lo, hi, high = fit_two_levels(magnitude, valid, threshold)
        level_bits, _ = _round_up_to_bf16(torch.stack([lo, hi], dim=1).reshape(-1))
        codes = ((flat < 0).to(torch.uint8) | (high.reshape(-1)[:numel].to(torch.uint8) << 1)).numpy()
        padded = np.zeros(4 * self._code_nbytes(numel), dtype=np.uint8)
        padded[:numel] = codes
        quads = padded.reshape(-1, 4)
        packed = quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
        return level_bits.tobytes() + packed.astype(np.uint8).tobytes()

    def _decode_flat(self, view: memoryview, numel: int) -> Tensor:
        if numel == 0:
            return torch.zeros(0)
        nblocks = self.num_blocks(numel)
        levels = _decode_bf16_scales(view[: 4 * nblocks], 2 * nblocks, self.name).view(nblocks, 2)
        if bool((levels[:, 0] > levels[:, 1]).any()):
            raise ValueError("2bit data holds a block whose low level exceeds its high level")
        packed = np.frombuffer(view, dtype=np.uint8, offset=4 * nblocks)
        codes = ((packed[:, None] >> np.arange(0, 8, 2, dtype=np.uint8)) & 0b11).reshape(-1)
        if codes[numel:].any():
            raise ValueError("2bit data has non-zero padding codes")
        codes_t = torch.from_numpy(codes[:numel].astype(np.int64))
        magnitude = torch.where(codes_t >= 2, self._per_value_scales(levels[:, 1], numel),
                                self._per_value_scales(levels[:, 0], numel))
        return torch.where((codes_t & 1).bool(), -magnitude, magnitude)


_CODECS: dict[str, type[Codec]] = {
    "none": Float32Codec,
    "fp16": Float16Codec,
    "int8": Int8Codec,
    "4bit": E3M0Codec,
    "2bit": TwoLevelCodec,
}


def get_codec(name: str, block_size: int = DEFAULT_BLOCK_SIZE, *, chunk_size: int | None = None,
              k: int | None = None) -> Codec:
    """The codec called ``name`` (one of :data:`CODEC_NAMES`); ``block_size`` applies to int8/4bit/2bit,
    ``chunk_size`` and ``k`` to the sparse codecs (default 64 of 4096, see ``core.sparse``)."""
    if name in SPARSE_CODEC_NAMES:
        return TopKCodec(DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size,
                         DEFAULT_TOPK if k is None else k, signs_only=name == "topk-sign")
    try:
        cls = _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}") from None
    if issubclass(cls, _BlockCodec):
        return cls(block_size)
    return cls()


class ErrorFeedback:
    """Carries each tensor's quantization error over to its next encoding.

    ``encode(key, t)`` encodes ``t + decay * residual[key]`` and stores ``residual[key]`` = what
    the receiver will not see, so per value ``decoded + new residual == t + decay * old residual``
    (exactly where nothing was sent, to one fp32 rounding where a value was). With ``decay = 1``
    the sum of decoded tensors over many rounds stays within one round's error of the sum of the
    true tensors, instead of drifting with the codec's bias. Keys identify a tensor (or tensor
    part) that recurs every round; a key whose shape changes starts over with a zero residual.

    ``decay`` < 1 forgets old error geometrically: what a sparse codec leaves behind waits at most
    a few dozen rounds (0.95: half-life 14 rounds) instead of arriving long after the direction
    it pointed in stopped mattering. See ``OuterConfig.error_feedback_decay``.

    Residuals are fp32 on the CPU: one extra copy of everything encoded through this object.

    What the residuals add to the next encodings is announced before they are sent (:meth:`carried_norm`), so
    that receivers can bound what this sender sends (``core.bounds.fresh_limits``).
    """

    def __init__(self, codec: Codec, decay: float = 1.0) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error feedback decay must be in [0, 1], got {decay!r}")
        self.codec = codec
        self.decay = float(decay)
        self._residuals: dict[Hashable, Tensor] = {}
        self._version = 0  # counts changes to the residuals: :meth:`carried_norm` is cached per version
        self._carried: tuple[int, float] = (0, 0.0)
        self._carried_lock = threading.Lock()

    def encode(self, key: Hashable, t: Tensor) -> bytes:
        corrected = t.detach().to(device="cpu", dtype=torch.float32, copy=True)
        residual = self._residuals.get(key)
        if residual is not None:
            if residual.shape == corrected.shape:
                corrected.add_(residual, alpha=self.decay)
            else:
                logger.warning(
                    "error feedback %r: shape changed to %s, residual dropped", key, tuple(t.shape)
                )
        data = self.codec.encode(corrected)
        self._residuals[key] = corrected.sub_(self.codec.decode(data, corrected.shape))
        self._version += 1
        return data

    def credit_undelivered(self, key: Hashable, sent: Tensor, delivered: Tensor) -> int:
        """Return to ``residual[key]`` the values we sent under ``key`` that the reply did not carry back.

        ``sent`` is what a receiver decoded from our part (``codec.decode`` of what :meth:`encode` returned),
        ``delivered`` the decoded reply for the same part: where the reply is zero, the aggregate's entry was
        dropped by the reducer's re-sparsification (a sparse codec's reply is the aggregate's own top-k), and
        our share of it comes back to us instead of being lost. Summed over the senders of a mean this returns
        exactly the dropped aggregate (times the group size) to the group's next rounds; every member still
        applies the same reply, so parameters stay identical: only private residuals change. Returns how many
        values were credited. Call it only for a part whose round was applied (a skipped round already keeps
        its pseudo-gradient as late work) and never for a part the reducers rejected (its residual is reset)."""
        sent = sent.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        delivered = delivered.detach().to(device="cpu").reshape(-1)
        if sent.shape != delivered.shape:
            raise ValueError(f"error feedback {key!r}: sent {tuple(sent.shape)} values, the reply has "
                             f"{tuple(delivered.shape)}")
        undelivered = (delivered == 0) & (sent != 0)
        residual = self._residuals.get(key)
        if residual is None or residual.numel() != sent.numel():
            residual = torch.zeros_like(sent)
        flat = residual.reshape(-1)
        flat[undelivered] += sent[undelivered]
        self._residuals[key] = flat.reshape(residual.shape)
        self._version += 1
        return int(undelivered.sum())

    def residual(self, key: Hashable) -> Tensor | None:
        """The error still owed for ``key`` (None if nothing was encoded under it)."""
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        """Drop one residual, or all of them (e.g. after the parameters were resynchronised, or when the
        part encoded under ``key`` was rejected by its receiver: its residual is not sent again)."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)
        self._version += 1

    def __getstate__(self) -> dict[str, object]:  # copies (a codec per fragment) and pickles get a lock of their own
        state = dict(self.__dict__)
        del state["_carried_lock"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._carried_lock = threading.Lock()

    def carried_norm(self) -> float:
        """How much the residuals add to the next encodings, measured as the codec selects values: ``decay``
        times the L2 combination over keys of ``codec.selection_norm(residual)``. By the triangle inequality per
        key and Minkowski's over keys, the next encodings of values ``v`` (all keys together) are no longer than
        ``gain * (|v| + carried_norm())``: what a sender announces before it sends (``core.bounds.fresh_limits``).
        One top-k pass over the residuals (about as long as encoding them), cached until a residual changes;
        safe to call from another thread."""
        with self._carried_lock:
            version = self._version
            if self._carried[0] == version:
                return self._carried[1]
            residuals = list(self._residuals.values())
            norm = self.decay * math.sqrt(math.fsum(self.codec.selection_norm(r) ** 2 for r in residuals))
            if self._version == version:  # no encoding changed a residual meanwhile
                self._carried = (version, norm)
            return norm

    def __len__(self) -> int:
        return len(self._residuals)


def max_abs_error_bound(codec: Codec, t: Tensor) -> Tensor:
    """Per-value worst-case reconstruction error of ``codec`` on ``t`` (for tests and monitoring)."""
    flat = _flat_fp32(t)
    if isinstance(codec, Float32Codec):
        return torch.zeros_like(flat).reshape(t.shape)
    if isinstance(codec, Float16Codec):
        # Half an fp16 ulp: relative 2^-11 for normal values, 2^-25 absolute in the subnormal range.
        return torch.maximum(flat.abs() * 2.0**-11, torch.full_like(flat, 2.0**-25)).reshape(t.shape)
    if not isinstance(codec, _BlockCodec) or flat.numel() == 0:
        raise ValueError(f"no error bound known for {codec!r}")
    absmax = codec._blocks(flat).abs().amax(dim=1)
    absmax = codec._per_value_scales(absmax, flat.numel()) * (1.0 + 2.0**-7)
    if isinstance(codec, Int8Codec):
        bound = absmax / 254.0
    elif isinstance(codec, TwoLevelCodec):
        bound = absmax
    else:
        bound = torch.maximum(flat.abs() / 3.0, absmax / 128.0)
    # A block whose largest value is below fp32's normal range has a scale that underflows: its values
    # may come back as zero, so the bound is the value itself there.
    tiny = absmax < 2.0**-126
    return torch.where(tiny, torch.maximum(bound, flat.abs()), bound).reshape(t.shape)
