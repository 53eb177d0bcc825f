"""The training process's commands to the averager process (swarm.commands): one table, typed fields, and every
handler takes exactly its command's fields."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import typing

from p2p_diloco.swarm import commands
from p2p_diloco.swarm.averager import RoundAverager
from p2p_diloco.swarm.averager_process import AveragerProcess
from tests.averager_process import process_for_tests


def test_every_command_has_one_handler_that_takes_exactly_its_fields() -> None:
    assert set(AveragerProcess.COMMANDS) == set(typing.get_args(commands.Command))
    for kind, name in AveragerProcess.COMMANDS.items():
        handler = getattr(AveragerProcess, name)
        assert inspect.iscoroutinefunction(handler), f"{name} runs in the averager process's event loop"
        params = set(inspect.signature(handler).parameters) - {"self"}
        if kind is commands.Step:
            params -= {"side"}  # hivemind's side of the round, added in the averager process
        assert params == {f.name for f in dataclasses.fields(kind)}, (kind.__name__, name)


def test_a_command_crosses_the_pipe_under_the_one_dispatch_name_and_reaches_its_handler() -> None:
    sent = []

    class Pipe:
        def send(self, message: object) -> None:
            sent.append(message)

    class Future:
        def set_result(self, value: object) -> None:
            sent.append(("resolved", value))

    command = commands.Ban("peer", "malformed record", future=Future())  # type: ignore[arg-type]
    commands.send(Pipe(), command)
    assert sent == [(commands.DISPATCH, [command], {})]
    process = process_for_tests()

    class Averager:  # the averager as its process sees it: its side made there
        def _side(self) -> AveragerProcess:
            return process

        def _hivemind_side(self) -> None:
            raise AssertionError("only a round reads hivemind's side")

    method, args, kwargs = sent[0]
    asyncio.run(getattr(RoundAverager, method)(Averager(), *args, **kwargs))  # hivemind's loop does this
    assert process.gate.banned == {"peer": "malformed record"} and sent[-1] == ("resolved", None)


def test_a_running_command_outlives_the_garbage_collector_although_hivemind_keeps_no_reference_to_it() -> None:
    """hivemind's loop starts each command with ``asyncio.create_task`` and drops the task; asyncio holds it
    only weakly. A command whose await reaches the loop only through a future nobody else holds (a DHT call's
    ``MPFuture``) is then a cycle of garbage: the collector took a round so, mid-search, and that peer never
    searched again (``AveragerProcess.run_command``)."""
    import gc
    import weakref

    process = process_for_tests()
    refs: list[weakref.ref] = []

    async def orphaned_give_up(future: object) -> None:
        refs.append(weakref.ref(asyncio.current_task()))
        await asyncio.get_running_loop().create_future()  # held by this frame alone, like a DHT call's MPFuture

    process._give_up = orphaned_give_up  # type: ignore[method-assign]

    async def scenario() -> tuple[bool, bool]:
        asyncio.create_task(process.run_command(commands.GiveUp(future=None), lambda: None))  # type: ignore[arg-type]
        for _ in range(100):  # the command runs up to its await
            if refs:
                break
            await asyncio.sleep(0.01)
        gc.collect()
        task = refs[0]() if refs else None
        if task is None:
            return False, False
        task.cancel()  # it still ends as hivemind ends it, at shutdown
        await asyncio.gather(task, return_exceptions=True)
        return True, task.cancelled()

    alive, ended = asyncio.run(scenario())
    assert alive, "the collector took a running command"
    assert ended
