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
import logging
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

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


class EarlyAssembly:
    """Ends a leader's matchmaking window once every due peer has joined; see the module docstring.

    :param min_group_size: the averager's ``min_group_size``; a smaller group is never formed early.
    """

    def __init__(self, min_group_size: int):
        self.min_group_size = min_group_size
        self._joined: asyncio.Event | None = None  # made in the averager process's event loop

    def follower_joined(self) -> None:
        """Call whenever this peer, as a leader, accepted a follower."""
        if self._joined is not None:
            self._joined.set()

    async def watch(self, matchmaking: Any, me: str, due: Collection[str], formed: Formed) -> None:
        """Run beside ``matchmaking.look_for_group``; cancel it when the search ends. ``me`` is this peer's
        base58 id, ``due`` the verified due peers (``due_peers``)."""
        due = frozenset(due) | {me}
        formed.due = len(due)
        if len(due) < self.min_group_size:
            return  # nobody else is known to be due: the window decides, as it always did
        began, arrived = time.monotonic(), set()
        joined = self._joined = self._joined or asyncio.Event()
        while True:
            await joined.wait()
            joined.clear()
            async with matchmaking.lock_request_join_group:
                if not matchmaking.is_looking_for_group or matchmaking.assembled_group.done():
                    return
                if matchmaking.current_leader is not None:
                    continue  # we follow another leader now: it decides
                members = {peer.to_base58() for peer in matchmaking.current_followers} | {me}
                came = (members & due) - {me}
                if came - arrived:
                    formed.due_arrival_s = time.monotonic() - began
                    arrived |= came
                if not due <= members or len(members) < self.min_group_size:
                    continue
                logger.info("Every due peer joined after %.2f s: forming the group of %d now",
                            time.monotonic() - began, len(members))
                try:
                    await matchmaking.leader_assemble_group()
                except Exception as e:  # noqa: BLE001 - the window then decides, as it always did
                    logger.warning("Could not form the group early: %r", e)
                    return
                formed.early = True
                return
