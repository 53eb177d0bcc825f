"""What one averaging round produced for this peer: the contract between ``RoundAverager`` and the session."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoundResult:
    """What one round produced for this peer. Tensors are on the CPU, in the template's dtypes."""

    outcome: str
    """"averaged" (every member confirmed a complete all-reduce) or "skipped" (nothing to apply)."""
    reason: str
    """Why the round was skipped; empty when averaged."""
    epoch: int
    group_size: int = 0
    """Members the all-reduce ran over (0 when no group formed)."""
    contributors: tuple[str, ...] = ()
    """Base58 peer ids of those members, in the group's order; the tuples below are aligned with it."""
    weights: tuple[float, ...] = ()
    stale_weights: tuple[float, ...] = ()
    stalenesses: tuple[int, ...] = ()
    refused: tuple[str, ...] = ()
    """Members of the matched group left out, each as "peer id: reason"."""
    rejected: tuple[str, ...] = ()
    """Hostile or unauthorised input rejected at receipt, each as "peer id: reason" (implausible weight, NaN
    or wrong-shaped part, outlier norm, not an allowed peer); those peers are banned for the rest of the run."""
    fresh_mean: list[torch.Tensor] | None = None
    """Sum w_i D_i / sum w_i over members carrying fresh work."""
    stale_term: list[torch.Tensor] | None = None
    """Sum s_j E_j / sum w_i over members carrying stale work; ``None`` when nobody in the group did."""
    allreduce_seconds: float = 0.0
    wait_seconds: float = 0.0
    """Time spent finding the group (matchmaking)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    """Serialized protobuf payload of the all-reduce messages (see ``runner.ByteCounter``)."""

    @property
    def averaged(self) -> bool:
        return self.outcome == "averaged"
