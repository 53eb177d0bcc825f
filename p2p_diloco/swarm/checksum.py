"""Deterministic digests of tensor lists: parameter checksums, chunk manifests and layout fingerprints.

Peers publish ``state_sha256`` after each outer step; a peer whose digest differs from the swarm's majority
knows its parameters drifted and resyncs. Joiners verify a downloaded state against the same digest.

The digest of a tensor list is built from a **manifest**: the list's bytes (each tensor's raw bytes, in
order, back to back) are cut into :data:`~p2p_diloco.core.chunks.CHUNK_BYTES` chunks and each chunk is
hashed; the digest covers the dtypes and shapes and then the chunk digests. Hashing costs the same single
pass over the bytes as hashing them whole, and it lets a joiner verify every chunk of a state on receipt:
it checks a donor's manifest against the digest the swarm voted for, then each chunk against the manifest
(``swarm.state``). The chunk size is part of the digest, so it is a protocol constant, not a setting.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import struct
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from p2p_diloco.core.chunks import CHUNK_BYTES, DIGEST_BYTES

_PARAMS_DOMAIN = b"p2p_diloco.params_sha256.v2"
_STATE_DOMAIN = b"p2p_diloco.state_sha256.v3"
_LAYOUT_DOMAIN = b"p2p_diloco.layout_fingerprint.v1"


def _header(dtype: torch.dtype, shape: Sequence[int]) -> bytes:
    header = f"{str(dtype).removeprefix('torch.')}|{','.join(map(str, shape))}".encode()
    return struct.pack("<Q", len(header)) + header


def _update_header(digest: hashlib._Hash, tensor: torch.Tensor) -> None:
    digest.update(_header(tensor.dtype, tensor.shape))


@dataclass(frozen=True)
class TensorManifest:
    """The digest of a tensor list and the sha256 of each of its chunks (``chunks``: 32 bytes each)."""

    sha: str
    chunks: bytes

    @property
    def count(self) -> int:
        return len(self.chunks) // DIGEST_BYTES

    def chunk(self, index: int) -> bytes:
        return self.chunks[index * DIGEST_BYTES:(index + 1) * DIGEST_BYTES]


def manifest_sha(layout: Sequence[tuple[torch.dtype, Sequence[int]]], total_bytes: int, chunks: bytes) -> str:
    """The digest of a tensor list of ``layout`` (dtype, shape per tensor) whose chunks hash to ``chunks``.

    A joiner calls this with its own template's layout and a donor's chunk digests: a manifest of another
    layout, or with one chunk digest changed, gives another digest than the one the swarm published."""
    digest = hashlib.sha256(_PARAMS_DOMAIN)
    digest.update(struct.pack("<QQ", len(layout), CHUNK_BYTES))
    for dtype, shape in layout:
        digest.update(_header(dtype, shape))
    digest.update(struct.pack("<Q", total_bytes))
    digest.update(chunks)
    return digest.hexdigest()


HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Threads that hash one tensor list's chunks at once. hashlib releases the GIL on large buffers and the
chunks are independent, so a state's hash takes about 1/threads of one core's time: at 1B parameters (4 GB
of anchors) one core hashes it in about 2-8 s (0.5-2 GB/s), which the training thread waits out once per
round. Capped at 8: beyond that the pass is bound by memory bandwidth."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="p2p-diloco-hash")
        return _pool


def _chunk_digests(views: Sequence[memoryview], starts: Sequence[int], first: int, last: int) -> bytes:
    """The sha256 of chunks ``first`` .. ``last - 1`` of the concatenation of ``views`` (``starts``: the
    offset where each view begins in it)."""
    out = bytearray()
    total = starts[-1] + len(views[-1])
    at = bisect.bisect_right(starts, first * CHUNK_BYTES) - 1  # the view holding the first chunk's first byte
    for index in range(first, last):
        begin, end = index * CHUNK_BYTES, min((index + 1) * CHUNK_BYTES, total)
        digest = hashlib.sha256()
        while begin < end:
            while starts[at] + len(views[at]) <= begin:  # skip views that end before here (empty ones too)
                at += 1
            take = min(end, starts[at] + len(views[at])) - begin
            digest.update(views[at][begin - starts[at]:begin - starts[at] + take])
            begin += take
        out += digest.digest()
    return bytes(out)


def tensor_manifest(tensors: Iterable[torch.Tensor]) -> TensorManifest:
    """One pass over ``tensors``: the sha256 of every chunk of their bytes and the list's digest.

    The bytes are those of a contiguous CPU copy, so the digest does not depend on strides, device or the
    process; two peers agree exactly when their tensors are bitwise equal (note: ``-0.0`` and ``0.0`` differ,
    and so do two NaNs with different payloads). Byte order is the machine's, little-endian on every platform
    PyTorch supports. The chunks of a list or tuple of contiguous CPU tensors are hashed on ``HASH_THREADS``
    threads. Anything else (tensors off the CPU or not contiguous; an iterator, e.g. one that gathers each
    tensor of a sharded model in turn) is hashed on this thread a tensor at a time, taking each from
    ``tensors`` only when the one before is done, so that no copy of the whole list is ever held.
    """
    if not isinstance(tensors, (list, tuple)) or not all(
            t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return _sequential_manifest(tensors)
    tensors = [t.detach() for t in tensors]
    layout = [(t.dtype, tuple(t.shape)) for t in tensors]
    # uint8 views: work for every dtype, bfloat16 included, which numpy cannot represent.
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]
    if not views:
        return TensorManifest(manifest_sha(layout, 0, b""), b"")
    starts = [0]
    for view in views[:-1]:
        starts.append(starts[-1] + len(view))
    total = starts[-1] + len(views[-1])
    count = -(-total // CHUNK_BYTES)
    step = -(-count // HASH_THREADS)
    ranges = [(first, min(first + step, count)) for first in range(0, count, step)]
    if len(ranges) == 1:
        chunks = _chunk_digests(views, starts, 0, count)
    else:
        chunks = b"".join(_hash_pool().map(lambda r: _chunk_digests(views, starts, *r), ranges))
    return TensorManifest(manifest_sha(layout, total, chunks), chunks)


def _sequential_manifest(tensors: Iterable[torch.Tensor]) -> TensorManifest:
    """The protocol's definition: one pass over the bytes, a tensor at a time (lazily from an iterator)."""
    layout, chunks, total = [], bytearray(), 0
    current, filled = hashlib.sha256(), 0
    for tensor in tensors:
        tensor = tensor.detach()
        layout.append((tensor.dtype, tuple(tensor.shape)))
        flat = tensor.to("cpu").contiguous().reshape(-1)
        if not flat.numel():
            continue
        view = memoryview(flat.view(torch.uint8).numpy())
        total += len(view)
        offset = 0
        while offset < len(view):
            take = min(CHUNK_BYTES - filled, len(view) - offset)
            current.update(view[offset:offset + take])
            offset, filled = offset + take, filled + take
            if filled == CHUNK_BYTES:
                chunks += current.digest()
                current, filled = hashlib.sha256(), 0
    if filled:
        chunks += current.digest()
    return TensorManifest(manifest_sha(layout, total, bytes(chunks)), bytes(chunks))


def params_sha256(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 (hex) of a tensor list: its dtypes, shapes and bytes (see :func:`tensor_manifest`)."""
    return tensor_manifest(tensors).sha


def layout_fingerprint(tensors: Sequence[torch.Tensor], extra: str = "") -> str:
    """16 hex characters identifying the dtypes and shapes (not values) of ``tensors``, plus ``extra``.

    Pass the model's architecture name or config digest as ``extra`` so two models that happen to share a
    layout still get different fingerprints. Peers only average with peers of the same fingerprint.
    """
    digest = hashlib.sha256(_LAYOUT_DOMAIN)
    digest.update(extra.encode())
    for tensor in tensors:
        _update_header(digest, tensor)
    return digest.hexdigest()[:16]


def combine_state_sha(params_sha: str, momentum_sha: str) -> str:
    """The state digest from the parameters' digest and the momentum's (see :func:`state_sha256`)."""
    digest = hashlib.sha256(_STATE_DOMAIN)
    digest.update(bytes.fromhex(params_sha))
    digest.update(bytes.fromhex(momentum_sha))
    return digest.hexdigest()


def state_sha256(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], *,
                 params_sha: str | None = None) -> str:
    """The digest peers publish and donors serve: SHA-256 over ``params_sha256`` of the parameters and
    ``params_sha256`` of the outer momentum (zeros when the outer optimizer keeps none), so a donor cannot
    pair honest parameters with a hostile momentum. Synchronised peers hold both bitwise equal: the same outer
    step on the same inputs. Built from the two digests so that a caller that hashed the parameters already
    (``params_sha``, the round's one pass over them) adds only the momentum's pass."""
    return combine_state_sha(params_sha if params_sha is not None else params_sha256(params),
                             params_sha256(momentum))
