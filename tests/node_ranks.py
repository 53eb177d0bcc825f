"""One rank of a 2-rank gloo node without a swarm, for tests/integration/test_node_parallel.py.

``python tests/node_ranks.py RANK PORT OUT``: trains the tiny model for a few inner steps with DDP, then with
FSDP2, on this rank's rows of fixed batches; rank 0 applies the outer step to the gathered parameters, every
rank takes them back and checks its digest; rank 0 writes the new anchors to OUT/{mode}.safetensors.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

from p2p_diloco.config import InnerConfig
from p2p_diloco.core.delayed import Contribution, StalenessPolicy, aggregate_round
from p2p_diloco.core.peer_state import OuterState

VOCAB, SEQ, STEPS, RANKS, PER_RANK = 128, 16, 3, 2, 2
MODES = ("ddp", "fsdp2")


def batches(rank: int | None) -> list[torch.Tensor]:
    """The global batch of each step (RANKS * PER_RANK rows); rank r reads its own rows of it."""
    g = torch.Generator().manual_seed(7)
    steps = [torch.randint(0, VOCAB, (RANKS * PER_RANK, SEQ), generator=g) for _ in range(STEPS)]
    return steps if rank is None else [b[rank * PER_RANK : (rank + 1) * PER_RANK] for b in steps]


def inner(batch_size: int) -> InnerConfig:
    # micro-batches of 1: the node's gradient sync on the last micro-batch only is exercised too
    return InnerConfig(batch_size=batch_size, micro_batch_size=1, lr=3e-3, warmup_steps=0, device="cpu")


def outer_step(state: OuterState, params: list[torch.Tensor]) -> None:
    delta = [t.clone() for t in state.pseudo_gradient(params)]
    samples = float(STEPS * PER_RANK * RANKS)
    state.apply(aggregate_round([Contribution(delta, samples, 0, "node")], StalenessPolicy()), params)


def main(rank: int, port: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(RANKS))
    torch.set_num_threads(1)
    from safetensors.torch import save_file

    from p2p_diloco.models import build_model
    from p2p_diloco.peer.node import NodeGroup, NodeLaunch
    from p2p_diloco.peer.node_model import NodeModel
    from p2p_diloco.swarm.checksum import params_sha256
    from p2p_diloco.trainer import InnerTrainer

    group = NodeGroup(NodeLaunch.from_env(), torch.device("cpu"), timeout_s=60)
    # The process group is left to the process's exit, as run_peer does (NodeGroup.close says why).
    for mode in MODES:
        node = NodeModel(build_model("tiny", VOCAB, SEQ, seed=0), mode, group)
        state = OuterState(node.full, lr=0.7, momentum=0.9, device="cpu") if group.lead else None
        InnerTrainer(node.module, inner(PER_RANK), batches(rank)).train_steps(STEPS)
        node.gather()
        if state is not None:
            outer_step(state, node.full)
        node.scatter()
        digest = node.check_identical()  # raises if any rank's parameters differ from rank 0's
        if state is not None:
            save_file({f"p{i}": a for i, a in enumerate(state.anchors)}, str(out / f"{mode}.safetensors"))
            (out / f"{mode}.sha256").write_text(f"{digest} {params_sha256(state.anchors)}")


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # no interpreter finalization: see p2p_diloco.peer.node.NodeGroup.close
