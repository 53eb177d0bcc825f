"""Where the averager process finds the all-reduce of a group: hivemind's ``_running_groups``, group id ->
future runner, and its ``_pending_groups_registered`` event.

hivemind registers a runner once it exists. Here each round registers futures for its all-reduce and its
completion check before either starts, and sets them when the runners are built, so a fast groupmate's first
message waits for the runner instead of being turned away. hivemind's shutdown expects runners in this
registry; ``RoundAverager._shutdown`` finalizes ours (:func:`finalize`) and hands it an empty one.

Functions of the registry they are given, not methods of the averager: the registry and the event are
hivemind's, made in the averager process (their names are in ``tests/unit/test_hivemind_internals.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from hivemind.averaging.group_info import GroupInfo

from p2p_diloco.swarm.completion import STATUS_SUFFIX


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
            groups[group_id] = asyncio.Future()
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

    hivemind's rpc_aggregate_part awaits this future unshielded: a sender's handler cancelled while it waited
    (the sender died, its stream closed) cancelled the future with it, and set_result raised
    InvalidStateError, ending this member's round with its group unnamed. Handlers that arrive from now on
    find the runner; the part of the one that died is missing, as it would be."""
    if groups[key].done():
        groups[key] = asyncio.get_running_loop().create_future()
    groups[key].set_result(runner)
