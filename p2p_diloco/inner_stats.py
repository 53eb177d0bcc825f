"""What one inner phase did: the record a trainer hands to the swarm session, metrics and logs.

Its own module so that the swarm side (session, report, metrics) names it without importing the trainer,
which pulls in transformers (about 180 MB and a second of start-up in every process that imports it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class InnerStats:
    """What one inner phase did."""

    steps: int
    samples: int
    tokens: int
    seconds: float
    mean_loss: float
    last_loss: float

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
