"""Matchmaking timing: a follower outlasts its leader, so a leader never counts in a follower that left.

hivemind's follower gives up on its leader at its own declared expiration plus ``request_timeout``, or at its
search deadline, whichever comes first. The leader sends BEGIN_ALLREDUCE at *its* expiration (never later than
the follower's) plus the time it waits for ``lock_request_join_group``, which its own join request to a
higher-priority peer may hold for up to ``request_timeout``, plus any stall of its event loop. Peers that start
a round together declare expirations milliseconds apart, and in the last window of a search everyone's
expiration is capped at the same deadline, so a stall of a few hundred milliseconds is enough: the follower
leaves, the leader counts it in, every member's all-reduce waits for a groupmate that never comes, and the
round is lost for the whole group. On a loaded 2-core machine this cost a round in about one full test-suite
run out of three.

``JoinTiming`` gives followers ``patience`` seconds more than any leader can take, with four small changes to
the hivemind objects of one averager process:

- A follower's join request carries its declared expiration plus ``patience``, so it waits for BEGIN_ALLREDUCE
  until declared expiration + ``patience`` + ``request_timeout``. The leader takes ``patience`` off again
  before hivemind's admission check (``leader_view``), so who may lead whom is unchanged.
- The search (declarations and leader lookups) ends ``patience`` before the step's deadline, and the step's
  wait for a group lasts until that deadline. A leader's last expiration therefore comes at least
  ``patience`` before its followers stop waiting.
- Declarations stop at the end of the search. Left alone, hivemind would re-declare an already expired
  entry in a tight loop for as long as the step still waits.
- A leader turns away a join request that waited for its lock longer than half the follower's wait for an
  answer. That follower may have left, and accepting it would count in a member that is gone.
- A leader keeps a follower's join stream open after BEGIN_ALLREDUCE until the follower closes it
  (``hold_until_follower_closes``). hivemind closes a handler's stream as soon as its last message is written,
  and the p2p daemon pipes a stream with two copies that each reset it when the other side errs
  (``doStreamPipe``): closed right behind BEGIN_ALLREDUCE, the stream was reset while that message was still
  in flight, and a follower whose daemon had not yet read it saw the stream end (``StopAsyncIteration``),
  searched on and found no group, while the leader counted it in. Seen on loopback with 3 peers, in a CI run
  and in 1 of 2 runs of the single-round swarm tests: the leader's daemon logged "stream reset" in the
  millisecond it assembled, every other member's all-reduce waited ``next_chunk_timeout_s`` for that follower,
  and the round was lost for the whole group. The follower reads exactly two messages and then closes its
  end, so the hold costs an idle coroutine for a few milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import cancel_and_wait

PATIENCE_PER_REQUEST_TIMEOUT = 2.0
"""``patience = 2 * request_timeout_s``: one lock hold by the leader's own join request, plus as long again
for a stalled event loop on either side."""

ANSWER_FRACTION = 0.5
"""A leader that took this fraction of ``request_timeout_s`` to get to a join request turns it away. The
follower waits ``request_timeout_s`` for the answer, counted from before the request reached the leader's
handler; the other half covers that delay (the p2p daemon, a busy event loop). Lower values turn more
followers away from a leader that is itself busy asking another one, higher ones risk answering a follower
that has left."""


class JoinTiming:
    """Matchmaking patience of one averager; see the module docstring.

    :param request_timeout: the averager's ``request_timeout`` (``SwarmConfig.request_timeout_s``).
    """

    def __init__(self, request_timeout: float):
        self.patience = PATIENCE_PER_REQUEST_TIMEOUT * request_timeout
        self.hold_s = self.patience
        """Longest a leader holds a follower's join stream open after BEGIN_ALLREDUCE (module docstring)."""
        self.answer_within = ANSWER_FRACTION * request_timeout
        self._arrivals: dict[int, float] = {}  # id of a join request under admission -> when it arrived

    def install(self, matchmaking: Matchmaking) -> None:
        """Apply the changes to ``matchmaking`` (once; it lives as long as the averager process)."""
        if getattr(matchmaking, "_join_timing", None) is self:
            return
        leaders = matchmaking.potential_leaders
        declared = matchmaking.get_request_expiration_time
        matchmaking.get_request_expiration_time = lambda: declared() + self.patience
        matchmaking._check_reasons_to_reject = self._in_time(matchmaking._check_reasons_to_reject)
        leaders.begin_search = self._search_ends_early(leaders, leaders.begin_search)
        leaders._declare_averager_periodically = self._declare_until_search_end(
            leaders, leaders._declare_averager_periodically
        )
        matchmaking._join_timing = self

    async def hold_until_follower_closes(self) -> None:
        """Return when the follower closed its join stream, or after ``hold_s`` (a follower that died).

        The close arrives as a cancellation: hivemind's stream handler cancels the handler task once the
        remote end is closed. Nothing else waits for this: hivemind's matchmaking counts a follower as
        discarded when its ``rpc_join_group`` ends, before this hold begins."""
        await asyncio.sleep(self.hold_s)  # bounded; ended early by the cancellation

    def deadline(self, search_seconds: float) -> float:
        """DHT-time deadline of a step whose search lasts ``search_seconds`` from now."""
        return get_dht_time() + search_seconds + self.patience

    def scheduled_time(self, now: float, window_s: float, deadline: float, client_mode: bool) -> float:
        """The ``StepControl.scheduled_time`` of a step that starts ``now``: the end of its first window, or,
        for a peer in client mode, the end of its search (``deadline - patience``, what hivemind caps a join
        request's expiration at anyway). Never the deadline itself: hivemind warns of a step scheduled at or
        after its deadline that "averaging will likely fail due to timeout", every round, also in rounds that
        average.

        hivemind's leader turns away a follower whose join request expires before the leader's own declared
        window ends (``BAD_EXPIRATION_TIME``), and the follower does not ask that leader again until it declares
        anew, when its window ends and it forms the group with whoever joined. A request expires at the end of
        the follower's window, or ``min_matchmaking_time`` (the window's floor with adaptive deadlines) after it
        is sent, whichever is later; so with a window grown above its floor, a follower that began its round
        before the leader was turned away. A full peer arriving a few milliseconds before the leader is not
        hurt: hivemind lets it lead, and the later one joins it. A client
        never leads, so each time it arrived a moment before the only full peer (they finish their inner steps
        together) it was turned away, and joined at the leader's next declaration or not at all (measured behind
        a real NAT: the leader's "every due peer joined" came at 8.03 s of an 8 s window, and in 1 round of 6 a
        client searched 12 s and was left behind). A request that expires at the end of the client's search
        is accepted by any leader whose window ends before it; the client still waits only until its deadline.
        """
        return deadline - self.patience if client_mode else now + window_s

    @contextlib.contextmanager
    def leader_view(self, request: averaging_pb2.JoinRequest) -> Iterator[averaging_pb2.JoinRequest]:
        """``request`` as hivemind's admission check must see it: the follower's own expiration, and its
        arrival time noted for the lock-wait check."""
        view = averaging_pb2.JoinRequest()
        view.CopyFrom(request)
        view.expiration = request.expiration - self.patience
        self._arrivals[id(view)] = time.monotonic()
        try:
            yield view
        finally:
            self._arrivals.pop(id(view), None)

    def _in_time(self, check: Callable[..., Any]) -> Callable[..., Any]:
        def check_in_time(request: averaging_pb2.JoinRequest, context: P2PContext) -> Any:
            arrived = self._arrivals.get(id(request))
            if arrived is not None and time.monotonic() - arrived > self.answer_within:
                return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_EXPIRATION_TIME)
            return check(request, context)

        return check_in_time

    def _search_ends_early(self, leaders: Any, begin_search: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.asynccontextmanager
        async def begin_search_early(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            async with begin_search(*args, **kwargs) as search:
                # set before the search's background tasks first run: nothing was awaited since it was read
                leaders.search_end_time -= self.patience
                yield search

        return begin_search_early

    @staticmethod
    def _declare_until_search_end(leaders: Any, declare: Callable[..., Any]) -> Callable[..., Any]:
        async def declare_until_search_end(*args: Any, **kwargs: Any) -> None:
            task = asyncio.create_task(declare(*args, **kwargs))
            end = leaders.search_end_time
            try:
                await asyncio.wait_for(asyncio.shield(task), max(0.0, end - get_dht_time()) if math.isfinite(end) else None)
            except asyncio.TimeoutError:
                pass
            finally:
                await cancel_and_wait(task)

        return declare_until_search_end
