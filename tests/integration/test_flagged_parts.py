"""A group member that sets ``requires_grad`` on every part and reply it sends (issue 51, finding 1), among real
peer processes: the honest members refuse its parts (and its replies) on the wire and name it, so the round it
is in may be carried but waits out no budget; from then on every honest round averages without it (the fold
rounds of h0 included, whose result could not be pickled to the host once the flag had reached the shared
buffers), and the honest members stay bitwise identical.

The attacker is the project's own ``RoundAverager`` with hivemind's plain codec, its messages flagged
(``swarm_helpers/peer.py:FlaggingCompression``). What the averager process's memory does over 30 rounds of
this is measured in ``benchmarks/flagged_parts.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from swarm_helpers.harness import Swarm

from p2p_diloco.swarm import SwarmConfig, start_dht, visible_maddrs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FINGERPRINT = "abcdef0123456789"
SHAPES = [[64, 32], [100]]
ROUNDS = 3


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[list[str]]:
    dht = start_dht(SwarmConfig.for_loopback())
    yield visible_maddrs(dht)
    dht.shutdown()


def test_a_member_flagging_its_parts_is_refused_and_every_honest_round_averages(
        tmp_path: Path, bootstrap: list[str]) -> None:
    swarm = Swarm(tmp_path, bootstrap)
    cfg = dict(run_id="flagged", min_group_size=2, target_group_size=3, matchmaking_time_s=4.0,
               matchmaking_timeout_s=40.0, next_chunk_timeout_s=15.0, allreduce_timeout_s=60.0, request_timeout_s=3.0)
    common = dict(role="rounds", rounds=ROUNDS, shapes=SHAPES, fingerprint=FINGERPRINT, cfg=cfg, weight=100.0,
                  expect_due=True)
    honest = [swarm.spawn("h0", fresh=1.0, stale=0.5, stale_weight=50.0, staleness=1, **common),
              swarm.spawn("h1", fresh=2.0, **common)]
    attacker = swarm.spawn("flag", fresh=3.0, compression="flag_grad", **common)
    try:
        swarm.wait_ready(timeout=120)
        results = [swarm.result(p, timeout=200) for p in honest]
    finally:  # the attacker, refused by both, may still be looking for a group: stopped here

        swarm.stop()
    attacker_id = attacker.info["peer_id"]
    first = [r["rounds"][0] for r in results]
    for r in first:  # refused on the wire and named; its replies are refused too, so this round may be carried
        assert any(entry.startswith(attacker_id) for entry in r["rejected"]), f"not named\n{swarm.warnings()}"
        assert attacker_id not in r["contributors"] or r["outcome"] != "averaged", "its parts were used"
        assert r["outcome"] in ("averaged", "skipped") and "timed out" not in str(r["reason"]), r["reason"]
    assert first[0]["outcome"] == first[1]["outcome"]
    for epoch in range(1, ROUNDS):  # banned from then on: every round averages, h0's late work folded
        rounds = [r["rounds"][epoch] for r in results]
        for r in rounds:
            assert r["outcome"] == "averaged", f"round {epoch}: {r['reason']}\n{swarm.warnings()}"
            assert attacker_id not in r["contributors"] and r["group_size"] == 2
        assert rounds[0]["fresh_sha"] == rounds[1]["fresh_sha"]
        assert rounds[0]["stale_sha"] == rounds[1]["stale_sha"] is not None
