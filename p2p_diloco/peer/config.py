"""A swarm peer's configuration: the local training settings plus the swarm's and its node's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from p2p_diloco.config import TrackingConfig, TrainConfig
from p2p_diloco.swarm.config import SwarmConfig

ROUNDS_OF_WORK = 4
"""The default ``max_round_weight`` is this many rounds of ``batch_size x local_steps`` samples: room for an
honest peer's work carried over a few skipped rounds, and the most any one member can weigh in a group."""


@dataclass
class NodeConfig:
    """A node of several GPUs as one peer (``torchrun --nproc-per-node N $(which run_peer) ...``).

    Read only when ``run_peer`` runs under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment); a plain
    ``run_peer`` is a node of one rank and ignores these.
    """

    parallel: Literal["ddp", "fsdp2"] = field(default="ddp", metadata={"flag": "node-parallel"})
    """How the node's ranks share the inner phase: 'ddp' (every rank holds the whole model, about 16 bytes per
    parameter; the fastest when that fits one GPU) or 'fsdp2' (parameters, gradients and AdamW moments sharded
    over the ranks, for models that do not fit). See peers/README.md#9-a-node-of-several-gpus-one-peer."""
    timeout_s: float = field(default=1800.0, metadata={"flag": "node-timeout-s"})
    """How long a rank waits in one collective of the node before the node stops, 60-86400 s: it bounds a rank
    that hangs (one that dies ends the node at once). It must exceed the longest rank 0 can spend on the swarm
    in a round (matchmaking, all-reduce and a state download), which the check at start states."""

    def __post_init__(self) -> None:
        if self.parallel not in ("ddp", "fsdp2"):
            raise ValueError(f"parallel: must be ddp or fsdp2, got {self.parallel!r}")
        if not 60 <= self.timeout_s <= 86400:
            raise ValueError(f"timeout_s: must be in [60, 86400] s, got {self.timeout_s}")


def swarm_wait_bound_s(swarm: SwarmConfig) -> float:
    """The longest rank 0 of a node talks to the swarm between two of the node's collectives: matchmaking
    (with the followers' patience), the all-reduce, then a state download if the round says resync."""
    return (swarm.matchmaking_timeout_s + 2 * swarm.request_timeout_s + swarm.allreduce_timeout_s
            + swarm.state_download_timeout_s)


@dataclass
class PeerConfig(TrainConfig):
    """Everything ``run_peer`` takes; each leaf field is also a flag, an env variable and a file key."""

    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    node: NodeConfig = field(default_factory=NodeConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        # One run id for both layers: it names the data seed, the DHT keys and the matchmaking prefix.
        self.swarm.run_id = self.run.run_id
        if self.swarm.max_round_weight is None:
            self.swarm.max_round_weight = float(ROUNDS_OF_WORK * self.inner.batch_size * self.outer.local_steps)
        if self.swarm.client_mode and not self.swarm.initial_peers:
            raise ValueError(
                "swarm.client_mode: a client-mode peer cannot start a swarm (nobody can dial it, and it reduces "
                "no parts for others); pass --initial-peers of a running swarm with full peers, or leave "
                "--client-mode off on the swarm's first peer"
            )
        bound = swarm_wait_bound_s(self.swarm)
        if self.node.timeout_s <= bound:
            raise ValueError(
                f"node.timeout_s: {self.node.timeout_s:.0f} s is not above the {bound:.0f} s rank 0 may spend on "
                "the swarm in one round (matchmaking_timeout_s + 2 * request_timeout_s + allreduce_timeout_s + "
                "state_download_timeout_s); raise --node-timeout-s or lower those timeouts"
            )
