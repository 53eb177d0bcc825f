"""An ``AveragerProcess`` for unit tests: the averager process's side of ``RoundAverager``, made as ``run`` makes
it, with hivemind's parts (the host's state, the donors' stubs) given by the test."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import torch

from p2p_diloco.swarm.averager_process import AveragerProcess
from p2p_diloco.swarm.buffer_layout import BufferLayout
from p2p_diloco.swarm.chunk_transfer import ServingCounters
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.runner import no_faults

OWN_ID = "QmOwnPeerForTests"


async def _no_state() -> tuple[Any, Any, Any]:
    raise RuntimeError("this peer is not sharing state")


def process_for_tests(*, allowed: frozenset[str] | None = None, counters: ServingCounters | None = None,
                      host_state: Callable[[], Awaitable[tuple[Any, Any, Any]]] = _no_state,
                      sharing: Callable[[], bool] = lambda: False, stub: Callable[[str], Any] | None = None,
                      own_id: str = OWN_ID, layout: BufferLayout | None = None, **cfg: Any) -> AveragerProcess:
    """``cfg``: ``SwarmConfig`` fields; the rest as ``AveragerProcess`` takes them (default: a one-tensor layout)."""

    def no_stub(peer: str) -> Any:
        raise AssertionError(f"the test gave no stub, and {peer} was asked")

    return AveragerProcess(SwarmConfig(**cfg), own_id, layout or BufferLayout([((4,), torch.float32)]), allowed, None,
                           counters if counters is not None else ServingCounters(), host_state=host_state,
                           sharing=sharing, stub=stub or no_stub, fault_hook=no_faults)
