"""Sparse pseudo-gradient codecs: chunked top-k, kept values at 2 bits (or 1), and the reducer's reply.

Two codecs a sender chooses between; a reducer answers with the first (``TopKCodec.reply_codec``):

=============  ===========================================================  ==========================
name           what is sent per chunk of ``C`` values (default 64 of 4096)  bytes / fp32 (C=4096, k=64)
=============  ===========================================================  ==========================
``topk``       the ``k`` largest magnitudes: 12-bit offsets, 2-bit codes     117 / 16384 = 1/140
               (sign, low/high level), two bf16 levels, a count byte
``topk-sign``  the same offsets, 1-bit signs and one bf16 scale              107 / 16384 = 1/153
reply          the aggregate's own top ``k`` per chunk, as ``topk``          1/140 (as a part)
union reply    the previous reply, still decoded (``SparseAverageCodec``):  1/16 at N = 8 (1.96 bits a
               all of the aggregate's up to ``N·k`` entries: positions       value, random entries)
               (offsets or a bitmap) and int8 × bf16 chunk scale
=============  ===========================================================  ==========================

A round then costs each peer ``(N-1)/N`` of its vector's parts plus its ``1/N`` of the replies to ``N-1``
members, ``(N-1)/N · 2 · 117`` bytes per 4096 values against fp32's ``(N-1)/N · 2 · 16384``: 1/140 of
fp32's bytes in each direction at every ``N`` (1/134 measured in the simulator, where some chunks hold
fewer non-zero values).

The byte counts are exact, every count, level, index and padding bit included (the wire adapter adds its
8-byte header per part, ``swarm.hivemind_codecs.HEADER_NBYTES``). Always combine the sender codecs with error
feedback (:class:`p2p_diloco.core.codecs.ErrorFeedback`): 98.4% of each round's values are not sent, and
only the residual carries them into later rounds.

Design decisions (measured where a number is given):

* **Chunks of a part.** Top-k is taken per chunk of ``C`` consecutive values of the part being sent (an
  all-reduce part, or a whole tensor in the simulator), so every region of the model gets its share of the
  bandwidth and a chunk can be encoded and checked on its own. ``C`` is a power of two in [16, 32768] (a
  reply counts a chunk's entries in 16 bits); the last chunk of a part may be shorter (it keeps
  ``min(k, its length)``).
* **Two levels per chunk for 2 bits.** A kept value is sent as its sign and one bit choosing the chunk's low
  or high level; the levels are fitted to the chunk's kept magnitudes by three Lloyd iterations (threshold
  midway between the levels, each level the mean of its group). Relative RMS error on the kept values
  (top 64 of 4096, 256 chunks): Gaussian 0.063, Student-t(3) 0.19; the best single scale with a fixed ratio
  of levels reached 0.10 and 0.67, one scale and signs alone (``topk-sign``) 0.11 and 0.71. The second level
  costs 2 bytes per chunk (1.7%). Each level is its group's mean, so the quantized chunk is never longer
  (L2) than the kept values (Jensen), and those never longer than the chunk: the codec cannot raise a
  norm beyond the bf16 rounding of the levels.
* **Indices: fixed ``log2(C)``-bit offsets** (12 bits at 4096), sorted, LSB first. Measured on the top 64 of
  4096 Gaussian values (256 chunks), Rice coding of the gaps would take 7.50 bits per index (parameter 5;
  8.44 at 4, 7.56 at 6), the entropy bound is 7.36, a bitmap 64: Rice would save 4.5 of every 12 bits, 117
  bytes per chunk down to 81 (1/202 of fp32 instead of 1/140). Fixed offsets were chosen because a part's
  exact size then follows from its per-chunk counts alone (checked before any value is read), and decoding
  is a vectorised unpack instead of a bit-serial parse of hostile input. With top-k replies (below) both
  directions are parts of this layout, so Rice would cut a round's bytes by about 31% (to 1/202 of fp32):
  the next step if the uplink still bounds the round; when the replies were unions it would have saved little.
* **Variable counts.** A chunk sends ``min(k, its non-zero values)`` entries, one count byte per chunk (two
  when ``k > 255``): an all-zero chunk (a member without late work, a frozen layer) costs 1 + levels bytes.
* **The reducer's reply: the aggregate's own top-k** (``reply_codec``, a ``TopKCodec`` with the senders'
  chunk size and ``k``, 2 bits also for ``topk-sign`` senders). The aggregate of N senders' parts is
  non-zero on the union of their positions, up to ``N·k`` per chunk (mean, trimmed mean and centered
  clipping all keep that support, see ``core.robust``). Sending that union (``SparseAverageCodec``:
  positions and int8 values) cost 1/32 of fp32 at N = 4 and made a round 1/50 of fp32's bytes
  (BENCHMARKS.md, "Sparse-codec"); re-sparsifying it to ``k`` per chunk makes a reply cost what a part costs,
  and a round 1/134 (measured). What the reply drops is not lost where the caller wires
  :meth:`p2p_diloco.core.codecs.ErrorFeedback.credit_undelivered`: each sender returns to its own residual
  the values it sent at positions the reply left empty, which summed over the senders is exactly the dropped
  aggregate times N, so the group sends it again in later rounds (the reducer of a slice changes from round
  to round and cannot keep it; a sender's residual is private, so parameters stay identical). Only the
  2-bit rounding of the kept aggregate entries is lost. The reply is identical for every member because
  every member decodes the same bytes, and a receiver checks it as a part (at most ``k`` entries per chunk:
  a header claiming more is refused, ``swarm.hivemind_codecs``).
* **Decoders reject everything malformed, each with a reason** (:class:`SparsePartError`): a declared size
  that disagrees with the bytes, more than ``k`` entries in a chunk, an index out of its chunk, a repeated
  or unsorted index, a NaN, infinite or negative level, non-zero padding. Nothing is returned for a part
  with any fault, so nothing of it is applied.

Layout of a ``topk``/``topk-sign`` part of ``n`` values, ``m = ceil(n / C)`` chunks, ``E`` entries in all
(little-endian): ``m`` counts (u8, or u16 when ``k > 255``), ``m`` level pairs (2-bit: low, high) or
scales (sign) as bf16, ``E`` offsets of ``log2(C)`` bits packed LSB first and padded to a byte, ``E`` codes
of 2 bits (bit 0: negative, bit 1: high level) or 1 bit (negative) packed the same way.

Layout of a union reply part (``SparseAverageCodec``): one byte ``0`` (offsets) or ``1`` (bitmap), ``m`` u16 counts, ``m`` bf16 scales,
the positions (``E`` offsets, or ``n`` bits), then ``E`` int8 values in ``[-127, 127]``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from p2p_diloco.core.codec_base import Buffer, Codec, _as_bytes_view, _flat_fp32, _numel, fit_two_levels

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_TOPK",
    "SPARSE_CODEC_NAMES",
    "SparseAverageCodec",
    "SparsePartError",
    "TopKCodec",
]

DEFAULT_CHUNK_SIZE = 4096
DEFAULT_TOPK = 64
SPARSE_CODEC_NAMES: tuple[str, ...] = ("topk", "topk-sign")
MIN_CHUNK_SIZE, MAX_CHUNK_SIZE = 16, 1 << 15


class SparsePartError(ValueError):
    """A sparse part that must not be applied; ``reason`` names what is wrong with it."""


def check_sparse_params(chunk_size: int, k: int) -> None:
    """Raise ValueError unless ``chunk_size`` is a power of two in [16, 32768] and ``1 <= k <= chunk_size``."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not (
        MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE and chunk_size & (chunk_size - 1) == 0
    ):
        raise ValueError(f"chunk size must be a power of two in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}], "
                         f"got {chunk_size!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk_size:
        raise ValueError(f"k must be an integer in [1, {chunk_size}] for chunk size {chunk_size}, "
                         f"got {k!r}")


def _pack_bits(values: np.ndarray, width: int) -> bytes:
    """``values`` (non-negative integers below ``2**width``) as ``width``-bit fields, LSB first, byte-padded."""
    if values.size == 0:
        return b""
    bits = (values.astype(np.uint32)[:, None] >> np.arange(width, dtype=np.uint32)) & 1
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def _unpack_bits(view: memoryview, count: int, width: int, what: str) -> np.ndarray:
    """The inverse of :func:`_pack_bits` on exactly ``ceil(count*width/8)`` bytes; padding must be zero."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    bits = np.unpackbits(np.frombuffer(view, dtype=np.uint8), bitorder="little")
    if bits[count * width:].any():
        raise SparsePartError(f"non-zero padding after the {what}")
    fields = bits[: count * width].reshape(count, width).astype(np.int64)
    return fields @ (np.int64(1) << np.arange(width, dtype=np.int64))


def _to_bf16(values: Tensor) -> tuple[np.ndarray, Tensor]:
    """Non-negative finite fp32 values rounded to the nearest bf16: (bits, fp32 values)."""
    bits = values.contiguous().view(torch.int32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & ~0xFFFF  # round half to even
    return (rounded >> 16).numpy().astype("<u2"), rounded.view(torch.float32)


def _from_bf16(view: memoryview, count: int) -> Tensor:
    raw = np.frombuffer(view, dtype="<u2", count=count).astype(np.uint32)
    if np.any((raw & 0x7F80) == 0x7F80):
        raise SparsePartError("a NaN or infinite scale")
    if np.any(raw & 0x8000):
        raise SparsePartError("a negative scale")
    return torch.from_numpy((raw << 16).view(np.float32).copy())


def _chunk_lengths(numel: int, chunk_size: int) -> np.ndarray:
    chunks = -(-numel // chunk_size)
    lengths = np.full(chunks, chunk_size, dtype=np.int64)
    if chunks:
        lengths[-1] = numel - (chunks - 1) * chunk_size
    return lengths


def _check_offsets(offsets: np.ndarray, chunk_of: np.ndarray, lengths: np.ndarray) -> None:
    """Offsets must lie in their chunk and increase strictly within it (so none repeats)."""
    if offsets.size == 0:
        return
    if np.any(offsets >= lengths[chunk_of]):
        bad = int(np.argmax(offsets >= lengths[chunk_of]))
        raise SparsePartError(f"index out of range: offset {int(offsets[bad])} in chunk {int(chunk_of[bad])} "
                              f"of {int(lengths[chunk_of[bad]])} values")
    same_chunk = chunk_of[1:] == chunk_of[:-1]
    step = offsets[1:] - offsets[:-1]
    if np.any(same_chunk & (step == 0)):
        bad = int(np.argmax(same_chunk & (step == 0)))
        raise SparsePartError(f"repeated index: offset {int(offsets[bad])} twice in chunk {int(chunk_of[bad])}")
    if np.any(same_chunk & (step < 0)):
        bad = int(np.argmax(same_chunk & (step < 0)))
        raise SparsePartError(f"indices out of order in chunk {int(chunk_of[bad])}")


class _SparseBase(Codec):
    """Shared by the sparse codecs: a variable size, so ``decode`` checks it from the part's own counts."""

    def __init__(self, chunk_size: int, k: int) -> None:
        check_sparse_params(chunk_size, k)
        self.chunk_size, self.k = chunk_size, k
        self.index_bits = chunk_size.bit_length() - 1

    def num_chunks(self, numel: int) -> int:
        return -(-numel // self.chunk_size)

    def decode(self, data: Buffer, shape: tuple[int, ...] | list[int] | torch.Size) -> Tensor:
        """Rebuild the dense fp32 tensor; raises :class:`SparsePartError` naming the fault."""
        numel = _numel(shape)
        return self._decode_flat(_as_bytes_view(data), numel).reshape(tuple(int(d) for d in shape))

    def _scatter(self, numel: int, chunk_of: np.ndarray, offsets: np.ndarray, values: Tensor) -> Tensor:
        out = torch.zeros(numel, dtype=torch.float32)
        if offsets.size:
            positions = torch.from_numpy(chunk_of * self.chunk_size + offsets)
            out[positions] = values
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(chunk_size={self.chunk_size}, k={self.k})"


class TopKCodec(_SparseBase):
    """``topk`` (2-bit levels) and ``topk-sign`` (signs and one scale): see the module docstring.

    Args:
        chunk_size: values per chunk (power of two, 16-32768). Larger chunks follow the largest values of the
            whole part more freely; smaller ones spread the bandwidth more evenly. 4096 is the published
            setting (64 of 4096, 1.56%).
        k: values kept per chunk. Bytes grow about linearly with k; with error feedback a smaller k delays
            values rather than dropping them.
        signs_only: 1 bit per kept value and one scale per chunk (the chunk's mean kept magnitude) instead of
            2 bits and two levels: 9% fewer bytes, a coarser value.
    """

    name = "topk"

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, k: int = DEFAULT_TOPK, *,
                 signs_only: bool = False) -> None:
        super().__init__(chunk_size, k)
        self.signs_only = signs_only
        self.name = "topk-sign" if signs_only else "topk"
        self.value_bits = 1 if signs_only else 2
        self.levels = 1 if signs_only else 2
        self.count_bytes = 1 if k <= 255 else 2

    @property
    def reply_codec(self) -> Codec:
        """The reducer's answer: the aggregate's own top-``k`` per chunk at 2 bits (``topk``, same chunk size
        and ``k``, also for ``topk-sign`` senders), so the reply costs what a sender's part costs and a round
        is about 1/140 of fp32's bytes each way. What the re-sparsification drops is returned to the senders'
        residuals by :meth:`ErrorFeedback.credit_undelivered` where the caller wires it (module docstring)."""
        return TopKCodec(self.chunk_size, self.k)

    def part_bits_per_value(self) -> float:
        """4 bits, not the wire's 0.23: hivemind sizes all-reduce parts by wire bytes, and a reducer holds one
        decoded (dense fp32) copy of the current part per sender. At 0.23 bits a 512 KiB part would be 18M
        values, 73 MB per sender; at 4 bits it is 1M values (256 chunks of 4096, 4 MB per sender), the same
        as with ``4bit``, and its wire size about 30 KB."""
        return max(self.bits_per_value(), 4.0)

    def nbytes_for(self, chunks: int, entries: int) -> int:
        """Exact bytes of a part with ``chunks`` chunks holding ``entries`` kept values in all."""
        return (chunks * (self.count_bytes + 2 * self.levels) + -(-entries * self.index_bits // 8)
                + -(-entries * self.value_bits // 8))

    def encoded_nbytes(self, numel: int) -> int:
        """The largest part for ``numel`` values (every chunk keeps ``min(k, its length)``); parts whose
        chunks hold fewer non-zero values are smaller by exactly the entries they do not send."""
        lengths = _chunk_lengths(numel, self.chunk_size)
        return self.nbytes_for(len(lengths), int(np.minimum(lengths, self.k).sum()))

    def encode(self, t: Tensor) -> bytes:
        flat = _flat_fp32(t)
        numel = flat.numel()
        chunks = self.num_chunks(numel)
        if numel == 0:
            return b""
        padded = torch.zeros(chunks * self.chunk_size, dtype=torch.float32)
        padded[:numel] = flat
        blocks = padded.view(chunks, self.chunk_size)
        magnitudes, picked = blocks.abs().topk(min(self.k, self.chunk_size), dim=1)
        kept = magnitudes > 0  # zeros (and the padding of the last chunk) are never sent
        # Sort each chunk's kept offsets; unkept slots get the sentinel chunk_size and sort last.
        offsets, order = torch.where(kept, picked, torch.full_like(picked, self.chunk_size)).sort(dim=1)
        kept = torch.gather(kept, 1, order)
        values = torch.gather(blocks, 1, offsets.clamp(max=self.chunk_size - 1))
        counts = kept.sum(dim=1)
        magnitude = values.abs() * kept
        level_bits, levels, high = self._levels(magnitude, kept, counts)
        negative = (values < 0) & kept
        codes = negative.to(torch.int64) | (high.to(torch.int64) << 1 if not self.signs_only else 0)
        count_dtype = "<u1" if self.count_bytes == 1 else "<u2"
        return (counts.numpy().astype(count_dtype).tobytes() + level_bits.tobytes()
                + _pack_bits(offsets[kept].numpy(), self.index_bits)
                + _pack_bits(codes[kept].numpy(), self.value_bits))

    def selection_norm(self, t: Tensor) -> float:
        """The chunked top-k norm: per chunk of ``t`` (flattened, as :meth:`encode` chunks a part) the L2 norm of
        its ``k`` largest magnitudes, combined in L2 over the chunks (float64). A part never sends more than that
        (times the levels' rounding); per chunk it is the largest L2 norm of any ``k`` values, a maximum of
        seminorms, so it obeys the triangle inequality (``Codec.selection_norm``). Costs one top-k pass."""
        flat = t.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        if flat.numel() == 0:
            return 0.0
        chunks = self.num_chunks(flat.numel())
        padded = torch.zeros(chunks * self.chunk_size, dtype=torch.float32)
        padded[: flat.numel()] = flat.abs()
        top = padded.view(chunks, self.chunk_size).topk(min(self.k, self.chunk_size), dim=1).values
        return float(torch.linalg.vector_norm(top.double()))

    def _levels(self, magnitude: Tensor, kept: Tensor, counts: Tensor) -> tuple[np.ndarray, Tensor, Tensor]:
        """Per chunk the bf16 level(s) and, per kept value, whether it takes the high level."""
        safe_counts = counts.clamp(min=1).to(torch.float32)
        if self.signs_only:
            bits, scale = _to_bf16(magnitude.sum(dim=1) / safe_counts)
            return bits, scale[:, None], torch.zeros_like(kept)
        top = magnitude.amax(dim=1)
        bottom = torch.where(kept, magnitude, torch.full_like(magnitude, float("inf"))).amin(dim=1)
        bottom = torch.where(counts > 0, bottom, torch.zeros_like(bottom))
        threshold = (top + bottom) / 2
        lo, hi, high = fit_two_levels(magnitude, kept, threshold)
        bits, pair = _to_bf16(torch.stack([lo, hi], dim=1).reshape(-1))
        return bits, pair.view(-1, 2), high

    def _decode_flat(self, view: memoryview, numel: int) -> Tensor:
        chunks = self.num_chunks(numel)
        head = chunks * self.count_bytes
        if len(view) < head + 2 * self.levels * chunks:  # before anything is allocated per chunk
            raise SparsePartError(f"declared size disagrees with the bytes: {len(view)} bytes cannot hold the "
                                  f"counts and scales of {chunks} chunks")
        lengths = _chunk_lengths(numel, self.chunk_size)
        counts = np.frombuffer(view, dtype="<u1" if self.count_bytes == 1 else "<u2", count=chunks)
        counts = counts.astype(np.int64)
        allowed = np.minimum(lengths, self.k)
        if np.any(counts > allowed):
            bad = int(np.argmax(counts > allowed))
            raise SparsePartError(f"more than k entries: {int(counts[bad])} in chunk {bad}, at most "
                                  f"{int(allowed[bad])}")
        entries = int(counts.sum())
        expected = self.nbytes_for(chunks, entries)
        if len(view) != expected:
            raise SparsePartError(f"declared size disagrees with the bytes: {entries} entries in {chunks} chunks "
                                  f"take {expected} bytes, got {len(view)}")
        levels = _from_bf16(view[head: head + 2 * self.levels * chunks], self.levels * chunks)
        levels = levels.view(chunks, self.levels)
        start = head + 2 * self.levels * chunks
        index_nbytes = -(-entries * self.index_bits // 8)
        offsets = _unpack_bits(view[start: start + index_nbytes], entries, self.index_bits, "indices")
        codes = _unpack_bits(view[start + index_nbytes:], entries, self.value_bits, "values")
        chunk_of = np.repeat(np.arange(chunks, dtype=np.int64), counts)
        _check_offsets(offsets, chunk_of, lengths)
        level_index = torch.from_numpy(codes >> 1) if not self.signs_only else torch.zeros(entries, dtype=torch.int64)
        magnitude = levels[torch.from_numpy(chunk_of), level_index]
        values = torch.where(torch.from_numpy(codes & 1).bool(), -magnitude, magnitude)
        return self._scatter(numel, chunk_of, offsets, values)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(chunk_size={self.chunk_size}, k={self.k}"
                + (", signs_only=True)" if self.signs_only else ")"))


class SparseAverageCodec(_SparseBase):
    """The previous reply for sparse senders, the aggregate's non-zero values at their positions: still
    decoded (peers of an earlier release send it), no longer sent (see the module docstring's reply).

    ``k`` is the most entries a chunk of a reply may hold; the wire adapter sets it to the chunk size (a
    reply is checked against the shape, not a group size the receiver would have to trust), so a hostile
    reducer can at most send a dense part, at about 1.13 bytes per value.
    """

    name = "topk-reply"

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(chunk_size, chunk_size)

    def nbytes_for(self, numel: int, entries: int) -> int:
        """Exact bytes of a reply part of ``numel`` values with ``entries`` non-zero ones in all."""
        chunks = self.num_chunks(numel)
        return 1 + 4 * chunks + min(-(-entries * self.index_bits // 8), -(-numel // 8)) + entries

    def encoded_nbytes(self, numel: int) -> int:
        """The largest reply: every value non-zero."""
        return self.nbytes_for(numel, numel)

    def encode(self, t: Tensor) -> bytes:
        flat = _flat_fp32(t)
        numel = flat.numel()
        if numel == 0:
            return b""
        chunks = self.num_chunks(numel)
        nonzero = torch.nonzero(flat, as_tuple=True)[0]
        chunk_of = nonzero // self.chunk_size
        counts = torch.bincount(chunk_of, minlength=chunks)
        values = flat[nonzero]
        absmax = torch.zeros(chunks, dtype=torch.float32).scatter_reduce(0, chunk_of, values.abs(), "amax")
        scale_bits, scales = _to_bf16(absmax / 127.0)
        # a scale rounded down by bf16 can put the largest value at 127.5: the clamp keeps it a valid code
        codes = torch.round(values / scales[chunk_of].clamp(min=torch.finfo(torch.float32).tiny))
        codes = codes.clamp_(-127, 127).to(torch.int8)
        entries = int(nonzero.numel())
        use_bitmap = -(-numel // 8) < -(-entries * self.index_bits // 8)
        if use_bitmap:
            bitmap = np.zeros(numel, dtype=np.uint8)
            bitmap[nonzero.numpy()] = 1
            positions = np.packbits(bitmap, bitorder="little").tobytes()
        else:
            positions = _pack_bits((nonzero % self.chunk_size).numpy(), self.index_bits)
        return (bytes([1 if use_bitmap else 0]) + counts.numpy().astype("<u2").tobytes() + scale_bits.tobytes()
                + positions + codes.numpy().tobytes())

    def _decode_flat(self, view: memoryview, numel: int) -> Tensor:
        if numel == 0:
            if len(view):
                raise SparsePartError(f"declared size disagrees with the bytes: {len(view)} bytes for no values")
            return torch.zeros(0)
        chunks = self.num_chunks(numel)
        if len(view) < 1 + 4 * chunks:  # before anything is allocated per chunk
            raise SparsePartError(f"declared size disagrees with the bytes: {len(view)} bytes cannot hold the "
                                  f"counts and scales of {chunks} chunks")
        lengths = _chunk_lengths(numel, self.chunk_size)
        mode = view[0]
        if mode not in (0, 1):
            raise SparsePartError(f"unknown position coding {mode}")
        counts = np.frombuffer(view, dtype="<u2", count=chunks, offset=1).astype(np.int64)
        if np.any(counts > lengths):
            bad = int(np.argmax(counts > lengths))
            raise SparsePartError(f"more entries than values: {int(counts[bad])} in chunk {bad} of "
                                  f"{int(lengths[bad])}")
        entries = int(counts.sum())
        index_nbytes = -(-entries * self.index_bits // 8)
        bitmap_nbytes = -(-numel // 8)
        position_nbytes = bitmap_nbytes if mode == 1 else index_nbytes
        expected = 1 + 4 * chunks + position_nbytes + entries
        if len(view) != expected or (mode == 1) != (bitmap_nbytes < index_nbytes):
            raise SparsePartError(f"declared size disagrees with the bytes: {entries} entries in {chunks} chunks "
                                  f"take {self.nbytes_for(numel, entries)} bytes, got {len(view)}")
        scales = _from_bf16(view[1 + 2 * chunks: 1 + 4 * chunks], chunks)
        start = 1 + 4 * chunks
        chunk_of = np.repeat(np.arange(chunks, dtype=np.int64), counts)
        if mode == 1:
            bits = np.unpackbits(np.frombuffer(view[start: start + bitmap_nbytes], dtype=np.uint8),
                                 bitorder="little")
            if bits[numel:].any():
                raise SparsePartError("non-zero padding after the bitmap")
            positions = np.flatnonzero(bits[:numel])
            if positions.size != entries or np.any(positions // self.chunk_size != chunk_of):
                raise SparsePartError("the bitmap disagrees with the per-chunk counts")
            offsets = positions % self.chunk_size
        else:
            offsets = _unpack_bits(view[start: start + index_nbytes], entries, self.index_bits, "indices")
            _check_offsets(offsets, chunk_of, lengths)
        codes = np.frombuffer(view, dtype=np.int8, count=entries, offset=start + position_nbytes)
        if np.any(codes == -128):
            raise SparsePartError("the unused value code -128")
        values = torch.from_numpy(codes.astype(np.float32)) * scales[torch.from_numpy(chunk_of)]
        if not bool(torch.isfinite(values).all()):  # a code of 127 at a scale above fp32's max / 127
            raise SparsePartError("infinite values: a chunk scale too large for its codes")
        return self._scatter(numel, chunk_of, offsets, values)
