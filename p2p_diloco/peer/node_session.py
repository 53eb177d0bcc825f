"""One swarm peer for a node of several ranks: rank 0's :class:`SwarmSession`, wrapped for all ranks.

Every rank of the node runs ``run_peer``'s loop with a :class:`NodeSession` in place of the
:class:`SwarmSession`, calling the same contract in the same order; each method that needs the other ranks
is a collective. Rank 0 alone holds the anchors, the outer optimizer and the swarm (DHT, all-reduce, state
serving); the others never see the swarm::

    start()       rank 0 joins the swarm (or resumes, or downloads the swarm's state once); then it
                  broadcasts epoch, inner step, data ids and positions, and the parameters
    local_steps() rank 0's DyLU count, broadcast: every rank runs the same number of inner steps
    end_round()   the ranks' inner stats are combined (samples and tokens summed, the slowest rank's time);
                  FSDP2 gathers the full parameters to rank 0; rank 0 runs the round policy on them; it
                  broadcasts the outcome and, unless the round was skipped, the new parameters; every rank
                  checks its parameters hash to rank 0's (:meth:`NodeModel.check_identical`)
    state_dict()  every rank's data position gathered to rank 0, which writes the checkpoint

The round policy (``core/``) and the swarm session are unchanged: the node is one peer whose inner phase
happens to be data-parallel. Its published speed, its weight (samples of all ranks) and its DyLU steps
count the whole node. A rank that fails a collective raises :class:`NodeError`; torchrun stops the others.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from p2p_diloco.core.rounds import Outcome, RoundReport
from p2p_diloco.data.loader import DataPosition
from p2p_diloco.inner_stats import InnerStats
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.peer.node import NodeError, NodeGroup
from p2p_diloco.peer.node_model import NodeModel
from p2p_diloco.peer.report import SessionListener
from p2p_diloco.peer.session import DataStream, SwarmSession
from p2p_diloco.swarm import SwarmStartError

logger = logging.getLogger(__name__)

OUTCOMES = list(Outcome)
"""Outcomes travel between ranks as their index here."""


def rank_data_id(data_id: str, rank: int) -> str:
    """The data shard rank ``rank`` of a node reads: rank 0 reads the peer's own (as a one-GPU peer would),
    rank r > 0 a shard of its own, found by the same hash walk (:mod:`p2p_diloco.data.loader`)."""
    return data_id if rank == 0 else f"{data_id}/rank{rank}"


def combine_stats(rows: list[list[float]]) -> InnerStats:
    """The node's inner phase from each rank's ``[steps, samples, tokens, seconds, mean_loss, last_loss]``:
    the same steps, samples and tokens summed, the slowest rank's time, losses averaged over ranks."""
    n = len(rows)
    return InnerStats(steps=int(rows[0][0]), samples=int(sum(r[1] for r in rows)),
                      tokens=int(sum(r[2] for r in rows)), seconds=max(r[3] for r in rows),
                      mean_loss=sum(r[4] for r in rows) / n, last_loss=sum(r[5] for r in rows) / n)


class NodeSession:
    """The :class:`SwarmSession` contract for every rank of a node; see the module docstring.

    Args:
        cfg: the peer's configuration (the same on every rank).
        group: the node's process group.
        model: the node's model (DDP or FSDP2) and rank 0's full parameters.
        lead: rank 0's swarm session, built on ``model.full``; None on the other ranks.
    """

    def __init__(self, cfg: PeerConfig, group: NodeGroup, model: NodeModel, lead: SwarmSession | None) -> None:
        if group.lead != (lead is not None):
            raise ValueError("rank 0, and only rank 0, runs the swarm session")
        self.cfg, self.group, self.model, self.lead = cfg, group, model, lead
        self.rank = group.rank
        self.rounds_done = 0
        self.inner_step = 0
        self.epoch = 0
        self.peer_id = ""
        self.data_id = ""
        self.data_position: DataPosition | None = None
        self._resume_positions: list[dict[str, int]] | None = None  # set by load_state_dict
        self._stream: DataStream | None = None

    # ------------------------------------------------------------------ state

    @property
    def done(self) -> bool:
        return bool(self.cfg.run.max_rounds) and self.rounds_done >= self.cfg.run.max_rounds

    @property
    def writes_checkpoints(self) -> bool:
        return self.lead is not None

    @property
    def fingerprint(self) -> str:
        return self.lead.fingerprint if self.lead else ""

    @property
    def served_downloads(self) -> int:
        return self.lead.served_downloads if self.lead else 0

    def params_sha256(self) -> str:
        return self.lead.params_sha256() if self.lead else ""

    def visible_maddrs(self) -> list[str]:
        return self.lead.visible_maddrs() if self.lead else []

    def add_listener(self, listener: SessionListener) -> None:
        if self.lead:
            self.lead.add_listener(listener)

    def bind_data(self, stream: DataStream) -> None:
        self._stream = stream
        if self.lead:
            self.lead.bind_data(stream)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rank 0: resume from a checkpoint (before :meth:`start`); the other ranks get it in :meth:`start`."""
        if self.lead is None:
            raise ValueError("only rank 0 of a node loads checkpoints")
        positions = state.get("node_data_positions") or []
        if not isinstance(positions, list):
            raise ValueError(f"node_data_positions must be a list, got {type(positions).__name__}")
        for p in positions:
            DataPosition.from_dict(p if isinstance(p, dict) else {"walk": -1})  # ValueError names it
        self.lead.load_state_dict(state)
        self._resume_positions = positions

    def _other_positions(self) -> list[dict[str, int]]:
        """Collective: the data positions of ranks 1..N-1 (every rank gets them)."""
        position = self._stream.position if self._stream is not None else (self.data_position or DataPosition())
        rows = self.group.all_gather_floats([position.walk, position.row], "gathering the data positions")
        return [{"walk": int(w), "row": int(r)} for w, r in rows[1:]]

    def state_dict(self) -> dict[str, Any]:
        """Collective: rank 0's session state plus every other rank's data position; ``{}`` on other ranks."""
        positions = self._other_positions()
        if self.lead is None:
            return {}
        state = self.lead.state_dict()
        state["node_data_positions"] = positions
        return state

    def save_in_background(self, write: Callable[[dict[str, Any]], None]) -> threading.Thread | None:
        """Collective: rank 0 runs ``write`` on its session's state (``SwarmSession.save_in_background``, from
        the live anchors) with the other ranks' data positions added; the other ranks only gather."""
        positions = self._other_positions()
        if self.lead is None:
            return None

        def write_node(state: dict[str, Any]) -> None:
            write({**state, "node_data_positions": positions})

        return self.lead.save_in_background(write_node)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Rank 0 joins the swarm; then every rank takes rank 0's state. Returns how the node started."""
        how, ok, values = "", 1, None
        if self.lead is not None:
            try:
                how = self.lead.start()
            except SwarmStartError:
                ok = 0
                self.group.broadcast_ints([0, 0, 0], 3, "telling the node rank 0 could not start")
                raise
            values = [ok, self.lead.epoch, self.lead.inner_step]
        ok, self.epoch, self.inner_step = self.group.broadcast_ints(
            values if self.lead else None, 3, "sharing rank 0's start")
        if not ok:
            raise NodeError(f"node rank {self.rank}: rank 0 could not join the swarm (see its output); every "
                            "rank stops")
        lead = self.lead
        self.peer_id = self.group.broadcast_text(lead.peer_id if lead else None, "sharing the peer id")
        base = self.group.broadcast_text(lead.data_id if lead else None, "sharing the data id")
        self.data_id = rank_data_id(base, self.rank)
        self.data_position = self._positions()
        self.model.scatter()
        self.model.check_identical()
        if lead:
            return how
        return f"rank {self.rank} of {self.group.world_size} of peer {self.peer_id}"

    def _positions(self) -> DataPosition:
        """Each rank's data position: rank 0's from its session, the others' from rank 0's checkpoint."""
        n = self.group.world_size
        flat: list[int] | None = None
        if self.lead is not None:
            own = self.lead.data_position or DataPosition()
            saved = self._resume_positions or []
            if self._resume_positions is not None and len(saved) != n - 1:
                logger.warning("The checkpoint was written by a node of %d rank(s), this one has %d: ranks beyond "
                               "the checkpoint's start their data shards from the beginning", len(saved) + 1, n)
            rest = [DataPosition.from_dict(saved[r - 1]) if r - 1 < len(saved) else DataPosition()
                    for r in range(1, n)]
            flat = [x for p in (own, *rest) for x in (p.walk, p.row)]
        values = self.group.broadcast_ints(flat, 2 * n, "sharing the data positions")
        return DataPosition(values[2 * self.rank], values[2 * self.rank + 1])

    def close(self) -> None:
        """Rank 0 leaves the swarm. The process group is left to the process's exit (``run_peer`` ends a rank with
        ``os._exit``): tearing it down here can deadlock (see :meth:`NodeGroup.close`), and no rank needs it
        after the loop."""
        if self.lead is not None:
            self.lead.close()

    # ------------------------------------------------------------------ per round

    def begin_round(self) -> None:
        if self.lead is not None:
            self.lead.begin_round()

    def local_steps(self) -> int:
        """Rank 0's step count (DyLU, from the node's published speed) on every rank."""
        steps = self.lead.local_steps() if self.lead else None
        return self.group.broadcast_ints([steps] if steps is not None else None, 1, "sharing the step count")[0]

    def on_inner_step(self, step: int, loss: float) -> None:
        self.inner_step += 1
        if self.lead is not None:
            self.lead.on_inner_step(step, loss)

    def end_round(self, stats: InnerStats) -> RoundReport:
        """The node's round: combine the ranks' work, rank 0 runs it with the swarm, every rank takes the result."""
        rows = self.group.all_gather_floats(
            [stats.steps, stats.samples, stats.tokens, stats.seconds, stats.mean_loss, stats.last_loss],
            "combining the inner phase's statistics")
        node_stats = combine_stats(rows)
        self.model.gather()
        self.rounds_done += 1
        report: RoundReport | None = None
        values = None
        if self.lead is not None:
            report = self.lead.end_round(node_stats)
            values = [OUTCOMES.index(report.outcome), report.epoch, report.new_epoch]
        index, epoch, new_epoch = self.group.broadcast_ints(values, 3, "sharing the round's outcome")
        outcome = OUTCOMES[index]
        if outcome is not Outcome.SKIPPED:  # skipped: nothing changed, every rank trains on from its own
            self.model.scatter()
        digest = self.model.check_identical()
        self.epoch = new_epoch
        if report is None:
            report = RoundReport(epoch=epoch, outcome=outcome, inner_steps=node_stats.steps,
                                 inner_seconds=node_stats.seconds, train_loss=node_stats.mean_loss,
                                 params_sha256=digest, new_epoch=new_epoch)
        return report
