"""The model as a node's ranks train it (DDP replicas or FSDP2 shards) and the full parameters rank 0 averages.

Bytes per parameter, on top of what one GPU's training needs (fp32 parameters):

- ``ddp``: every rank holds the whole model, its gradients and AdamW's moments on its GPU (about 16 B/param
  per GPU). Rank 0's swarm session works on rank 0's live parameters, as a single-GPU peer does; nothing is
  gathered, since all ranks' parameters are equal. Each round rank 0 broadcasts the new parameters
  (4 B/param over the node's interconnect) and every rank hashes its own to check they agree.
- ``fsdp2``: each rank holds 1/N of the parameters, gradients and moments (about 16/N B/param per GPU, plus
  one transformer block gathered at a time). Rank 0 keeps a full fp32 copy of the parameters in host memory
  (``full``: 4 B/param) that its swarm session works on. Once per round the shards are gathered into it one
  tensor at a time, and after the outer step it is scattered back (each rank receives only its shard).

Every rank also builds the full model in host memory once, before sharding (4 B/param per rank, freed as
the shards move to the GPU).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator

import torch
from torch import nn

from p2p_diloco.peer.node import NodeError, NodeGroup
from p2p_diloco.swarm import params_sha256

logger = logging.getLogger(__name__)


class NodeModel:
    """Wraps ``model`` for the node's data-parallel inner phase and moves full parameters to and from rank 0.

    Args:
        model: the full model, built identically (same seed) on every rank; FSDP2 shards it in place.
        mode: ``ddp`` or ``fsdp2`` (see :class:`p2p_diloco.peer.config.NodeConfig`).
        group: the node's process group.

    Attributes:
        module: what the inner trainer trains (a ``DistributedDataParallel`` wrapper, or the sharded model).
        full: on rank 0, the full parameters its swarm session reads and writes; None on other ranks.
    """

    def __init__(self, model: nn.Module, mode: str, group: NodeGroup) -> None:
        self.mode, self.group = mode, group
        device = group.device
        if mode == "fsdp2":
            try:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard
            except ImportError:
                raise ValueError(f"--node-parallel fsdp2 needs torch 2.6 or newer (this is {torch.__version__}); "
                                 "upgrade torch or use --node-parallel ddp") from None

            # Copied before sharding: the copy is exact, and no gather is needed to start.
            self.full = [p.detach().to("cpu", copy=True) for p in model.parameters()] if group.lead else None
            mesh = init_device_mesh(device.type, (group.world_size,))
            blocks = set(getattr(model, "_no_split_modules", None) or [])
            units = [m for m in model.modules() if type(m).__name__ in blocks]
            if not units:
                logger.warning("No transformer blocks found to shard one by one (_no_split_modules); the whole "
                               "model is one FSDP2 unit, so every rank gathers all of it in each forward")
            for unit in units:
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.module: nn.Module = model
        elif mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model.to(device)
            # The models have no trained buffers; syncing them each forward would only cost time (newer torch
            # names the switch forward_sync_buffers; both still sync them once, when wrapping).
            params = inspect.signature(DistributedDataParallel).parameters
            no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
            self.module = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None, **no_sync)
            self.full = list(model.parameters()) if group.lead else None
        else:
            raise ValueError(f"node parallel mode must be ddp or fsdp2, got {mode!r}")
        self.params = list(model.parameters())

    @torch.no_grad()
    def gather(self) -> None:
        """Make rank 0's ``full`` the node's current parameters (collective; a no-op for DDP)."""
        if self.mode != "fsdp2":
            return
        with self.group.collective("gathering the parameters to rank 0"):
            for i, p in enumerate(self.params):
                whole = p.full_tensor()
                if self.full is not None:
                    self.full[i].copy_(whole)
                del whole

    @torch.no_grad()
    def scatter(self) -> None:
        """Make every rank's parameters rank 0's ``full`` (collective; after an outer step or a download)."""
        if self.mode != "fsdp2":
            for p in self.params:
                self.group.broadcast_(p, "broadcasting the new parameters")
            return
        from torch.distributed.tensor import distribute_tensor

        with self.group.collective("scattering the new parameters"):
            for i, p in enumerate(self.params):
                if self.full is not None:
                    whole = self.full[i].to(p.device)
                else:  # the contents are ignored: rank 0 sends each rank its shard
                    whole = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                shard = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=0)
                p.to_local().copy_(shard.to_local())
                del whole, shard

    def _whole(self) -> Iterator[torch.Tensor]:
        for p in self.params:
            yield p.full_tensor() if self.mode == "fsdp2" else p

    def check_identical(self) -> str:
        """Every rank's parameters hash to rank 0's full parameters' digest (collective); returns that digest.

        Raises :class:`NodeError` naming the ranks that differ: the node stops before anything else is applied
        (a restart with ``--resume`` starts every rank from rank 0's checkpoint).
        """
        with self.group.collective("hashing the parameters"):
            mine = params_sha256(self._whole())
        digests = self.group.all_gather_digests(mine, "comparing the parameters' digests")
        expected = digests[0]
        if self.full is not None and self.mode == "fsdp2":
            expected = params_sha256(self.full)
        expected = self.group.broadcast_text(expected, "sharing rank 0's digest")
        differ = [rank for rank, d in enumerate(digests) if d != expected]
        if differ:
            raise NodeError(f"node rank {self.group.rank}: the parameters of rank(s) {differ} differ from rank 0's "
                            f"after the outer step (digest {expected[:16]}); every rank stops. Restart the node with "
                            "--resume; report this if it happens again")
        return expected
