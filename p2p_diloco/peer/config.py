"""A swarm peer's configuration: the local training settings plus the swarm's."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p_diloco.config import TrackingConfig, TrainConfig
from p2p_diloco.swarm.config import SwarmConfig

ROUNDS_OF_WORK = 4
"""The default ``max_round_weight`` is this many rounds of ``batch_size x local_steps`` samples: room for an
honest peer's work carried over a few skipped rounds, and the most any one member can weigh in a group."""


@dataclass
class PeerConfig(TrainConfig):
    """Everything ``run_peer`` takes; each leaf field is also a flag, an env variable and a file key."""

    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

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
