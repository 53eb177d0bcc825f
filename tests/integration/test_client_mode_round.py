"""One round of real averager processes with a client-mode member (a peer behind NAT: nobody can dial it), in
the fast tier: the client's parts go to the two full peers, which reduce them, it reduces nothing, and all three
apply the same average, and the client logs no hivemind warning that its round will fail (it asked for a start
after its deadline, ``patience.JoinTiming.scheduled_time``). The whole scenario (joining, state download, many
rounds) is ``test_client_mode_swarm.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from swarm_helpers.harness import Swarm
from swarm_helpers.peer import pattern

from p2p_diloco.swarm import SwarmConfig, start_dht, visible_maddrs

pytestmark = pytest.mark.timeout(240)

SHAPES = [[64, 32], [100]]
FALSE_ALARM = "Changing scheduled time to after deadline"
"""hivemind's warning for a step scheduled at or after its deadline (``StepControl.scheduled_time``)."""


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[list[str]]:
    dht = start_dht(SwarmConfig.for_loopback())
    yield visible_maddrs(dht)
    dht.shutdown()


def test_a_client_mode_member_averages_with_full_peers(tmp_path: Path, bootstrap: list[str]) -> None:
    swarm = Swarm(tmp_path, bootstrap)
    # generous limits: this tier shares the machine with other tests; the round forms once all 3 due peers joined
    cfg = dict(run_id="client-round", min_group_size=3, target_group_size=3, matchmaking_time_s=8.0,
               matchmaking_timeout_s=90.0, next_chunk_timeout_s=30.0, allreduce_timeout_s=90.0,
               request_timeout_s=5.0)
    common = dict(role="average", shapes=SHAPES, fingerprint="abcdef0123456789", weight=1.0, expect_due=True)
    peers = [swarm.spawn("full1", fresh=1.0, cfg=cfg, **common), swarm.spawn("full2", fresh=2.0, cfg=cfg, **common),
             swarm.spawn("client", fresh=3.0, cfg=dict(cfg, client_mode=True), **common)]
    try:
        swarm.wait_ready(timeout=120)
        results = {p.name: swarm.result(p, timeout=200) for p in peers}
    finally:
        swarm.stop()
    client = peers[2].info["peer_id"]
    for name, result in results.items():
        assert result["outcome"] == "averaged", f"{name}: {result['reason']}\n{swarm.warnings()}"
        assert result["group_size"] == 3 and client in result["contributors"], result["contributors"]
    assert len({r["fresh_sha"] for r in results.values()}) == 1  # every member applies the same average
    want = [(a + b + c) / 3 for a, b, c in zip(pattern(SHAPES, 1.0), pattern(SHAPES, 2.0), pattern(SHAPES, 3.0),
                                                strict=True)]
    got = [torch.tensor(t).reshape(w.shape) for t, w in zip(results["full1"]["fresh_mean"], want, strict=True)]
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want, strict=True))
    for peer in peers:  # a round that averages is not announced as one that will time out
        assert FALSE_ALARM not in peer.log_tail(10**7), f"{peer.name} warned that its round will fail"
