"""``run_peer`` with gates: the peer stops after its first inner step of a given epoch until a file exists, so a
test paces it by events it saw (other peers' round records), not by sleeping steps. Usage, as
``python -m p2p_diloco.cli.run_peer``: ``python tests/swarm_helpers/gated_peer.py ARGS...`` with
``P2P_TEST_GATES="EPOCH=PATH;EPOCH=PATH"`` (``swarm_procs.start_peer(gates=...)`` sets both). The gates act
through ``peer.faults.FaultPlan.after_inner_step``, so the peer needs ``P2P_DILOCO_FAULTS`` set (any fault,
e.g. ``start_together``); each gate waits at most ``GATE_MAX_S`` and logs when it opens."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from p2p_diloco.cli import run_peer
from p2p_diloco.peer.faults import FaultPlan

ENV = "P2P_TEST_GATES"
GATE_MAX_S = 180.0
"""Longest a gate holds its peer: then it goes on, and the test's own assertions say what went wrong."""

logger = logging.getLogger("gated_peer")


def _gates(text: str) -> dict[int, Path]:
    return {int(epoch): Path(path) for epoch, _, path in (item.partition("=") for item in text.split(";") if item)}


def install(gates: dict[int, Path]) -> None:
    """Make every ``FaultPlan`` of this process stop at the gates (once each)."""
    after_inner_step = FaultPlan.after_inner_step

    def gated(plan: FaultPlan) -> None:
        after_inner_step(plan)
        path = gates.pop(int(plan._epoch.value), None)
        if path is None:
            return
        began = time.monotonic()
        while not path.exists() and time.monotonic() - began < GATE_MAX_S:
            time.sleep(0.05)
        logger.warning("Test gate of epoch %d %s after %.1f s", plan._epoch.value,
                       "opened" if path.exists() else "gave up", time.monotonic() - began)

    FaultPlan.after_inner_step = gated  # type: ignore[method-assign]


if __name__ == "__main__":
    install(_gates(os.environ.get(ENV, "")))
    sys.exit(run_peer.main(sys.argv[1:]))
