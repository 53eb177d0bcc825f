"""A peer alone as its first window ends steps back and takes no follower until it declares again
(``quorum.EarlyAssembly.install``): two due peers arriving in those moments and just after all average with it.

The scenario the fix guards, staged on events instead of hoped for: c starts its round alone (a and b are up,
their progress records read, but each waits for its own go file), steps back (its log says so), and only then
is a released: a asks c while c's old declaration still stands. b is released once that answer is known: a
refused by c (the fix), or a grouped with c and c's group formed at the end of that declaration (without the
fix: hivemind forms a leader's group when its declaration ends with whoever joined, so a is grouped with c
alone and b, arriving next, is cut). The test then asserts one group of all three with one result, and that c
refused a: without the refusal it fails every time (checked by turning ``install`` into a no-op).

``STEP_BACK_LEAD_S`` is raised to 2 s in these peers (0.5 s in production, with windows of 8 s here) so that
a's request reaches c inside those moments even on a loaded machine; what is tested does not depend on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from swarm_helpers.staged import StagedSwarm, log_has, wait_for_log

from p2p_diloco.swarm import SwarmConfig, start_dht, visible_maddrs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FINGERPRINT = "abcdef0123456789"
SHAPES = [[3, 4], [5]]
WINDOW_S = 8.0
LEAD_S = 2.0
"""c steps back ``LEAD_S`` before its first window ends: the moments a has to reach c in (see the docstring)."""
EVENT_WAIT_S = 40.0
_runs = itertools.count()


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[StagedSwarm]:
    dht = start_dht(SwarmConfig.for_loopback())
    swarm = StagedSwarm(tmp_path, visible_maddrs(dht))
    try:
        yield swarm
    finally:
        swarm.stop()
        dht.shutdown()


def test_two_due_peers_arriving_as_an_early_peers_window_ends_both_average_with_it(swarm: StagedSwarm) -> None:
    cfg = dict(run_id=f"stepback{next(_runs)}", min_group_size=2, target_group_size=8, matchmaking_time_s=WINDOW_S,
               matchmaking_timeout_s=30.0)
    peers = {name: swarm.spawn(name, role="average", shapes=SHAPES, fingerprint=FINGERPRINT, cfg=cfg,
                               fresh=float(i + 1), weight=1.0, expect_due=True, step_back_lead_s=LEAD_S)
             for i, name in enumerate("abc")}
    a, b, c = peers["a"], peers["b"], peers["c"]
    swarm.wait_ready()  # every progress record is published: each peer's round knows all three are due
    c_id = c.info["peer_id"]
    swarm.release(c)
    wait_for_log([c], lambda: log_has(c, r"Alone as the window ends while 2 due peer"), EVENT_WAIT_S,
                 "c stepping back")
    swarm.release(a)
    refused = rf"requested {c_id} to be my leader, but got rejected with BAD_EXPIRATION_TIME"
    wait_for_log([a, c], lambda: log_has(a, refused) or (log_has(a, rf"joining the group of {c_id}")
                                                         and log_has(c, r"assembled group of")),
                 EVENT_WAIT_S, "a's request to c answered while c's old declaration stood")
    swarm.release(b)
    results = {name: swarm.result(peer, timeout=90.0) for name, peer in peers.items()}
    summary = {n: (r["outcome"], r["group_size"], r["reason"]) for n, r in results.items()}
    for name, result in results.items():
        assert result["outcome"] == "averaged" and result["group_size"] == 3, (name, summary, swarm.warnings())
    assert len({r["fresh_sha"] for r in results.values()}) == 1, summary
    assert log_has(a, refused), "c took a as its follower after stepping back"
