"""Plugging the pseudo-gradient codecs into hivemind's all-reduce.

hivemind serializes every tensor part as a ``runtime_pb2.Tensor`` whose ``compression`` field
is a closed protobuf enum (NONE, MEANSTD_16BIT, FLOAT16, QUANTILE_8BIT, UNIFORM_8BIT,
BLOCKWISE_8BIT). The receiving side never asks the averager which compression it was built
with: ``hivemind.compression.deserialize_torch_tensor`` looks the enum name up in the
module-level table ``hivemind.compression.serialization._BASE_COMPRESSION_TYPES``, and a
reducer re-encodes the averaged part it sends back with ``serialize_torch_tensor(...,
part.compression)``, i.e. with the *table's* instance for that slot.

There is no free enum value, so our codecs borrow the ``BLOCKWISE_8BIT`` slot:
hivemind's own BlockwiseQuantization needs bitsandbytes, which p2p_diloco does not depend
on, so the slot is otherwise dead. :func:`install` puts a :class:`CodecCompression` into that
table slot. Every payload starts with a small header naming the codec and block size, so the
installed instance decodes any of our codecs, and a payload from a peer running plain
hivemind's BlockwiseQuantization is rejected with a clear error instead of being misread.

Wiring (done by the swarm, identically on every peer, before the averager starts)::

    compression = CodecCompression("4bit", block_size=128)
    install(compression)                       # routes extract() and the reducer's replies
    averager = hivemind.DecentralizedAverager(..., compression=compression)

``DecentralizedAverager`` is a ``multiprocessing.Process``: with the ``fork`` start method
(Linux's default up to Python 3.13) the averager process inherits the installed table, so
``install`` must run before the averager starts. Under ``spawn``/``forkserver`` the child
imports hivemind afresh and the slot must be installed again inside the child.

Keep ``state_compression`` lossless (hivemind's ``NoCompression``) so downloaded parameters
are exact. Where hivemind's own strategies fit they may be used instead and need no
install: ``NoCompression`` is equivalent to ``none`` and ``Float16Compression`` to ``fp16``
(ours additionally rejects NaN/inf). hivemind's ``Uniform8BitQuantization`` is not our
``int8``: it uses one per-tensor range of ±3 standard deviations and clips outliers, while
ours scales each block by its absolute maximum.

Replies. hivemind's reducer would send each sender ``average − sender's part``; the swarm's runner
(``swarm.runner``) instead encodes each averaged part once, with :meth:`CodecCompression.compress_average`,
and sends the same bytes to every member, so every member decodes identical values. Replies never go
through error feedback: the reducer of a slice changes from round to round, so there is no one to carry
the error to (what a sparse reply drops entirely is carried by its senders instead, see below).

Sparse codecs (``topk``, ``topk-sign``; ``core.sparse``). In the butterfly all-reduce every reducer owns a
slice of the flat vector; a sender's part for it is that slice's chunked top-k (its own error feedback
keyed by tensor and part), which the reducer decodes to a dense part that is zero off the sender's entries,
so checks, norm screen and aggregation (``swarm.reducer``, ``core.robust``) run unchanged. The aggregate goes back
as its own top-k at 2 bits (``TopKCodec.reply_codec``: same chunk size and ``k``, so a reply costs what a
part costs and a round is about 1/140 of fp32's bytes each way); a received part or reply whose header
claims another chunk size or a larger ``k`` than this swarm's is refused ("more than k entries"), and so is
any payload whose header names a codec other than this swarm's (parts) or its reply codec (replies): a header
cannot pick the decoder, e.g. a dense part in a top-k swarm. A reducer's own part
goes through the same encoding (and error feedback) before it joins the others (:meth:`own_part`), so
every sender's contribution is its top-k, its own included. A part that fails to decode is rejected with
the decoder's reason (``SparsePartError``) and the sender's data is dropped from the whole round.

Known limits of error feedback on the wire: the residual is updated when a part is encoded, so after a round
that is skipped once its parts went out, the residual holds their unsent remainder while the pseudo-gradient
itself is kept (carried or late work) and sent again: that remainder counts twice. It is about one round's
work against the roughly ``1 / (1 - decay)`` rounds a residual carries (20 at 0.95), and seen live: in the
wire test's NaN round the honest peer's next reply was mostly its own entries. Undoing it exactly needs the
part's pseudo-gradient or the old residual once the round failed, a second model-sized buffer for the
round; resetting the residual instead would throw those 20 rounds' remainder away. The late-work region is
sent without error feedback (no second model-sized residual), so late work under a sparse codec arrives as
its top-k only; and a sender learns that a remote reducer rejected it only by being banned, so only a
rejection by our own reducer resets our residuals (``swarm.round_process``).

What a top-k reply drops goes back to the senders' residuals (``ErrorFeedback.credit_undelivered``, the
simulator's ``--credit-undelivered``; ``OuterConfig.credit_undelivered``, on by default). The round process
calls :meth:`CodecCompression.credit_replies` once per round, inside the averager process and while it still
holds the averaged buffers, only when the round AVERAGED (every member confirmed, no fault seen), our own
reducer did not reject our part, and the trainer has not given the round up (it would keep the
pseudo-gradient as late work, and a credit would count the dropped entries twice); any other round calls
:meth:`CodecCompression.forget_sent`, and so does the start of every round, so a part is credited at most
once and only against the reply of the round that carried it. The replies are read from the averaged
buffers themselves: every part of ours, whichever reducer owned it, lies at ``part_index * part_size`` of
tensor ``key``, so no reply needs to be kept on the side. Our own reducer's parts are credited too: they went
through the same encoding and error feedback (:meth:`own_part`) and its reply is the same top-k of the
aggregate every member decodes, so what it drops of our entries is lost exactly as at a remote reducer; the
simulator, which has no reducer of its own, credits every worker's whole vector, and crediting every part
keeps the two equal. Memory: :meth:`compress` keeps each sent part's encoded payload until the round ends
(the parts of the fresh region: 117 bytes per 4096 values at 64/4096, about 0.03 bytes per parameter, 1/140
of fp32), in the averager process, for one round only; crediting decodes one part at a time (one part's fp32
for a moment). BENCHMARKS.md "Sparse-codec" measures what crediting gains in the simulator (at outer lr 1:
+19.9% against none without, +15.4% with).
"""

from __future__ import annotations

import functools
import logging
import math
import struct
from collections.abc import Sequence

import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.compression import serialization as _hivemind_serialization
from hivemind.proto import runtime_pb2

from p2p_diloco.core.bounds import norm_tolerance
from p2p_diloco.core.codecs import CODEC_NAMES, DEFAULT_BLOCK_SIZE, Codec, ErrorFeedback, get_codec
from p2p_diloco.core.sparse import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_TOPK,
    SPARSE_CODEC_NAMES,
    SparseAverageCodec,
    SparsePartError,
    TopKCodec,
)

__all__ = [
    "HEADER_NBYTES",
    "HIVEMIND_SLOT",
    "CodecCompression",
    "install",
    "uninstall",
]

logger = logging.getLogger(__name__)

HIVEMIND_SLOT = "BLOCKWISE_8BIT"
# magic, format version, codec id, block size
_HEADER = struct.Struct("<2sBBI")
HEADER_NBYTES = _HEADER.size
_MAGIC = b"PD"
_VERSION = 1
_WIRE_NAMES = (*CODEC_NAMES, SparseAverageCodec.name)
_CODEC_IDS = {name: index for index, name in enumerate(_WIRE_NAMES)}
_ALLOWED_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def _wire_param(codec: Codec) -> int:
    """The header's 32-bit parameter: the block size, or ``log2(chunk) << 16 | k`` for the sparse codecs."""
    if isinstance(codec, TopKCodec | SparseAverageCodec):
        return codec.index_bits << 16 | (codec.k if isinstance(codec, TopKCodec) else 0)
    return getattr(codec, "block_size", 0)


@functools.lru_cache(maxsize=16)
def _codec_for(codec_id: int, param: int) -> Codec:
    """The codec a header names; raises ValueError for an unknown id or a bad parameter."""
    if codec_id >= len(_WIRE_NAMES):
        raise ValueError(f"unknown codec id {codec_id}")
    name = _WIRE_NAMES[codec_id]
    if name == SparseAverageCodec.name:
        if param & 0xFFFF or not 4 <= param >> 16 <= 15:
            raise ValueError(f"parameter {param:#x} is invalid for codec {name!r}")
        return SparseAverageCodec(1 << (param >> 16))
    if name in SPARSE_CODEC_NAMES:
        if not 4 <= param >> 16 <= 15:
            raise ValueError(f"parameter {param:#x} is invalid for codec {name!r}")
        return get_codec(name, chunk_size=1 << (param >> 16), k=param & 0xFFFF)
    codec = get_codec(name, param) if param else get_codec(name)
    if getattr(codec, "block_size", 0) != param:
        raise ValueError(f"block size {param} is invalid for codec {name!r}")
    return codec


class CodecCompression(CompressionBase):
    """A hivemind ``CompressionBase`` that encodes tensor parts with one of our codecs.

    Args:
        codec: a codec name (one of ``CODEC_NAMES``) or instance.
        block_size: block size when ``codec`` is a name (int8, 4bit).
        error_feedback: carry each part's quantization error into the next round. Residuals
            are keyed by ``(info.key, info.part_index)``, which hivemind keeps stable across
            rounds for a fixed set of tensors; parts without a key are encoded plainly, and so
            are all-zero parts (a member with nothing to send in a region sends zeros, not its
            residual, which the norm screen would flag). Use one instance per averaged buffer:
            two buffers sharing an instance would share residuals. The residuals live in the
            process that compresses (the averager's), fp32, one per part sent: together one
            more copy of the averaged buffers, for the whole run.
        error_feedback_decay: factor on the carried error (``OuterConfig.error_feedback_decay``).
        chunk_size, k: the sparse codecs' chunk size and values kept per chunk, when ``codec`` is a name.
        credit_undelivered: with a sparse codec and error feedback, keep each sent part's payload for the
            round so that :meth:`credit_replies` can return what the reply dropped to the residual
            (``OuterConfig.credit_undelivered``); otherwise nothing is kept and crediting does nothing.
    """

    compression_type = runtime_pb2.CompressionType.Value(HIVEMIND_SLOT)

    def __init__(
        self, codec: Codec | str, block_size: int = DEFAULT_BLOCK_SIZE, *, error_feedback: bool = False,
        error_feedback_decay: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE, k: int = DEFAULT_TOPK,
        credit_undelivered: bool = True,
    ) -> None:
        self.codec = (get_codec(codec, block_size, chunk_size=chunk_size, k=k) if isinstance(codec, str)
                      else codec)
        if self.codec.name not in _CODEC_IDS:
            raise ValueError(f"codec {self.codec!r} has no wire id")
        self._header = self._header_for(self.codec)
        self.reply = self.codec.reply_codec
        self._reply_header = self._header_for(self.reply)
        self.error_feedback = ErrorFeedback(self.codec, error_feedback_decay) if error_feedback else None
        self.credit_undelivered = credit_undelivered and self.error_feedback is not None and self.sparse
        self._sent: dict[tuple[object, int], tuple[bytes, tuple[int, ...], int]] = {}
        """Per part sent this round, ``(key, part_index)``: its payload, shape and offset in tensor ``key``."""
        self.feedback_tensors: int | None = None
        """Error feedback only for parts of tensors whose key (index) is below this; ``None``: all. The swarm
        sets it to the number of fresh tensors, so the late-work region (keys from there on) is sent plainly."""

    @property
    def sparse(self) -> bool:
        """Whether parts are sparse (top-k): a reducer's own part then goes through :meth:`own_part`."""
        return isinstance(self.codec, TopKCodec)

    @staticmethod
    def _header_for(codec: Codec) -> bytes:
        return _HEADER.pack(_MAGIC, _VERSION, _CODEC_IDS[codec.name], _wire_param(codec))

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        if not torch.is_floating_point(tensor):
            raise ValueError(f"{type(self).__name__} does not support {tensor.dtype} tensors")
        dtype_name = str(tensor.dtype).replace("torch.", "")
        if dtype_name not in _ALLOWED_DTYPES:
            raise ValueError(f"{type(self).__name__} does not support {tensor.dtype} tensors")
        if self._feedback_for(info) and bool(tensor.any()):
            payload = self.error_feedback.encode((info.key, info.part_index), tensor)
            if self.credit_undelivered:  # kept for credit_replies: 1/140 of the part's fp32 bytes
                start = info.part_index * (info.part_size or 0)
                self._sent[(info.key, info.part_index)] = (payload, tuple(tensor.shape), start)
        else:
            self._sent.pop((info.key, info.part_index), None)  # nothing of ours to credit for this part
            payload = self.codec.encode(tensor)
        return self._message(self._header + payload, tensor, dtype_name)

    def _feedback_for(self, info: CompressionInfo) -> bool:
        if self.error_feedback is None or info.key is None:
            return False
        return self.feedback_tensors is None or (isinstance(info.key, int) and info.key < self.feedback_tensors)

    def _message(self, buffer: bytes, tensor: torch.Tensor, dtype_name: str) -> runtime_pb2.Tensor:
        # never autograd state on the wire: a receiver refuses a part or reply that carries the flag
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=buffer, size=tensor.shape,
                                  dtype=dtype_name, requires_grad=False)

    def compress_average(self, tensor: torch.Tensor, info: CompressionInfo) -> runtime_pb2.Tensor:
        """A reducer's averaged part, encoded once for every member: the reply codec, no error feedback."""
        dtype_name = str(tensor.dtype).replace("torch.", "")
        if dtype_name not in _ALLOWED_DTYPES:
            raise ValueError(f"{type(self).__name__} does not support {tensor.dtype} tensors")
        return self._message(self._reply_header + self.reply.encode(tensor), tensor, dtype_name)

    def own_part(self, tensor: torch.Tensor, info: CompressionInfo) -> torch.Tensor:
        """What a remote reducer would decode from our part ``tensor``: a sparse codec's reducer sends its own
        part through the same encoding (and error feedback) as every other sender's."""
        return self.extract(self.compress(tensor, info))

    def credit_reply(self, key: object, part_index: int, reply: torch.Tensor) -> int:
        """Return to our residual what the reply to our part ``(key, part_index)`` dropped
        (``ErrorFeedback.credit_undelivered``); the number of values credited, 0 when nothing is owed.

        Only once the round that carried the part averaged, and never for a part a reducer rejected
        (:meth:`credit_replies` does it for a whole round). Each part is credited at most once: its stored
        payload (what we sent, as bytes) is used up."""
        sent = self._sent.pop((key, part_index), None)
        if sent is None or self.error_feedback is None:
            return 0
        payload, shape, _ = sent
        return self.error_feedback.credit_undelivered((key, part_index), self.codec.decode(payload, shape), reply)

    def credit_replies(self, averaged: Sequence[torch.Tensor]) -> int:
        """Credit every part we sent this round against its reply, read from ``averaged`` (the round's averaged
        tensors, by key: what every member applies); the number of values credited. Then nothing is owed.

        Call it once, for a round that averaged (module docstring). A part whose reply does not fit its place
        (another layout) is skipped, and when ``averaged`` holds NaN or inf anywhere nothing is credited: the
        host skips such a round (checked on each tensor's sum, which NaN and inf reach: no model-sized mask).
        Nothing kept (a dense codec, or no error feedback): nothing to do, and no pass over the model."""
        if not self._sent:
            return 0
        if not all(bool(torch.isfinite(t.detach().sum())) for t in averaged):
            self.forget_sent()
            return 0
        replies = []
        for (key, part_index), (_, shape, start) in list(self._sent.items()):
            if not isinstance(key, int) or not 0 <= key < len(averaged):
                continue
            flat = averaged[key].detach().reshape(-1)
            numel = math.prod(shape)
            if start + numel <= flat.numel():
                replies.append((key, part_index, flat[start:start + numel]))
        credited = sum(self.credit_reply(key, part_index, reply) for key, part_index, reply in replies)
        self.forget_sent()
        return credited

    def forget_sent(self) -> None:
        """Drop what was kept for crediting: the round did not average, or a new one begins."""
        self._sent.clear()

    def carried_norm(self) -> float:
        """What our residuals add to our next parts (``ErrorFeedback.carried_norm``; 0 without error feedback):
        the averager process signs it with the round's metadata (``claims``), and every member's limit on our
        parts, and so its bound on replies, follows it (``core.bounds.fresh_limits``). One top-k pass over the
        residuals when they changed since the last call (``round_process`` calls it once a round has ended)."""
        return 0.0 if self.error_feedback is None else self.error_feedback.carried_norm()

    def reset_residuals(self) -> None:
        """Forget every error-feedback residual: the averager process calls it when our own reducer rejected our part
        (``round_process``), so a part the group refused is not sent again forever."""
        self._sent.clear()
        if self.error_feedback is not None:
            self.error_feedback.reset()

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """Decode a part from any peer; raises ValueError on anything malformed."""
        buffer = serialized_tensor.buffer
        if len(buffer) < HEADER_NBYTES:
            raise ValueError(f"compressed tensor of {len(buffer)} bytes is shorter than the header")
        magic, version, codec_id, param = _HEADER.unpack_from(buffer)
        if magic != _MAGIC:
            raise ValueError(
                f"payload in the {HIVEMIND_SLOT} slot is not a p2p_diloco codec payload; "
                "is the sending peer missing p2p_diloco.swarm.hivemind_codecs.install()?"
            )
        if version != _VERSION:
            raise ValueError(f"unsupported codec payload version {version}")
        dtype = _ALLOWED_DTYPES.get(serialized_tensor.dtype)
        if dtype is None:
            raise ValueError(f"unsupported dtype {serialized_tensor.dtype!r} in compressed tensor")
        codec = _codec_for(codec_id, param)
        if codec.name not in (self.codec.name, self.reply.name) or (
                codec.name not in SPARSE_CODEC_NAMES and param != _wire_param(self.codec)):
            # a part is this swarm's codec, a reply its reply codec: a header cannot pick another decoder
            raise ValueError(f"payload of codec {codec.name!r} (parameter {param:#x}): this swarm's parts are "
                             f"{self.codec!r}, its replies {self.reply!r}")
        if isinstance(codec, TopKCodec) and isinstance(self.codec, TopKCodec) and (
                codec.chunk_size != self.codec.chunk_size or codec.k > self.codec.k):
            # parts and replies are both top-k of our chunk size with at most our k: a header cannot raise it
            raise SparsePartError(f"more than k entries: the header claims {codec.k} of {codec.chunk_size}, "
                                  f"this swarm sends at most {self.codec.k} of {self.codec.chunk_size}")
        shape = tuple(serialized_tensor.size)
        with torch.no_grad():
            tensor = codec.decode(memoryview(buffer)[HEADER_NBYTES:], shape).to(dtype)
        # The wire's requires_grad flag is never taken (hivemind's own deserializer takes it): a tensor with
        # autograd state, once copied into the shared buffers, would make them non-leaf and keep every later
        # round's reply alive through their history.
        return tensor.detach()

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        bits = torch.finfo(info.descriptor.dtype).bits if info.descriptor.dtype.is_floating_point else 32
        return self.codec.part_bits_per_value() / bits  # what hivemind sizes parts by

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.codec!r}, error_feedback={self.error_feedback is not None})"


def install(compression: CodecCompression) -> CompressionBase:
    """Route hivemind's ``BLOCKWISE_8BIT`` slot to ``compression``; returns what was there.

    Process-wide: affects every averager in this process. Call it on every peer before any
    all-reduce, with the same codec the averager compresses with (the reducer re-encodes
    its replies with the installed instance).
    """
    if not isinstance(compression, CodecCompression):
        raise TypeError(f"expected a CodecCompression, got {type(compression).__name__}")
    table = _hivemind_serialization._BASE_COMPRESSION_TYPES
    previous = table[HIVEMIND_SLOT]
    table[HIVEMIND_SLOT] = compression
    logger.info("hivemind %s slot now carries %r", HIVEMIND_SLOT, compression)
    return previous


def uninstall(previous: CompressionBase) -> None:
    """Put back what :func:`install` returned."""
    if previous.compression_type != CodecCompression.compression_type:
        raise ValueError(f"{previous!r} does not belong in the {HIVEMIND_SLOT} slot")
    _hivemind_serialization._BASE_COMPRESSION_TYPES[HIVEMIND_SLOT] = previous


def wire_compression(name: str, error_feedback: bool, *, error_feedback_decay: float = 1.0,
                     chunk_size: int = DEFAULT_CHUNK_SIZE, k: int = DEFAULT_TOPK,
                     credit_undelivered: bool = True) -> CompressionBase:
    """The hivemind compression for ``--compression``: hivemind's own where it matches, ours otherwise."""
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return Float16Compression()
    compression = CodecCompression(name, error_feedback=error_feedback, error_feedback_decay=error_feedback_decay,
                                   chunk_size=chunk_size, k=k, credit_undelivered=credit_undelivered)
    install(compression)  # before the averager process forks, so its decoder table knows the codec
    return compression


def wire_norm_tolerance(compression: CompressionBase) -> float | None:
    """``core.bounds.norm_tolerance`` of a wire compression; ``None`` for hivemind's other codecs, whose
    worst-case norm gain is not known: senders are then not clipped and reducers' outputs not bounded."""
    if isinstance(compression, CodecCompression):
        codec = compression.codec
        density = codec.k / codec.chunk_size if isinstance(codec, TopKCodec) else 1.0
        return norm_tolerance(codec.name, compression.error_feedback is not None, density=density)
    if isinstance(compression, Float16Compression):
        return norm_tolerance("fp16", False)
    if isinstance(compression, NoCompression):
        return norm_tolerance("none", False)
    return None
