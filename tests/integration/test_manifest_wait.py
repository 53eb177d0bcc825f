"""A donor asked for its manifest while it steps on (state withdrawn for its outer step) answers with the new
state's manifest once it is published, instead of nothing: the donors of one group step at the same moment,
and a joiner that got no manifest from any of them struck their claims and trained alone (CI rehearsals)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.swarm import RoundAverager, StateServer, SwarmConfig, start_dht, visible_maddrs
from p2p_diloco.swarm.chunk_transfer import MANIFEST, REPUBLISH_WAIT_S, encode_request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def _manifest(averager: RoundAverager, maddrs: list[str]) -> tuple[bytes, float]:
    p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        stub = RoundAverager.get_stub(p2p, PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1]),
                                      namespace=averager.prefix)
        began = time.monotonic()
        stream = await stub.rpc_state_chunk(averaging_pb2.DownloadData(metadata=encode_request(None, MANIFEST)))
        messages = [m async for m in stream]
        return b"".join(m.metadata for m in messages), time.monotonic() - began
    finally:
        await p2p.shutdown()


def test_a_donor_stepping_on_answers_with_its_new_manifest() -> None:
    cfg = SwarmConfig.for_loopback(run_id="republish")
    dht = start_dht(cfg)
    averager = RoundAverager([torch.zeros(3)], dht, cfg, fingerprint="abcdef0123456789")
    server = StateServer(averager)
    try:
        server.publish([torch.ones(3)], [torch.zeros(3)], epoch=2)
        server.withdraw(0.0)  # stepping on: nothing served until the next publish
        republish = threading.Timer(0.5, lambda: server.publish([torch.full((3,), 2.0)], [torch.zeros(3)], epoch=3))
        republish.start()
        try:
            metadata, waited = asyncio.run(_manifest(averager, visible_maddrs(dht)))
        finally:
            republish.join()
        assert metadata, "the donor answered nothing while it stepped on"
        assert MSGPackSerializer.loads(metadata)["ep"] == 3
        assert waited < REPUBLISH_WAIT_S + 5.0
        # withdrawn for longer than the wait: answered nothing, as before, and not held beyond the bound
        server.withdraw(0.0)
        metadata, waited = asyncio.run(_manifest(averager, visible_maddrs(dht)))
        assert metadata == b"" and waited >= REPUBLISH_WAIT_S
    finally:
        averager.shutdown()
        dht.shutdown()
