"""Where the averager process finds the all-reduce of a group: hivemind's ``_running_groups``, group id ->
future runner, and its ``_pending_groups_registered`` event.

hivemind registers a runner once it exists. Here each round registers futures for its all-reduce and its
completion check before either starts, and sets them when the runners are built, so a fast groupmate's first
message waits for the runner instead of being turned away. hivemind's shutdown expects runners in this
registry; ``RoundAverager._shutdown`` finalizes ours (:func:`finalize`) and hands it an empty one.

Functions of the registry they are given, not methods of the averager: the registry and the event are
hivemind's, made in the averager process (their names are in ``tests/unit/test_hivemind_internals.py``).

Each registered future is a :class:`RunnerSlot`: hivemind's ``rpc_aggregate_part`` awaits it unshielded, and a
plain future is cancelled by the first waiter whose handler is cancelled (its sender died or closed its stream
while the runner was being built), which ended every other sender's handler waiting with it in
``CancelledError``: live groupmates lost their stream to this reducer and were banned from its parts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator, Iterator
from typing import Any

from hivemind.averaging.group_info import GroupInfo

from p2p_diloco.swarm.completion import STATUS_SUFFIX


class RunnerSlot(asyncio.Future[Any]):
    """The future of one group's runner, which a waiter's cancellation does not cancel.

    ``await slot`` waits through ``asyncio.shield``: a cancelled waiter ends alone, and the slot stays pending
    for the others until the runner is set (:func:`set_runner`) or the registry itself cancels it
    (:func:`registered`, :func:`finalize`), which still ends every waiter."""

    def __await__(self) -> Generator[Any, None, Any]:
        if self.done():
            return super().__await__()
        return asyncio.shield(self).__await__()

    __iter__ = __await__


def finalize(groups: dict[bytes, Any]) -> None:
    """Finalize every runner built (cancelling its all-reduce) and cancel every future still waiting for one."""
    for future in groups.values():
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().finalize(cancel=True)
        else:
            future.cancel()


def runners_of(groups: dict[bytes, Any], group_info: GroupInfo) -> list[Any]:
    """The runners built so far for this round's group (for the log of a round that ran out of time)."""
    futures = (groups.get(group_info.group_id + suffix) for suffix in (b"", STATUS_SUFFIX))
    return [f.result() for f in futures if f is not None and f.done() and not f.cancelled() and not f.exception()]


@contextlib.contextmanager
def registered(groups: dict[bytes, Any], pending: asyncio.Event, group_info: GroupInfo) -> Iterator[None]:
    """Register the round's all-reduce and its completion check before either starts, so a fast groupmate's
    first message never finds us unprepared; release waiters of whatever did not run. ``pending`` is set
    whenever the registry changed (hivemind's handlers wait on it for a group they do not know yet)."""
    group_ids = (group_info.group_id, group_info.group_id + STATUS_SUFFIX)
    try:
        for group_id in group_ids:
            groups[group_id] = RunnerSlot()
        pending.set()
        yield
    finally:
        for group_id in group_ids:
            future = groups.pop(group_id, None)
            if future is not None and not future.done():
                future.cancel()
        pending.set()


def set_runner(groups: dict[bytes, Any], key: bytes, runner: Any) -> None:
    """Hand ``runner`` to the handlers waiting for group ``key`` (registered by :func:`registered`).

    A slot that is done already (cancelled from outside the registry) is replaced, so that ``set_result``
    cannot raise ``InvalidStateError`` and end this member's round with its group unnamed; handlers that
    arrive from then on find the runner."""
    if groups[key].done():
        groups[key] = RunnerSlot()
    groups[key].set_result(runner)
