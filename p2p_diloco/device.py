"""Device and precision selection, shared by training, evaluation and the preflight."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def select_device(requested: str = "auto") -> torch.device:
    """'auto' picks CUDA when present, else CPU; an explicit CUDA request without CUDA is an error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device: {requested!r} requested but this torch build has no CUDA "
                f"(torch {torch.__version__}); install the CUDA build of torch or pass --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device: {requested!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device: 'mps' requested but MPS is not available; pass --device cpu")
    return device


def autocast_dtype(device: torch.device, precision: str = "auto") -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32.

    bf16 autocast keeps master weights in fp32 (so the outer step and checksums see fp32) while matmuls
    run in bf16. We do not use fp16 autocast: it needs a gradient scaler and bf16 is on every GPU from
    Ampere on.
    """
    if precision == "fp32" or device.type != "cuda":
        if precision == "bf16" and device.type != "cuda":
            raise ValueError("precision: bf16 autocast needs a CUDA device; use --precision fp32 on CPU")
        return None
    if precision == "bf16" or torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
    else:
        with torch.autocast(device_type=device.type, dtype=dtype):
            yield
