"""A group forms as soon as every live peer due this round has joined; the window is only for stragglers.

hivemind's leader waits out its whole declared window (``matchmaking_time_s``) unless the group reaches
``target_group_size``. That size is a cap chosen for the largest expected swarm (32 by default), so a
smaller swarm never reaches it and EVERY round waits the full window, even when every peer joined in the
first second: two peers on loopback with H = 20 spent 15 s of each ~18 s round waiting. With eager
overlap the same window sits between the launch of a background all-reduce and its result, so a short
inner phase waited for it too.

``DuePeers`` is what this peer can verify about who is due: the signed, unexpired progress records of this
run and model (``records.fetch_progress``: signature, schema and expiry checked at receipt and on reading)
whose epoch is within one of the round's epoch ``e``: ``e`` (training for this round), ``e + 1`` (an eager
peer launches its all-reduce of ``e`` after stepping to ``e + 1``) or ``e - 1`` (a peer that missed the last
round: it downloads the state of ``e`` and trains for this round, arriving a download later than the
others). Leaving the last out made such a peer chase the swarm: with rounds no longer padded by the window,
the others finished every round before its download and inner phase were done (measured in
``tests/integration/test_peer_swarm.py``: a peer slowed for one round resynced in each of the next seven). ``EarlyAssembly`` runs beside hivemind's
matchmaking in the averager process: whenever a follower is accepted, a leader whose group now holds every
due peer (and at least ``min_group_size`` members) assembles it at once, through the same
``leader_assemble_group`` hivemind calls when its window ends.

Why this cannot be abused:

- The set names peers, not a count. Joining peers that are not due (Sybils, strangers) never complete it;
  only the due peers themselves do.
- Records cost nothing to forge identities for, so a Sybil can inflate the set with peers that never join.
  The group then waits, as before, until the window ends: never longer, since this only ever ends the wait
  early, and hivemind's window and admission rules are untouched (nobody is turned away who would have been
  admitted, so the swarm is not split by it).
- A peer due this round whose record this leader has not read yet (it appeared within the last inner phase)
  can be left out of one round when the others are all in; its work is carried into the next round. The
  round reports it as ``cut`` only when it was expected; such an unseen peer is simply not in the group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)


def due_peers(records: Iterable[Any], epoch: int) -> frozenset[str]:
    """Peer ids (base58) of the progress records ``records`` that are due in the all-reduce of ``epoch``:
    record epochs ``epoch - 1`` to ``epoch + 1`` (see the module docstring). ``records`` are
    ``records.PeerProgress`` read and checked by ``Swarm.records``; client-mode peers count (they join groups
    as followers)."""
    return frozenset(r.peer_id for r in records if epoch - 1 <= r.epoch <= epoch + 1)


@dataclass
class Formed:
    """How this peer's group of one round came together (filled in the averager process)."""

    due: int = 0
    """Peers (this one included) verified due this round; 0 when nothing was known."""
    early: bool = False
    """This peer led the group and formed it before its window ended, every due peer having joined."""
    due_arrival_s: float | None = None
    """This peer leading: seconds from the start of the search until the last due peer among its followers
    joined (``RoundResult.due_arrival_s``)."""
    stepped_back: bool = False
    """This peer was alone when its first window ended and let the next due peer lead (``EarlyAssembly``)."""


STEP_BACK_LEAD_S = 0.5
"""A leader still alone this long before its first window ends steps back (:class:`EarlyAssembly`): hivemind
re-declares it when that window ends, with the scheduled time as it stands then. A quarter of the window when
that is shorter, so that a short window still leaves peers time to join before anyone steps back."""


class EarlyAssembly:
    """Ends a leader's matchmaking window once every due peer has joined; see the module docstring.

    **A peer that arrives early steps back.** hivemind's leader forms its group when its declared window
    ends, and a leader still alone then declares again for ``min_matchmaking_time`` (our window's floor), over
    and over. So a peer that arrived well before the others (a joiner that planned a short first phase, a
    peer whose speed estimate was off) led with a window that restarts every few seconds: the first due peer
    to join it was grouped within those seconds, and a due peer one second behind that was cut and had to
    download the state (measured: a joiner 20 s early led; peer 2 joined it and the group formed 1 s before
    peer 1 arrived). Now a leader still alone just before its first window ends moves its scheduled time to
    the end of its search, so that its next declaration is later than any newcomer's. hivemind lets a peer
    join only leaders declared to end before it, so the early peer becomes a follower of the next due peer
    to arrive, and the group's window counts from that peer's arrival, as for peers that arrive together.
    A peer that stepped back and still ends up leading (everyone arrived early and alone) forms its group
    one window after the first follower joined, or at once when every due peer is in.

    **Between stepping back and its next declaration it takes no follower** (``install``). Its declaration
    still ends at the end of its first window, and hivemind forms a leader's group when its declaration ends
    with whoever joined by then: a due peer that joined in those last moments was grouped with it alone, and
    the next due peer, arriving milliseconds later, was cut (measured, 3 peers on loopback, two arriving 2.8 s
    after the third: a group of 2 formed 10 ms after the first joined, and the other resynced). Turned away,
    the newcomers lead or follow each other, and the early peer joins them once it declared again.

    :param min_group_size: the averager's ``min_group_size``; a smaller group is never formed early.
    """

    def __init__(self, min_group_size: int):
        self.min_group_size = min_group_size
        self._joined: asyncio.Event | None = None  # made in the averager process's event loop
        self._stepped_back_from: float | None = None
        """The declared expiration this peer stepped back from (class docstring); ``None``: it did not."""

    def install(self, matchmaking: Any) -> None:
        """Make hivemind's admission check of ``matchmaking`` turn followers away while this peer's declaration
        is the one it stepped back from (once; it lives as long as the averager process). The check runs under
        ``lock_request_join_group``, as ``watch`` does when it steps back, so no request slips between them."""
        if getattr(matchmaking, "_early_assembly", None) is self:
            return
        check = matchmaking._check_reasons_to_reject
        leaders = matchmaking.potential_leaders

        def check_not_stepped_back(request: Any, context: Any) -> Any:
            if self._stepped_back_from is not None and leaders.declared_expiration_time == self._stepped_back_from:
                return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_EXPIRATION_TIME)
            return check(request, context)

        matchmaking._check_reasons_to_reject = check_not_stepped_back
        matchmaking._early_assembly = self

    def follower_joined(self) -> None:
        """Call whenever this peer, as a leader, accepted a follower."""
        if self._joined is not None:
            self._joined.set()

    async def watch(self, matchmaking: Any, me: str, due: Collection[str], formed: Formed,
                    step: Any = None) -> None:
        """Run beside ``matchmaking.look_for_group``; cancel it when the search ends. ``me`` is this peer's
        base58 id, ``due`` the verified due peers (``due_peers``), ``step`` the round's hivemind
        ``StepControl`` (its ``scheduled_time`` is the end of the first window; without it no stepping back)."""
        self._stepped_back_from = None
        due = frozenset(due) | {me}
        formed.due = len(due)
        if len(due) < self.min_group_size:
            return  # nobody else is known to be due: the window decides, as it always did
        began, arrived = time.monotonic(), set()
        first_window_end = step.scheduled_time if step is not None else None
        window_s = max(0.0, first_window_end - get_dht_time()) if first_window_end is not None else 0.0
        lead = min(STEP_BACK_LEAD_S, window_s / 4)
        viable_since: float | None = None  # stepped back, leading, and the group became big enough then
        joined = self._joined = self._joined or asyncio.Event()
        while True:
            if first_window_end is not None:
                wake: float | None = first_window_end - lead - get_dht_time()
            elif viable_since is not None:
                wake = viable_since + window_s - time.monotonic()
            else:
                wake = None  # only a join (or the end of the search) can change anything now
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(joined.wait(), None if wake is None else max(0.0, wake))
            joined.clear()
            async with matchmaking.lock_request_join_group:
                if not matchmaking.is_looking_for_group or matchmaking.assembled_group.done():
                    return
                following = matchmaking.current_leader is not None
                members = {peer.to_base58() for peer in matchmaking.current_followers} | {me}
                if first_window_end is not None:
                    if following or len(members) > 1:
                        first_window_end = None  # not alone: the window ends the wait, as it always did
                    elif get_dht_time() >= first_window_end - lead:
                        self._stepped_back_from = matchmaking.potential_leaders.declared_expiration_time
                        self._step_back(step, len(due - members))
                        formed.stepped_back, first_window_end = True, None
                if following or len(members) < self.min_group_size:
                    viable_since = None  # following (its leader decides), or the group came apart: start over
                if following:
                    continue
                came = (members & due) - {me}
                if came - arrived:
                    formed.due_arrival_s = time.monotonic() - began
                    arrived |= came
                if len(members) < self.min_group_size:
                    continue
                if formed.stepped_back and viable_since is None:
                    viable_since = time.monotonic()
                complete = due <= members
                overdue = viable_since is not None and time.monotonic() >= viable_since + window_s
                if not (complete or overdue):
                    continue
                logger.info("%s after %.2f s: forming the group of %d now",
                            "Every due peer joined" if complete else "A window passed since the group could form",
                            time.monotonic() - began, len(members))
                try:
                    await matchmaking.leader_assemble_group()
                except Exception as e:  # noqa: BLE001 - the window then decides, as it always did
                    logger.warning("Could not form the group: %r", e)
                    return
                formed.early = complete
                return

    @staticmethod
    def _step_back(step: Any, missing: int) -> None:
        """Declare until the end of the search from the next declaration on (class docstring)."""
        deadline = step.deadline if step.deadline is not None and math.isfinite(step.deadline) else None
        step.scheduled_time = (deadline if deadline is not None else get_dht_time() + 3600.0) - 1e-3
        logger.info("Alone as the window ends while %d due peer(s) train on: following the next one to arrive "
                    "instead of leading", missing)
