"""Deterministic digests of tensor lists: parameter checksums and tensor-layout fingerprints.

Peers publish ``params_sha256`` after each outer step; a peer whose digest differs from the swarm's majority
knows its parameters drifted and resyncs. Joiners verify a downloaded state against the same digest.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

import torch

_PARAMS_DOMAIN = b"p2p_diloco.params_sha256.v1"
_STATE_DOMAIN = b"p2p_diloco.state_sha256.v2"
_LAYOUT_DOMAIN = b"p2p_diloco.layout_fingerprint.v1"


def _update_header(digest: hashlib._Hash, tensor: torch.Tensor) -> None:
    header = f"{str(tensor.dtype).removeprefix('torch.')}|{','.join(map(str, tensor.shape))}".encode()
    digest.update(struct.pack("<Q", len(header)))
    digest.update(header)


def params_sha256(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 (hex) over each tensor's dtype, shape and raw bytes, in order.

    The bytes are those of a contiguous CPU copy, so the digest does not depend on strides, device or the
    process; two peers agree exactly when their tensors are bitwise equal (note: ``-0.0`` and ``0.0`` differ,
    and so do two NaNs with different payloads). Byte order is the machine's, little-endian on every platform
    PyTorch supports.
    """
    digest = hashlib.sha256(_PARAMS_DOMAIN)
    count = 0
    for tensor in tensors:
        tensor = tensor.detach()
        _update_header(digest, tensor)
        flat = tensor.to("cpu").contiguous().reshape(-1)
        # uint8 view: works for every dtype, bfloat16 included, which numpy cannot represent.
        payload = flat.view(torch.uint8).numpy() if flat.numel() else b""
        digest.update(struct.pack("<Q", flat.numel() * flat.element_size()))
        digest.update(payload)
        count += 1
    digest.update(struct.pack("<Q", count))
    return digest.hexdigest()


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


def state_sha256(params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], *,
                 params_sha: str | None = None) -> str:
    """The digest peers publish and donors serve: SHA-256 over ``params_sha256`` of the parameters and
    ``params_sha256`` of the outer momentum (zeros when the outer optimizer keeps none), so a donor cannot
    pair honest parameters with a hostile momentum. Synchronised peers hold both bitwise equal: the same outer
    step on the same inputs. Built from the two digests so that a caller that hashed the parameters already
    (``params_sha``, the round's one pass over them) adds only the momentum's pass."""
    digest = hashlib.sha256(_STATE_DOMAIN)
    digest.update(bytes.fromhex(params_sha if params_sha is not None else params_sha256(params)))
    digest.update(bytes.fromhex(params_sha256(momentum)))
    return digest.hexdigest()
