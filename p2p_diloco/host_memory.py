"""Give freed model-sized buffers back to the operating system at once (glibc's allocator).

glibc serves allocations above a threshold with their own ``mmap`` and returns them with ``munmap`` when
freed; below it, from the heap, which keeps freed memory. The threshold starts at 128 KiB but rises to the
size of every mmapped block freed (up to 32 MiB), so after the first round most of a peer's per-tensor
buffers (a layer's weights, pseudo-gradient, momentum, the temporaries of the outer step) come from the heap,
and what they free stays resident. Worse, the averager and DHT processes are forked from the training
process: freed heap pages that are resident at fork time become private to the child as soon as the parent
reuses them. Measured on the ``small`` preset (benchmarks/memory.py), fixing the threshold saved about 12
bytes per parameter of proportional set size: the training process 846 -> 679 MiB, the averager process's
private memory 96 -> 15 MiB.

The cost: every allocation at or above the threshold maps fresh zeroed pages, and a CPU training step
allocates many (activations, gradients). Measured on the ``tiny`` preset (batch 16 x 128, one thread): 3.1 M
minor page faults and about 6 s of system time over 33 steps at 128 KiB, against 0.2 M and under 1 s with
glibc's own threshold or 4 MiB (BENCHMARKS.md, "Against hivemind.Optimizer"): about 0.15 s added to a step
of about 0.35 s. So the threshold depends on where the step runs (:func:`threshold_for`):

- a CUDA peer's step allocates on the GPU (CUDA's caching allocator), and its host holds the long-lived
  model-sized buffers only: 128 KiB, the full saving;
- a CPU peer's step allocates its temporaries on the host, each step: 4 MiB, above the ``tiny`` preset's
  step tensors, still below a model-sized buffer of any preset meant for real use (at 1B parameters one layer's
  matrix is 16 MiB and more), at the price of the smaller per-tensor buffers of small presets staying in the
  heap (benchmarks/memory.py measures it).

glibc's own settings win: with ``MALLOC_MMAP_THRESHOLD_`` or ``glibc.malloc.mmap_threshold`` in
``GLIBC_TUNABLES`` in the environment nothing is changed, so an operator (or a benchmark) chooses another
value without a flag. Nothing happens on other C libraries (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Mapping

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
DEFAULT_THRESHOLD = 128 * 1024
"""glibc's own initial value; fixing it (any explicit value) also turns off its dynamic raising."""
CPU_THRESHOLD = 4 * 1024 * 1024
"""A CPU peer's: above its step's temporaries, below any model-sized buffer that matters (module docstring)."""


def threshold_for(device_type: str) -> int:
    """The threshold for a peer whose training step runs on ``device_type`` (``torch.device.type``)."""
    return DEFAULT_THRESHOLD if device_type == "cuda" else CPU_THRESHOLD


def set_in_environment(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment already fixes glibc's threshold (then it is left as the operator set it)."""
    env = os.environ if env is None else env
    return "MALLOC_MMAP_THRESHOLD_" in env or "glibc.malloc.mmap_threshold" in env.get("GLIBC_TUNABLES", "")


def return_freed_memory(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Serve allocations of ``threshold`` bytes or more with their own mappings, for good; call it before the
    model is built and before any process is forked. True when the C library took the setting; False when it
    was not set (another C library, or the environment chose its own: :func:`set_in_environment`)."""
    if not sys.platform.startswith("linux"):
        return False
    if set_in_environment():
        logger.info("glibc's mmap threshold is set in the environment; left as it is")
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1
    if not ok:
        logger.debug("mallopt(M_MMAP_THRESHOLD) was refused; freed memory may stay in the heap")
    return ok


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def trim_before_fork() -> bool:
    """Give the heap's free pages back to the operating system (glibc's ``malloc_trim(0)``); call it right
    before forking. Buffers below the threshold live in the heap; when they are freed (a tensor moved to shared
    memory leaves its private copy behind) their pages stay resident, a forked child inherits them, and once
    the parent reuses them each page becomes the child's private copy. Measured on the ``small`` preset with
    a CPU peer's 4 MiB threshold: the DHT and averager processes held 27.5 bytes/param without this call, 18.7
    with it, 15.2 at 128 KiB (BENCHMARKS.md, "Host memory"). Costs one walk over the heap, once per start.
    True when glibc did it."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
