"""The member's side of the all-reduce: every averaged part a reducer sends back is checked on receipt.

A reducer is just another peer, and hivemind takes whatever it replies as the average of its span. Here each
part must have the shape and dtype of the part we sent, hold only finite values, and keep the reducer's
output, summed over each region (fresh or stale tensors) of its span, within ``core.bounds.output_bound``.
Every member derives that bound from the same gathered metadata and an honest reducer sends every member the
same bytes, so all honest members agree on a verdict. Once a reducer fails the check, its parts are counted
as not averaged (zeros take their place, as in hivemind's handling of a failed reducer), which makes the round
partial: it is skipped by every member that sees it, and the reducer is banned for the run. The reducer's
stream is still read to its end and our own parts still go out to it, so the all-reduce ends on time for
everyone instead of stalling on an abandoned stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from hivemind.averaging.partition import TensorPartContainer

from p2p_diloco.swarm.reducer import check_part

logger = logging.getLogger(__name__)


def part_regions(container: TensorPartContainer, peer_index: int, fresh_tensors: int) -> list[int]:
    """Per part that ``peer_index`` reduces: 0 for a fresh tensor's part, 1 for a stale one's.

    hivemind keys each part's compression info by the index of its tensor, and the all-reduce layout puts the
    ``fresh_tensors`` fresh tensors first.
    """
    return [int(info.key >= fresh_tensors) for _, info in container._input_parts_by_peer[peer_index]]


class AverageCheck:
    """Checks the averaged parts a group's reducers send us (see the module docstring).

    :param container: the runner's ``TensorPartContainer``; our input parts give the expected shapes.
    :param peer_ids: base58 ids in the group's order.
    :param me: our index in ``peer_ids`` (our own reducer's output is not checked).
    :param bounds: the largest honest output norm in the fresh and the stale region.
    :param fresh_tensors: how many of the all-reduce's tensors are fresh.
    """

    def __init__(
        self,
        container: TensorPartContainer,
        peer_ids: Sequence[str],
        me: int,
        bounds: tuple[float, float],
        fresh_tensors: int,
    ) -> None:
        self.container, self.peer_ids, self.me, self.bounds = container, tuple(peer_ids), me, bounds
        self.regions = [part_regions(container, i, fresh_tensors) for i in range(len(peer_ids))]
        self.spent = [[0.0, 0.0] for _ in peer_ids]
        self.failed: dict[str, str] = {}
        """``{reducer id: reason}`` for every reducer whose output failed the check."""

    def install(self) -> None:
        """Check every averaged part as hivemind registers it; refused parts are registered as zeros and
        counted in the container's ``failed_size``."""
        register: Callable[[int, int, torch.Tensor], None] = self.container.register_processed_part

        def checked(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            if self.check(peer_index, part_index, part) is None:
                return register(peer_index, part_index, part)
            expected = self.container._input_parts_by_peer[peer_index][part_index][0]
            register(peer_index, part_index, torch.zeros_like(expected))
            self.container.failed_size += expected.numel()

        self.container.register_processed_part = checked  # type: ignore[method-assign]

    def check(self, peer_index: int, part_index: int, part: torch.Tensor) -> str | None:
        """Why reducer ``peer_index``'s averaged part ``part_index`` is unacceptable, or ``None``; every part
        of a reducer that already failed is unacceptable."""
        reducer = self.peer_ids[peer_index]
        if peer_index == self.me:
            return None
        if reducer in self.failed:
            return self.failed[reducer]
        expected = self.container._input_parts_by_peer[peer_index][part_index][0]
        problem = check_part(part, expected.shape, expected.dtype)
        if problem is None:
            region = self.regions[peer_index][part_index]
            self.spent[peer_index][region] += float(torch.linalg.vector_norm(part.double())) ** 2
            if self.spent[peer_index][region] > self.bounds[region] ** 2:
                problem = (
                    f"averaged {('fresh', 'stale')[region]} parts reach norm "
                    f"{self.spent[peer_index][region] ** 0.5:.4g}, above the {self.bounds[region]:.4g} "
                    "any honest reducer can send"
                )
        if problem is not None:
            self.failed[reducer] = f"reducer sent {problem}"
            logger.warning("Refusing the averages of reducer %s: %s", reducer, self.failed[reducer])
        return problem
