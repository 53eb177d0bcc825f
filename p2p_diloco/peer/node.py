"""A node of several GPUs as one swarm peer: its ranks and the ``torch.distributed`` collectives between them.

How a node is launched. ``torchrun --nproc-per-node N $(which run_peer) ...`` starts N processes (ranks) on
one machine and sets ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``) in
each one's environment; ``run_peer`` sees ``WORLD_SIZE`` > 1 and becomes one rank of a node
(:class:`NodeLaunch`). We use torchrun rather than a ``--nproc-per-node`` flag of our own because its
elastic agent already does what a node needs: it starts the ranks, forwards SIGINT/SIGTERM to all of them
and, when one rank dies, stops the others (SIGTERM, then SIGKILL) and exits non-zero, so no rank is left
behind.

What travels between ranks. Only tensors, through ``torch.distributed`` (gloo on CPU, NCCL on CUDA):
control integers, short strings as bytes, parameters and digests. Nothing is pickled (no ``*_object``
collectives). Every collective here is bounded by the process group's timeout (``--node-timeout-s``), and
a failed one raises :class:`NodeError` with the message the user sees, so a node stops as one.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TEXT_BYTES = 255
"""The longest string a node broadcasts (its length travels in one byte; a peer or data id is under 100)."""


_COLLECTIVE_ERROR = re.compile(r"gloo|NCCL|ProcessGroup|Connection (reset|closed)|Broken pipe", re.IGNORECASE)
"""What the backends' errors say when a rank's peer went away (gloo raises plain RuntimeErrors)."""


class NodeError(RuntimeError):
    """A node cannot go on: a rank left, hung or disagrees. The message says what happened and what to do."""


@dataclass(frozen=True)
class NodeLaunch:
    """Where this process stands in its node, from the variables torchrun sets."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def lead(self) -> bool:
        """Rank 0 runs the node's swarm session."""
        return self.rank == 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NodeLaunch | None:
        """The launch, or None for a plain process (no ``WORLD_SIZE``, or 1). ``ValueError`` names a bad value."""
        env = os.environ if environ is None else environ
        if env.get("WORLD_SIZE", "1") == "1":
            return None
        values = {}
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            raw = env.get(name)
            if raw is None or not raw.isdigit():
                raise ValueError(f"environment variable {name}={raw!r} is not a non-negative integer; start a "
                                 "multi-GPU node with torchrun --nproc-per-node N $(which run_peer) ...")
            values[name] = int(raw)
        launch = cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
        if launch.rank >= launch.world_size:
            raise ValueError(f"RANK={launch.rank} is not below WORLD_SIZE={launch.world_size}")
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                raise ValueError(f"environment variable {name} is not set; start a multi-GPU node with torchrun "
                                 "--nproc-per-node N $(which run_peer) ..., which sets it")
        return launch


class NodeGroup:
    """The node's process group and the few collectives a node needs, each raising :class:`NodeError`.

    Args:
        launch: this rank's place in the node.
        device: this rank's training device; CUDA selects NCCL (collective tensors live on that GPU),
            anything else gloo.
        timeout_s: the longest one collective may wait for the other ranks.
    """

    def __init__(self, launch: NodeLaunch, device: torch.device, timeout_s: float) -> None:
        self.launch, self.device = launch, device
        self.rank, self.world_size = launch.rank, launch.world_size
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        # NCCL moves only CUDA tensors; gloo moves CPU tensors.
        self.comm_device = device if device.type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with self.collective("joining the node's process group"):
            dist.init_process_group(self.backend, timeout=timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)
        self._open = True

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Turn a failed collective inside the block into :class:`NodeError`."""
        try:
            yield
        except (RuntimeError, ValueError) as e:  # DistBackendError, DistNetworkError, timeouts are RuntimeErrors
            if isinstance(e, NodeError):
                raise
            raise self.failure(what, e) from None

    def failure(self, what: str, error: BaseException) -> NodeError:
        """The error a rank reports when ``what`` failed with ``error`` (a collective of the node)."""
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
        return NodeError(f"node rank {self.rank}: {what} failed ({first[:300]}); another rank of this node stopped "
                         "or hung (see its output). Every rank stops; restart the node with --resume")

    @staticmethod
    def is_collective_failure(error: BaseException) -> bool:
        """``error`` (raised while training: DDP's and FSDP2's own collectives) came from the process group."""
        if isinstance(error, dist.DistError):
            return True
        return isinstance(error, RuntimeError) and bool(_COLLECTIVE_ERROR.search(str(error)))

    # ------------------------------------------------------------------ collectives

    def broadcast_ints(self, values: Sequence[int] | None, n: int, what: str) -> list[int]:
        """Rank 0's ``n`` integers on every rank (others pass None)."""
        t = torch.zeros(n, dtype=torch.int64, device=self.comm_device)
        if self.lead:
            assert values is not None and len(values) == n
            t.copy_(torch.tensor(list(values), dtype=torch.int64))
        with self.collective(what):
            dist.broadcast(t, src=0)
        return [int(x) for x in t.cpu().tolist()]

    def broadcast_text(self, text: str | None, what: str) -> str:
        """Rank 0's short string on every rank."""
        t = torch.zeros(TEXT_BYTES + 1, dtype=torch.uint8, device=self.comm_device)
        if self.lead:
            data = (text or "").encode()[:TEXT_BYTES]
            t[: len(data) + 1].copy_(torch.tensor([len(data), *data], dtype=torch.uint8))
        with self.collective(what):
            dist.broadcast(t, src=0)
        raw = bytes(t.cpu().tolist())
        return raw[1 : 1 + raw[0]].decode(errors="replace")

    def broadcast_(self, tensor: torch.Tensor, what: str) -> None:
        """Overwrite ``tensor`` with rank 0's, in place (staged through the comm device if it lives elsewhere)."""
        with self.collective(what):
            if tensor.device == self.comm_device:
                dist.broadcast(tensor, src=0)
            else:
                staged = tensor.detach().to(self.comm_device)
                dist.broadcast(staged, src=0)
                tensor.copy_(staged)

    def all_gather_floats(self, values: Sequence[float], what: str) -> list[list[float]]:
        """Every rank's ``values`` (float64), in rank order, on every rank."""
        mine = torch.tensor(list(values), dtype=torch.float64, device=self.comm_device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self.collective(what):
            dist.all_gather(out, mine)
        return [t.cpu().tolist() for t in out]

    def all_gather_digests(self, hexdigest: str, what: str) -> list[str]:
        """Every rank's sha256 hex digest, in rank order."""
        mine = torch.tensor(list(bytes.fromhex(hexdigest)), dtype=torch.uint8, device=self.comm_device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self.collective(what):
            dist.all_gather(out, mine)
        return [bytes(t.cpu().tolist()).hex() for t in out]

    def close(self) -> None:
        """Destroy the process group (idempotent; never raises: the node may already be broken).

        Only for a process that goes on without it. With gloo, destroying it (or freeing a DDP reducer that
        holds it) joins gloo's worker thread while holding the GIL, and that thread, releasing the tensors of
        a collective that just finished, may be waiting for the GIL: the process hangs (seen here, at random).
        A rank that is about to exit should just exit (``run_peer`` uses ``os._exit``)."""
        if not self._open:
            return
        self._open = False
        try:
            dist.destroy_process_group()
        except Exception as e:  # a rank already gone: nothing left to tear down cleanly
            logger.debug("destroy_process_group: %s", e)
