"""A donor asked for its manifest while it steps on (state withdrawn for its outer step) answers with the new
state's manifest once it is published, instead of nothing: the donors of one group step at the same moment,
and a joiner that got no manifest from any of them struck their claims and trained alone (CI rehearsals).

Synchronised on the donor's own events, not on a timer: a spy on ``ChunkServer._until_republished`` (the wait
itself, unchanged; patched before the averager process forks, so it runs there) tells the test when a request
is waiting with the state withdrawn (the wait ran and did not return at once) and how the wait ended. The new state is published only once the
request is known to wait, so the answer proves the wait; with the wait removed the request is answered nothing
at once and the test fails.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.swarm import RoundAverager, StateServer, SwarmConfig, start_dht, visible_maddrs
from p2p_diloco.swarm.chunk_transfer import MANIFEST, ChunkServer, encode_request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

EVENT_WAIT_S = 30.0
"""Bound on every wait for an event of the donor (its request handling, an answer)."""


class WaitSpy:
    """What the donor's manifest wait did, shared with the averager process (made before it forks)."""

    def __init__(self) -> None:
        self.entered = mp.Event()
        """A manifest request is waiting (the wait did not return at once) while the state is withdrawn."""
        self.ended_live = mp.Value(ctypes.c_int, -1)
        """How that wait ended: 1 with a state published, 0 with none (its deadline), -1 not yet."""

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = ChunkServer._until_republished
        spy = self

        async def until_republished(server: ChunkServer) -> None:
            withdrawn = server._sharing() and not server.counters.live.value
            wait = asyncio.ensure_future(original(server))
            if withdrawn:
                await asyncio.sleep(0)  # the wait's first step runs: it returns at once, or it waits
                if not wait.done() and not server.counters.live.value:
                    spy.entered.set()
            await wait
            if withdrawn:
                spy.ended_live.value = int(bool(server.counters.live.value))

        monkeypatch.setattr(ChunkServer, "_until_republished", until_republished)

    def reset(self) -> None:
        self.entered.clear()
        self.ended_live.value = -1


async def _ask_manifest(client: P2P, target: PeerID, prefix: str) -> bytes:
    stub = RoundAverager.get_stub(client, target, namespace=prefix)
    stream = await stub.rpc_state_chunk(averaging_pb2.DownloadData(metadata=encode_request(None, MANIFEST)))
    return b"".join([m.metadata async for m in stream])


async def _scenario(averager: RoundAverager, server: StateServer, dht: Any, spy: WaitSpy) -> dict[str, Any]:
    maddrs = visible_maddrs(dht)
    target = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])
    # the caller's daemon is up before the donor withdraws: nothing of its start-up falls inside the wait
    client = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        # 1. withdrawn, asked, and published again while the request waits
        server.withdraw(0.0)
        spy.reset()
        asked = asyncio.create_task(_ask_manifest(client, target, averager.prefix))
        entered = await asyncio.to_thread(spy.entered.wait, EVENT_WAIT_S)
        ended_before_publish = spy.ended_live.value
        server.publish([torch.full((3,), 2.0)], [torch.zeros(3)], epoch=3)
        republished = await asyncio.wait_for(asked, EVENT_WAIT_S)
        first = dict(entered=entered, ended_before_publish=ended_before_publish, ended_live=spy.ended_live.value,
                     metadata=republished)
        # 2. withdrawn for longer than the wait: answered nothing, as before, once the wait's own deadline passed
        server.withdraw(0.0)
        spy.reset()
        nothing = await asyncio.wait_for(_ask_manifest(client, target, averager.prefix), EVENT_WAIT_S)
        second = dict(entered=spy.entered.is_set(), ended_live=spy.ended_live.value, metadata=nothing)
        return dict(first=first, second=second)
    finally:
        await client.shutdown()


def test_a_donor_stepping_on_answers_with_its_new_manifest(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = WaitSpy()
    spy.install(monkeypatch)  # before the averager process forks
    cfg = SwarmConfig.for_loopback(run_id="republish")
    dht = start_dht(cfg)
    averager = RoundAverager([torch.zeros(3)], dht, cfg, fingerprint="abcdef0123456789")
    server = StateServer(averager)
    try:
        server.publish([torch.ones(3)], [torch.zeros(3)], epoch=2)
        result = asyncio.run(_scenario(averager, server, dht, spy))
    finally:
        averager.shutdown()
        dht.shutdown()
    first, second = result["first"], result["second"]
    assert first["entered"], "the manifest request never waited for the withdrawn state"
    assert first["ended_before_publish"] == -1, "the wait ended before the new state was published"
    assert first["metadata"], f"the donor answered nothing while it stepped on: {first}"
    assert MSGPackSerializer.loads(first["metadata"])["ep"] == 3
    assert first["ended_live"] == 1, first  # the wait ended because the new state came
    # the second request waited too, ended at its deadline with the state still withdrawn, and got nothing
    assert second == dict(entered=True, ended_live=0, metadata=b""), second
