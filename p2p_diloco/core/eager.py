"""Eager outer updates: hide the all-reduce of round t behind the inner steps of round t+1.

Kale, Douillard, Donchev (arXiv 2502.12996). At the end of round t, peer m of M:

1. computes its own fresh pseudo-gradient ``Δ_m(t)``,
2. launches the all-reduce of ``Δ_m(t)`` in the background (its result is used next round),
3. waits for ``Δ(t-1)``, the average launched one round earlier, and steps with::

       Δ̃_m(t) = Δ(t-1) + (Δ_m(t) − Δ_m(t-1)) / M
              = (Δ_m(t) + Σ_{m'≠m} Δ_{m'}(t-1)) / M

   i.e. its own term is fresh and the others' are one round old,
4. starts round t+1 from the result at once.

Decisions:

* **First round** (no earlier average): ``Δ(0) = 0`` and ``Δ_m(0) = 0``, so
  ``Δ̃_m(1) = Δ_m(1) / M``. The peer moves by its own share only; nobody else's work exists yet.
* **Round t-1's average failed or was skipped** (pass ``prev_group_avg=None``): the same
  rule, ``Δ̃_m(t) = Δ_m(t) / M``. The other peers' round t-1 work is lost, which DiLoCo
  tolerates well (dropping half the outer gradients cost about 2% perplexity). A partial
  average (fewer peers than planned) must also be passed as None, never as the full one:
  its own-term share is not 1/M, so the correction above would subtract the wrong amount.
* **Unequal weights**: pass ``own_share = w_m / Σ w`` of the round t-1 average instead of
  relying on 1/M.

Peers keep their own outer state, so their parameters differ by the small own-term
difference; the swarm resynchronises them when it downloads state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from p2p_diloco.core.outer import OuterOptimizer
from p2p_diloco.core.pseudograd import check_same_shapes

__all__ = ["PREV_OWN_KEY_PREFIX", "EagerOuterStep"]

logger = logging.getLogger(__name__)

PREV_OWN_KEY_PREFIX = "eager.prev_own."


class EagerOuterStep:
    """Keeps ``Δ_m(t-1)`` between rounds and turns fresh work into the eager pseudo-gradient."""

    def __init__(self) -> None:
        self._prev_own: list[Tensor] | None = None

    @property
    def has_previous(self) -> bool:
        """True once an own pseudo-gradient from an earlier round is stored."""
        return self._prev_own is not None

    def reset(self) -> None:
        """Forget the previous own term (e.g. after the peer downloaded a new state)."""
        self._prev_own = None

    @torch.no_grad()
    def outer_delta(
        self,
        own_fresh: Sequence[Tensor],
        prev_group_avg: Sequence[Tensor] | None,
        group_size: int,
        *,
        own_share: float | None = None,
    ) -> list[Tensor]:
        """Return ``Δ̃_m(t)`` and remember ``Δ_m(t)`` for the next round.

        Args:
            own_fresh: ``Δ_m(t)``, this peer's pseudo-gradient of the round that just ended.
            prev_group_avg: ``Δ(t-1)``, the complete average launched last round; None in the
                first round or when that average failed or covered only part of the group.
            group_size: M, the number of peers in the average ``prev_group_avg`` (in the
                fallback case: in the all-reduce just launched).
            own_share: this peer's weight fraction in that average; defaults to 1/M.

        Raises:
            ValueError: on bad sizes or shapes, or when ``prev_group_avg`` is given but no
                own term from the previous round is stored (the correction is impossible;
                pass None instead).
        """
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
        share = 1.0 / group_size if own_share is None else float(own_share)
        if not (math.isfinite(share) and 0.0 < share <= 1.0):
            raise ValueError(f"own_share must be in (0, 1], got {own_share}")
        fresh = [t.detach().to(dtype=torch.float32) for t in own_fresh]
        if self._prev_own is not None:
            check_same_shapes(self._prev_own, fresh, "own_fresh")

        if prev_group_avg is None:
            if self._prev_own is not None:
                logger.info("no complete average from the previous round; stepping with the own term only")
            result = [f.mul(share) for f in fresh]
        else:
            if self._prev_own is None:
                raise ValueError(
                    "prev_group_avg given but no own pseudo-gradient from the previous round is stored; "
                    "pass prev_group_avg=None for the first round after (re)joining"
                )
            check_same_shapes(fresh, prev_group_avg, "prev_group_avg")
            result = []
            for f, old, avg in zip(fresh, self._prev_own, prev_group_avg, strict=True):
                term = f.sub(old.to(f.device))
                term.mul_(share).add_(avg.to(device=f.device, dtype=torch.float32))
                result.append(term)

        # Copy: the caller may reuse its pseudo-gradient buffers while the background
        # all-reduce of Δ_m(t) is still in flight.
        if self._prev_own is None:
            self._prev_own = [f.clone() for f in fresh]
        else:
            for stored, f in zip(self._prev_own, fresh, strict=True):
                stored.copy_(f)
        return result

    def step(
        self,
        outer: OuterOptimizer,
        own_fresh: Sequence[Tensor],
        prev_group_avg: Sequence[Tensor] | None,
        group_size: int,
        *,
        own_share: float | None = None,
    ) -> list[Tensor]:
        """Compute ``Δ̃_m(t)`` (see :meth:`outer_delta`), feed it to ``outer`` and return it."""
        delta = self.outer_delta(own_fresh, prev_group_avg, group_size, own_share=own_share)
        outer.step(delta)
        return delta

    def state_tensors(self) -> dict[str, Tensor]:
        """``{"eager.prev_own.{i}": tensor}`` copies on the CPU; empty before the first round."""
        if self._prev_own is None:
            return {}
        return {
            f"{PREV_OWN_KEY_PREFIX}{i}": t.detach().to("cpu", copy=True) for i, t in enumerate(self._prev_own)
        }

    def load_state_tensors(self, tensors: Mapping[str, Tensor], like: Sequence[Tensor] | None = None) -> None:
        """Restore from :meth:`state_tensors` output; keys with other prefixes are ignored.

        ``like`` (e.g. the anchors) gives the expected shapes and the device to load onto.
        No entry resets the state. Nothing changes when validation fails.

        Raises:
            ValueError: on gaps in the indices, wrong count or shapes, non-fp32 or non-finite data.
        """
        loaded: dict[int, Tensor] = {}
        for key, tensor in tensors.items():
            if not key.startswith(PREV_OWN_KEY_PREFIX):
                continue
            suffix = key[len(PREV_OWN_KEY_PREFIX) :]
            if not suffix.isdigit():
                raise ValueError(f"unexpected eager state key {key!r}")
            if tensor.dtype != torch.float32:
                raise ValueError(f"{key}: dtype {tensor.dtype}, expected torch.float32")
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{key}: holds NaN or infinite values")
            loaded[int(suffix)] = tensor
        if not loaded:
            self._prev_own = None
            return
        if sorted(loaded) != list(range(len(loaded))):
            raise ValueError(f"eager state indices are not 0..{len(loaded) - 1}")
        ordered = [loaded[i] for i in range(len(loaded))]
        if like is not None:
            check_same_shapes(like, ordered, "eager state")
            self._prev_own = [
                t.to(device=ref.device, copy=True) for t, ref in zip(ordered, like, strict=True)
            ]
        else:
            self._prev_own = [t.clone() for t in ordered]

