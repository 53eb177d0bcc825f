"""The commands the training process sends to the averager process, as types.

``RoundAverager`` is a hivemind ``DecentralizedAverager``: a ``multiprocessing.Process`` whose background loop
reads ``(method name, args, kwargs)`` from a pipe and runs ``getattr(self, name)(*args, **kwargs)``. Ours cross
it as one of the dataclasses below, always under the one name :data:`DISPATCH` (``RoundAverager._run_command``
hands it to ``AveragerProcess.run_command``, which looks the handler up by the command's type in its one table,
``AveragerProcess.COMMANDS``), so what the training
side may ask of the averager process is this module, and a misspelt or mistyped command fails where it is built
(a dataclass without that field), not as an ``AttributeError`` in the other process. hivemind's own commands
(its ``_shutdown`` and the state requests it sends itself) keep its names.

Each carries an ``MPFuture`` the averager process resolves; tensors travel as shared-memory handles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging.control import StepControl
from hivemind.utils import MPFuture

DISPATCH = "_run_command"
"""The method name every command of ours is sent under (``RoundAverager._run_command``)."""


@dataclass
class Step:
    """Run one round (``round_process.RoundProcess.step``): matchmaking, plan, all-reduce."""

    step: StepControl
    future_for_init: MPFuture
    due: tuple[str, ...]
    allreduce_timeout: float
    stale: list[torch.Tensor] | None
    step_back: bool
    epoch: int | None
    """The round's epoch (with fragments, the fragment's): it declares under the key of its round's number
    (``protocol.use_round_key``, ``BufferLayout.round_number``)."""
    fragment: int = 0
    """With fragments (``buffer_layout.BufferLayout``), the one this round averages; 0 without."""


@dataclass
class GiveUp:
    """Stop looking for the running round's group, if none has formed yet (the swarm moved past its epoch).

    The averager process decides, on the loop where groups form (``round_process.RoundProcess.step``):
    before a group formed the search stops and the round's result says ``left_behind``; once one formed the
    request is refused and the round runs to its result, which the training side then applies like any other.
    A training side that dropped a round its process had joined left that group's other members with an update
    this peer never applied: the group split. ``future`` resolves to whether a search was running to ask."""

    future: MPFuture


@dataclass
class Ban:
    """Ban a peer for the rest of the run in the averager process (matchmaking, all-reduce, state serving)."""

    peer_id: str
    reason: str
    future: MPFuture


@dataclass
class FetchManifests:
    """Each donor's raw state manifest (or, with ``base``, its update's), at most ``max_bytes``."""

    peers: list[str]
    timeout: float
    max_bytes: int
    base: str | None
    future: MPFuture


@dataclass
class FetchChunks:
    """The chunks of state ``sha`` not in ``have``, each checked against ``digests``, into ``dest``."""

    peers: list[str]
    sha: str
    dest: list[torch.Tensor]
    n_params: int
    digests: bytes
    have: list[int]
    partial: str | None
    timeout: float
    future: MPFuture


Command = Step | GiveUp | Ban | FetchManifests | FetchChunks


def send(pipe: Any, command: Command) -> None:
    """Send ``command`` to the averager process through hivemind's command pipe (its ``_outer_pipe``)."""
    pipe.send((DISPATCH, [command], {}))
