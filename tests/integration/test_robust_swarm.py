"""Robust aggregation between real peer processes: 1 Byzantine peer among 5, plain mean vs centered-clip.

Each peer is a real ``RoundAverager`` (tests/swarm_helpers/peer.py) in its own process, averaging over
hivemind's matchmaking and butterfly all-reduce on loopback. The four honest peers send pseudo-gradients
with a known clean mean; the fifth sends its own multiplied by -20 (fault ``byzantine@0=-20``). What is
measured is the distance of the group's aggregate from the honest peers' clean mean, relative to that mean's
norm: the quantity that decides whether the outer step (and hence the loss) follows the clean run.
The norm screen is disabled here so that the aggregation rule alone is compared.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from swarm_helpers.harness import Swarm
from swarm_helpers.peer import pattern

from p2p_diloco.swarm import SwarmConfig, start_dht, visible_maddrs

pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(240)]

FINGERPRINT = "abcdef0123456789"
SHAPES = [[6, 8], [10]]
HONEST = (1.0, 1.1, 0.9, 1.05)
_runs = itertools.count()


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[list[str]]:
    dht = start_dht(SwarmConfig.for_loopback())
    yield visible_maddrs(dht)
    dht.shutdown()


def _round(workdir: Path, bootstrap: list[str], aggregation: str) -> list[dict]:
    workdir.mkdir()
    swarm = Swarm(workdir, bootstrap)
    cfg = dict(run_id=f"byz{next(_runs)}", min_group_size=5, target_group_size=8, aggregation=aggregation,
               norm_outlier_factor=0.0, matchmaking_time_s=4.0, matchmaking_timeout_s=40.0,
               next_chunk_timeout_s=15.0, allreduce_timeout_s=60.0,  # 5-6 processes on 2 loaded cores
               request_timeout_s=3.0)  # a follower that gives up on a busy leader costs the group its round
    common = dict(role="average", shapes=SHAPES, fingerprint=FINGERPRINT, cfg=cfg, weight=100.0)
    peers = [swarm.spawn(f"h{i}", fresh=value, **common) for i, value in enumerate(HONEST)]
    peers.append(swarm.spawn("byz", fresh=1.0, faults="byzantine@0=-20", **common))
    try:
        swarm.wait_ready(timeout=120)
        results = [swarm.result(p, timeout=120) for p in peers]
    finally:
        swarm.stop()
    assert "FAULT FIRED byzantine@0" in peers[-1].log_tail(100_000)
    for result in results:
        assert result["outcome"] == "averaged", f"{result['reason']}\n{swarm.warnings()}"
        assert result["group_size"] == 5
    assert len({r["fresh_sha"] for r in results}) == 1  # bitwise identical everywhere, attack or not
    return results


def _relative_error(result: dict) -> float:
    clean = torch.cat([torch.stack(ts).mean(0).reshape(-1) for ts in
                       zip(*(pattern(SHAPES, v) for v in HONEST), strict=True)]).double()
    got = torch.tensor([x for part in result["fresh_mean"] for x in part], dtype=torch.float64)
    return float(torch.linalg.vector_norm(got - clean) / torch.linalg.vector_norm(clean))


def test_centered_clip_holds_against_one_byzantine_peer_in_five_and_mean_does_not(
    bootstrap: list[str], tmp_path: Path
) -> None:
    errors = {}
    for aggregation in ("mean", "centered-clip"):
        results = _round(tmp_path / aggregation, bootstrap, aggregation)
        errors[aggregation] = _relative_error(results[0])
    print(f"relative error of the aggregate vs the honest mean: {errors}")
    # the plain mean follows the attacker: (4 honest + -20 x honest) / 5 lands far on the other side
    assert errors["mean"] > 3.0, errors
    # centered-clip stays within 10% of the clean mean (the honest peers themselves spread by about 5%)
    assert errors["centered-clip"] < 0.1, errors
