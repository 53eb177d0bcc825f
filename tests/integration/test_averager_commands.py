"""Commands larger than 16 KiB reach the averager process whole, and it survives them.

Python's ``Connection`` writes such a command in two writes (length, then payload), and the averager process
reads its end of the pipe non-blocking (uvloop's ``add_reader`` makes it so): it used to find the payload
missing, skip it and then die unpickling the rest of the stream. A state download's command is that large at
every real model size (one pickled handle per destination tensor, 32 bytes of digest per chunk).
"""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from p2p_diloco.swarm import SwarmConfig, start_dht
from p2p_diloco.swarm.averager import RoundAverager

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TENSORS = 600  # a model of about 300 parameter tensors: its parameters and momentum


@pytest.fixture
def averager() -> Iterator[RoundAverager]:
    cfg = SwarmConfig.for_loopback(run_id="commands")
    dht = start_dht(cfg)
    averager = RoundAverager([torch.zeros(1) for _ in range(TENSORS)], dht, cfg, fingerprint="abcdef0123456789")
    yield averager
    averager.shutdown()
    dht.shutdown()


def test_large_download_commands_reach_the_averager_whole(averager: RoundAverager) -> None:
    dest = [torch.zeros(1).share_memory_() for _ in range(TENSORS)]
    digests = bytes(32 * 300)
    size = len(ForkingPickler.dumps(("_fetch_chunks", [], {"dest": dest, "digests": digests})))
    assert size > 4 * 16384, size  # the case that broke: well past a single write
    for _ in range(20):
        # no donors: the averager process answers at once that nothing was fetched
        out = averager.fetch_chunks([], "0" * 64, dest, TENSORS // 2, digests, set(), None, timeout=5.0)
        assert not out["done"], out
    assert averager.is_alive()
