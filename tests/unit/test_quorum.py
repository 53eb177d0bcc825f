"""``quorum.EarlyAssembly`` driven through hivemind's matchmaking fields by fakes: when a leader forms its group
early, when a peer alone steps back, and that a peer that stepped back takes no follower until it declares
again. The live counterpart: ``tests/integration/test_step_back_swarm.py``."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from p2p_diloco.swarm.quorum import EarlyAssembly, Formed


class _Peer:
    def __init__(self, name: str) -> None:
        self.name = name

    def to_base58(self) -> str:
        return self.name


class _Leaders:
    """The part of hivemind's ``PotentialLeaders`` that ``EarlyAssembly`` reads: this peer's declaration."""

    def __init__(self) -> None:
        self.declared_expiration_time = float("inf")


class _Matchmaking:
    """The parts of hivemind's ``Matchmaking`` that ``EarlyAssembly.watch`` reads, as a leader."""

    def __init__(self) -> None:
        self.lock_request_join_group = asyncio.Lock()
        self.is_looking_for_group, self.current_leader = True, None
        self.current_followers: dict = {}
        self.assembled_group = asyncio.get_running_loop().create_future()
        self.potential_leaders = _Leaders()

    def _check_reasons_to_reject(self, request: object, context: object) -> None:
        return None  # hivemind's check: nothing against this follower

    async def leader_assemble_group(self) -> None:
        self.assembled_group.set_result(tuple(self.current_followers))


def test_early_assembly_records_when_the_last_due_peer_that_came_joined() -> None:
    async def scenario() -> tuple[Formed, Formed]:
        # "dead" is due (its record lives) but never joins: the window ends the round, not the assembly.
        mm, early, formed = _Matchmaking(), EarlyAssembly(min_group_size=2), Formed()
        watch = asyncio.create_task(early.watch(mm, "me", {"a", "b", "dead"}, formed))
        for name, after in (("a", 0.05), ("stranger", 0.05), ("b", 0.5)):
            await asyncio.sleep(after)
            mm.current_followers[_Peer(name)] = None
            early.follower_joined()
        await asyncio.sleep(0.05)
        watch.cancel()
        # Every due peer joins: the group forms at once, and the last arrival is that moment.
        mm2, early2, formed2 = _Matchmaking(), EarlyAssembly(min_group_size=2), Formed()
        watch2 = asyncio.create_task(early2.watch(mm2, "me", {"a"}, formed2))
        await asyncio.sleep(0.05)
        mm2.current_followers[_Peer("a")] = None
        early2.follower_joined()
        await asyncio.wait_for(watch2, 5)
        return formed, formed2

    cut, whole = asyncio.run(scenario())
    assert not cut.early and cut.due == 4
    # b joined third, at 0.6 s or later (after a, and a stranger who is not due and does not count)
    assert cut.due_arrival_s is not None and cut.due_arrival_s >= 0.6, cut
    assert whole.early and whole.due_arrival_s is not None


class _Step:
    """The parts of hivemind's ``StepControl`` that ``EarlyAssembly.watch`` reads and writes."""

    def __init__(self, window_s: float, search_s: float) -> None:
        self.scheduled_time = get_dht_time() + window_s
        self.deadline = get_dht_time() + search_s


def test_a_peer_alone_when_its_first_window_ends_lets_the_next_due_peer_lead() -> None:
    async def until(condition, limit_s: float = 10.0) -> bool:  # noqa: ANN001 - a bounded wait for a state
        for _ in range(int(limit_s / 0.02)):
            if condition():
                return True
            await asyncio.sleep(0.02)
        return condition()

    async def scenario() -> tuple[Formed, _Step, bool, bool, Formed, _Step, bool]:
        # Early and alone: just before its first window (1.2 s) ends it moves its scheduled time to the end of
        # its search, so that hivemind's next declaration ends later than any newcomer's.
        mm, early, formed, step = _Matchmaking(), EarlyAssembly(min_group_size=2), Formed(), _Step(1.2, 30.0)
        watch = asyncio.create_task(early.watch(mm, "me", {"a", "b"}, formed, step))
        stepped = await until(lambda: formed.stepped_back)
        # Still leading (everyone else arrived alone too): a follows; b, due, does not come. The group forms one
        # window after it could, not at the next of hivemind's short re-declarations, and not never.
        mm.current_followers[_Peer("a")] = None
        early.follower_joined()
        await asyncio.sleep(0.1)
        formed_at_once = mm.assembled_group.done()
        await asyncio.wait_for(watch, 10)
        # Joined well within the first window (3 s): the window decides, as before; nothing is moved.
        mm2, early2, formed2, step2 = _Matchmaking(), EarlyAssembly(min_group_size=2), Formed(), _Step(3.0, 30.0)
        watch2 = asyncio.create_task(early2.watch(mm2, "me", {"a", "b"}, formed2, step2))
        mm2.current_followers[_Peer("a")] = None
        early2.follower_joined()
        # past the moment a lone leader would have stepped back, with room to spare on a loaded machine
        stepped2 = await until(lambda: formed2.stepped_back, limit_s=3.5)
        watch2.cancel()
        return formed, step, stepped, formed_at_once, formed2, step2, stepped2

    formed, step, stepped, formed_at_once, formed2, step2, stepped2 = asyncio.run(scenario())
    assert stepped and formed.stepped_back
    assert step.scheduled_time == pytest.approx(step.deadline - 1e-3)
    assert not formed_at_once  # it waits for b, a window after a joined ...
    assert not formed.early  # ... then forms without it
    assert not stepped2 and step2.scheduled_time < step2.deadline - 20


def test_a_peer_that_stepped_back_takes_no_follower_until_it_declares_again() -> None:
    async def scenario() -> tuple[object, object, object, object]:
        mm, early, formed, step = _Matchmaking(), EarlyAssembly(min_group_size=2), Formed(), _Step(0.8, 30.0)
        early.install(mm)
        early.install(mm)  # once per process: a second install changes nothing
        mm.potential_leaders.declared_expiration_time = step.scheduled_time  # hivemind declared its first window
        watch = asyncio.create_task(early.watch(mm, "me", {"a", "b"}, formed, step))
        before = mm._check_reasons_to_reject(None, None)
        for _ in range(200):
            if formed.stepped_back:
                break
            await asyncio.sleep(0.01)
        # the declaration it stepped back from still stands: hivemind would form a group with whoever joins now,
        # when it ends, and cut the due peer arriving next
        during = mm._check_reasons_to_reject(None, None)
        mm.potential_leaders.declared_expiration_time = step.scheduled_time  # hivemind declared again
        after = mm._check_reasons_to_reject(None, None)
        watch.cancel()
        # the next round starts afresh, whatever its declaration
        mm.potential_leaders.declared_expiration_time = step.scheduled_time = get_dht_time() + 5.0
        watch = asyncio.create_task(early.watch(mm, "me", {"a", "b"}, Formed(), step))
        await asyncio.sleep(0.05)
        next_round = mm._check_reasons_to_reject(None, None)
        watch.cancel()
        return before, during, after, next_round

    before, during, after, next_round = asyncio.run(scenario())
    assert before is None
    assert isinstance(during, averaging_pb2.MessageFromLeader) and during.code == averaging_pb2.BAD_EXPIRATION_TIME
    assert after is None and next_round is None
