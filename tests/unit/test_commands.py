"""The training process's commands to the averager process (swarm.commands): one table, typed fields, and every
handler takes exactly its command's fields."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import typing

from p2p_diloco.swarm import commands
from p2p_diloco.swarm.averager import RoundAverager


def test_every_command_has_one_handler_that_takes_exactly_its_fields() -> None:
    assert set(RoundAverager.COMMANDS) == set(typing.get_args(commands.Command))
    for kind, name in RoundAverager.COMMANDS.items():
        handler = getattr(RoundAverager, name)
        assert inspect.iscoroutinefunction(handler), f"{name} runs in the averager process's event loop"
        params = inspect.signature(handler).parameters
        fields = {f.name for f in dataclasses.fields(kind)}
        required = {p for p, v in params.items() if p != "self" and v.default is inspect.Parameter.empty}
        assert required <= fields <= set(params) - {"self"}, (kind.__name__, name)


def test_a_command_crosses_the_pipe_under_the_one_dispatch_name_and_reaches_its_handler() -> None:
    sent = []

    class Pipe:
        def send(self, message: object) -> None:
            sent.append(message)

    command = commands.Ban("peer", "malformed record", future=None)  # type: ignore[arg-type]
    commands.send(Pipe(), command)
    assert sent == [(commands.DISPATCH, [command], {})]
    ran = []

    class Averager:
        COMMANDS = {commands.Ban: "_ban_requested"}

        async def _ban_requested(self, peer_id: str, reason: str, future: object) -> None:
            ran.append((peer_id, reason))

    method, args, kwargs = sent[0]
    asyncio.run(getattr(RoundAverager, method)(Averager(), *args, **kwargs))  # hivemind's loop does this
    assert ran == [("peer", "malformed record")]
