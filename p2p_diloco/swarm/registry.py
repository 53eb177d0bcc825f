"""Where the averager process finds the all-reduce of a group: ``_running_groups``, group id -> future runner.

hivemind registers a runner once it exists. Here each round registers futures for its all-reduce and its
completion check before either starts, and sets them when the runners are built, so a fast groupmate's first
message waits for the runner instead of being turned away. hivemind's shutdown expects runners in this
registry; ``_shutdown`` hands it an empty one after finalizing ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from hivemind.averaging.group_info import GroupInfo

from p2p_diloco.swarm.completion import STATUS_SUFFIX

logger = logging.getLogger(__name__)


class GroupRegistryMixin:
    """Mixed into ``RoundAverager`` ahead of hivemind's ``DecentralizedAverager``."""

    _running_groups: dict[bytes, Any]
    _pending_groups_registered: asyncio.Event
    is_alive: Callable[[], bool]  # multiprocessing.Process's, through hivemind's DecentralizedAverager

    def shutdown(self) -> None:
        """hivemind's shutdown, quiet when the averager process has stopped already.

        A SIGTERM sent to the whole process group (systemd, ``docker stop`` with an init, a terminal's
        Ctrl+C) reaches the averager process too, and it may be gone before the host's own shutdown runs;
        hivemind logs that as an error with a traceback, which here is the normal way to stop.
        """
        if not self.is_alive():
            logger.debug("The averager process had stopped already")
            return
        super().shutdown()  # type: ignore[misc]

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind's shutdown, given the runners it expects: our registry holds futures of runners (see
        ``_register_allreduce_group``), and hivemind's loop over it would fail at the first one."""
        groups, self._running_groups = self._running_groups, {}
        for future in groups.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)
            else:
                future.cancel()
        await super()._shutdown(timeout)  # type: ignore[misc]

    def _runners_of(self, group_info: GroupInfo) -> list[Any]:
        """The runners built so far for this round's group (for the log of a round that ran out of time)."""
        futures = (self._running_groups.get(group_info.group_id + suffix) for suffix in (b"", STATUS_SUFFIX))
        return [f.result() for f in futures if f is not None and f.done() and not f.cancelled() and not f.exception()]

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo) -> Iterator[None]:
        """Register the round's all-reduce and its completion check before either starts, so a fast
        groupmate's first message never finds us unprepared; release waiters of whatever did not run."""
        group_ids = (group_info.group_id, group_info.group_id + STATUS_SUFFIX)
        try:
            for group_id in group_ids:
                self._running_groups[group_id] = asyncio.Future()
            self._pending_groups_registered.set()
            yield
        finally:
            for group_id in group_ids:
                future = self._running_groups.pop(group_id, None)
                if future is not None and not future.done():
                    future.cancel()
            self._pending_groups_registered.set()
