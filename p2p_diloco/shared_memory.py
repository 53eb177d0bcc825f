"""The host tensors a peer shares with its forked processes: what they cost in ``/dev/shm``, and sharing them
before the fork.

A peer's DHT and averager run in processes forked from the training process (hivemind's ``mp.Process``).
The averager reads the anchors and momentum (it serves them to joiners) and the shared pseudo-gradient
buffer, so those live in shared memory: torch puts a CPU tensor there (``share_memory_``, one file in
``/dev/shm`` per tensor) when it is first handed to another process. That makes ``/dev/shm`` a limit a
volunteer can hit: Docker gives a container 64 MiB of it unless told otherwise, and a write past a full
``/dev/shm`` kills the process with SIGBUS instead of raising. ``check_room`` turns that into an error that
names the fix before anything is shared.

Why share *before* the fork: fork gives each child a copy-on-write view of the parent's private memory. A
page the parent writes after the fork (a CPU peer's weights at every inner step, the anchors at every outer
step) or frees (a model's CPU copy moved to the GPU) then stays in every child as a private copy that the
child never reads. Measured on the ``small`` preset (benchmarks/memory.py), the forked processes held about
9 bytes per parameter of such copies. Shared memory is shared by fork, not copied.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch itself is not imported: run_peer doctor reads this module before it loads torch
    import torch

logger = logging.getLogger(__name__)

SHM_PATH = "/dev/shm"
"""Where glibc's ``shm_open`` (and so torch's shared CPU tensors) keeps its files on Linux."""

SHARED_BYTES_PER_PARAM = 12
"""Shared memory a peer holds all the time, per parameter: anchors (4), outer momentum (4) and the averager's
pseudo-gradient buffer (4), all fp32."""

SHARED_PEAK_EXTRA_PER_PARAM = 16
"""More shared memory for a while, per parameter: a state download's parameters and momentum until they are
verified and loaded (8), plus, when the swarm moved on during the download, the round update applied to it
(``swarm.catchup``: the fresh mean, 4, and the late-work term of a round that folded late work, 4); or, in a
round that folds late work, that work's buffer (4). Sized for the worst: a full ``/dev/shm`` is a SIGBUS."""

CPU_WEIGHTS_BYTES_PER_PARAM = 4
"""A CPU peer's weights go to shared memory too (see the module docstring): 4 more per parameter."""


def shared_bytes(parameters: int, *, weights_on_cpu: bool, peak: bool) -> int:
    """Bytes of ``/dev/shm`` a peer of ``parameters`` parameters needs, steady or at its peak."""
    per_param = SHARED_BYTES_PER_PARAM + (SHARED_PEAK_EXTRA_PER_PARAM if peak else 0)
    per_param += CPU_WEIGHTS_BYTES_PER_PARAM if weights_on_cpu else 0
    return per_param * parameters


def shm_free_bytes(path: str = SHM_PATH) -> int | None:
    """Free bytes in ``path``; None where it does not exist (not Linux: nothing to check)."""
    if not os.path.isdir(path):
        return None
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def shm_fix(need: int) -> str:
    gib = max(1, -(-need // 2**30))
    return (f"give {SHM_PATH} at least {gib} GiB: in Docker `--shm-size={gib}g` (its default is 64 MiB), "
            f"elsewhere `mount -o remount,size={gib}G {SHM_PATH}`, or pick a smaller --model")


def check_room(parameters: int, *, weights_on_cpu: bool, already_shared: int = 0) -> str | None:
    """Why ``/dev/shm`` cannot hold this peer's shared tensors (None when it can, or cannot be checked).

    A shortfall for the steady need is an error: the peer would die of SIGBUS at its first write past the
    limit. A shortfall only at the peak (a state download) is logged as a warning, since a peer that never
    resyncs does not reach it. ``already_shared``: bytes of those tensors this process shared already."""
    free = shm_free_bytes()
    if free is None:
        return None
    free += already_shared
    steady = shared_bytes(parameters, weights_on_cpu=weights_on_cpu, peak=False)
    peak = shared_bytes(parameters, weights_on_cpu=weights_on_cpu, peak=True)
    if free < steady:
        return (f"{SHM_PATH} has {free / 2**30:.2f} GiB free, and this peer's shared tensors need "
                f"{steady / 2**30:.2f} GiB ({peak / 2**30:.2f} GiB while it downloads the swarm's state); "
                + shm_fix(peak))
    if free < peak:
        logger.warning("%s has %.2f GiB free: enough for this peer's shared tensors (%.2f GiB) but not for a "
                       "state download (%.2f GiB), which would kill the peer; %s", SHM_PATH, free / 2**30,
                       steady / 2**30, peak / 2**30, shm_fix(peak))
    return None


def share_before_fork(tensors: Iterable[torch.Tensor]) -> int:
    """Move the CPU ones of ``tensors`` to shared memory, in place (the tensor objects stay the same); returns
    the bytes moved. Call it before forking a process that does not need its own copy of them."""
    moved = 0
    for tensor in tensors:
        if tensor.device.type == "cpu" and not tensor.is_shared():
            tensor.share_memory_()
            moved += tensor.numel() * tensor.element_size()
    return moved
