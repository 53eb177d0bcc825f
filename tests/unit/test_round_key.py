"""Every round meets under a matchmaking key of its own (``swarm.protocol.round_group_bits``).

hivemind's DHT keeps only the latest-expiring record per key and peer. Under one key for the whole run, the
record a search left behind ("not looking", expiring when that search's last declaration did: up to the end of
the search after a peer stepped back) made the next round's shorter declaration be rejected, and the peer was
invisible as a leader: two due, present peers then waited out the whole learned window every round. These
tests run that sequence on a real hivemind DHT node (one, in this process, on loopback).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import hivemind
from hivemind.averaging.key_manager import GroupKeyManager, is_valid_group
from hivemind.utils import get_dht_time

from p2p_diloco.swarm.protocol import averager_prefix, round_group_bits, use_round_key


def test_round_keys_are_distinct_per_epoch_and_valid_hivemind_group_keys() -> None:
    bits = [round_group_bits(epoch) for epoch in range(2048)]
    assert len(set(bits)) == len(bits)
    prefix = averager_prefix("run", "ab" * 8)
    assert all(is_valid_group(f"{prefix}.0b{b}") for b in bits[:64] + bits[-4:])


def test_a_round_after_a_long_declaration_is_still_seen_as_a_leader() -> None:
    dht = hivemind.DHT(start=True)
    try:
        manager = GroupKeyManager(dht, averager_prefix("run", "ab" * 8), "", 32)
        matchmaking = SimpleNamespace(group_key_manager=manager)
        me = dht.peer_id

        async def two_rounds() -> tuple[str, str, bool, list, bool]:
            now = get_dht_time()
            use_round_key(matchmaking, 3)
            key3 = manager.current_key
            # round 3: this peer stepped back, so its last declaration ran to the end of its search (60 s),
            # and the search ended by marking it "not looking" with that expiration
            assert await manager.declare_averager(key3, me, now + 60)
            assert await manager.declare_averager(key3, me, now + 60, looking_for_group=False)
            use_round_key(matchmaking, 4)
            key4 = manager.current_key
            stored = await manager.declare_averager(key4, me, now + 7.5)  # round 4 declares for its window
            seen = await manager.get_averagers(key4, only_active=True)
            # the same declaration under round 3's key: what one key for the whole run did
            rejected = not await manager.declare_averager(key3, me, now + 7.5)
            return key3, key4, stored, seen, rejected

        key3, key4, stored, seen, rejected = asyncio.run(two_rounds())
        assert key3 != key4
        assert stored, "round 4's declaration was rejected"
        assert [peer for peer, _ in seen] == [me], f"round 4 does not see this peer looking for a group: {seen}"
        assert rejected, "hivemind's DHT now takes an earlier-expiring record: the round key may be unneeded"
    finally:
        dht.shutdown()
