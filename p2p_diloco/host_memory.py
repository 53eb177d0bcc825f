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

The cost: every large tensor allocation maps fresh zeroed pages, a few percent of a CPU step at most, none on
a GPU (CUDA has its own caching allocator). Nothing happens on other C libraries (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
DEFAULT_THRESHOLD = 128 * 1024
"""glibc's own initial value; fixing it (any explicit value) also turns off its dynamic raising."""


def return_freed_memory(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Serve allocations of ``threshold`` bytes or more with their own mappings, for good; call it before the
    model is built and before any process is forked. True when the C library took the setting."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1
    if not ok:
        logger.debug("mallopt(M_MMAP_THRESHOLD) was refused; freed memory may stay in the heap")
    return ok
