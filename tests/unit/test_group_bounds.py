"""Bounded group influence: bandwidth claims are ignored by load balancing among strangers, and the weight cap follows
from the run's configuration (batch size x local steps x a few rounds of carried work)."""

from __future__ import annotations

import torch
from hivemind.averaging.load_balancing import load_balance_peers

from p2p_diloco.peer.config import ROUNDS_OF_WORK, PeerConfig
from p2p_diloco.swarm.group import balancing_bandwidths


def test_a_bandwidth_claim_no_longer_buys_the_whole_vector() -> None:
    size = 10**6
    assert load_balance_peers(size, [1e9, 10.0, 10.0]) == (size, 0, 0)  # the finding, in hivemind itself
    assert load_balance_peers(size, [20.0, 10.0, 10.0]) == (size, 0, 0)  # even 2x does it: no cap is safe
    open_swarm = balancing_bandwidths([1e9, 10.0, 0.0, None], private=False)
    assert open_swarm == [None, None, 0.0, None]  # clients still reduce nothing
    shares = load_balance_peers(size, open_swarm)
    assert sum(shares) == size and shares[2] == 0 and max(shares) - min(s for s in shares if s) <= 1
    assert balancing_bandwidths([1e9, 10.0], private=True) == [1e9, 10.0]  # allowed peers are believed


def test_the_weight_cap_follows_the_run_configuration() -> None:
    cfg = PeerConfig()
    assert cfg.swarm.max_round_weight == ROUNDS_OF_WORK * cfg.inner.batch_size * cfg.outer.local_steps
    explicit = PeerConfig()
    explicit.swarm.max_round_weight = 5e5
    explicit.__post_init__()
    assert explicit.swarm.max_round_weight == 5e5


def test_a_part_is_judged_on_its_wire_fields_before_decoding() -> None:
    from hivemind.compression import (
        CompressionInfo,
        Float16Compression,
        NoCompression,
        serialize_torch_tensor,
    )
    from hivemind.proto import runtime_pb2

    from p2p_diloco.swarm.hivemind_codecs import CodecCompression
    from p2p_diloco.swarm.runner import wire_part_problem

    plain = NoCompression().compression_type
    part = serialize_torch_tensor(torch.ones(6, 8), runtime_pb2.CompressionType.NONE)
    assert wire_part_problem(part, (6, 8), plain) is None
    assert "shape" in wire_part_problem(part, (48,), plain)
    half = Float16Compression().compress(torch.ones(6, 8), CompressionInfo.from_tensor(torch.ones(6, 8)))
    assert "compressed as type" in wire_part_problem(half, (6, 8), plain)  # the sender may not pick it
    ours = CodecCompression("4bit")
    packed = ours.compress(torch.ones(6, 8), CompressionInfo.from_tensor(torch.ones(6, 8)))
    assert wire_part_problem(packed, (6, 8), ours.compression_type) is None
    # a small part claiming a huge shape, and a huge buffer behind a small shape, are never decoded
    liar = serialize_torch_tensor(torch.ones(6, 8), runtime_pb2.CompressionType.NONE)
    del liar.size[:]
    liar.size.extend([10**6, 10**6])
    assert "shape" in wire_part_problem(liar, (6, 8), plain)
    padded = serialize_torch_tensor(torch.ones(6, 8), runtime_pb2.CompressionType.NONE)
    padded.buffer += b"\0" * 10**5
    assert "bytes for 48 values" in wire_part_problem(padded, (6, 8), plain)


def test_a_dead_averager_stops_the_peer_with_what_to_do() -> None:
    from types import SimpleNamespace

    import pytest

    from p2p_diloco.swarm import SwarmConfig, SwarmStartError
    from p2p_diloco.swarm.facade import Swarm

    swarm = Swarm(SwarmConfig.for_loopback(), "abcdef0123456789", [torch.zeros(2)])
    swarm.check_alive()  # not started: nothing to say
    swarm.averager = SimpleNamespace(is_alive=lambda: True, exitcode=None)  # type: ignore[assignment]
    swarm.check_alive()
    swarm.averager = SimpleNamespace(is_alive=lambda: False, exitcode=-9)  # type: ignore[assignment]
    with pytest.raises(SwarmStartError, match=r"averager process stopped \(exit code -9\).*Restart it"):
        swarm.check_alive()


def test_sybils_claiming_tiny_weights_cannot_get_an_honest_peer_banned() -> None:
    from hivemind.averaging.allreduce import AveragingMode
    from hivemind.p2p import PeerID

    from p2p_diloco.swarm.group import MemberInfo, encode_gather, plan_group

    def member(weight: float) -> bytes:
        info = MemberInfo.for_round("run", "abcdef01", 3, weight, 0.0, 0, True, False, norm=1.0, stale_norm=0.0)
        return encode_gather(None, AveragingMode.NODE, info)

    ids = [PeerID(bytes([i + 1]) * 34) for i in range(5)]
    weights = [64.0, 1e-6, 1e-6, 1e-6, 1e11]  # an honest peer, three Sybils, a liar over the cap
    plan = plan_group(ids, [member(w) for w in weights], ids[1], min_group_size=2, max_weight=1e8,
                      weight_ratio=1000.0)
    refused = dict(plan.refused)
    assert "median" in refused[ids[0].to_base58()]  # left out of this round by the Sybils' claims ...
    banned = {peer for peer, _ in plan.rejected}
    assert banned == {ids[4].to_base58()}  # ... but only the claim over the run-wide cap is banned


def test_state_serving_is_one_download_per_peer_and_a_few_at_once() -> None:
    import asyncio
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from p2p_diloco.swarm.access import MAX_STATE_DOWNLOADS, AccessControlMixin

    class Serving:
        def __init__(self) -> None:
            self.gate = asyncio.Event()

        async def rpc_download_state(self, request, context):  # noqa: ANN001, ANN202
            await self.gate.wait()
            yield "state"

    class Donor(AccessControlMixin, Serving):
        _banned: dict[str, str] = {}  # noqa: RUF012
        peer_id = PeerID(b"\x01" * 34)

    async def first(donor: Donor, peer: int) -> list[str]:
        context = SimpleNamespace(remote_id=PeerID(bytes([peer + 2]) * 34))
        return [m async for m in donor.rpc_download_state(None, context)]

    async def scenario() -> list[list[str]]:
        donor = Donor()
        busy = [asyncio.create_task(first(donor, p)) for p in range(MAX_STATE_DOWNLOADS)]
        await asyncio.sleep(0.05)  # all of them are being served now
        again, extra = await first(donor, 0), await first(donor, MAX_STATE_DOWNLOADS)
        donor.gate.set()
        served = await asyncio.gather(*busy)
        return [again, extra, *served, await first(donor, MAX_STATE_DOWNLOADS)]

    again, extra, *served, later = asyncio.run(scenario())
    assert again == [] and extra == []  # a second download by one id, and one past the limit: refused
    assert served == [["state"]] * MAX_STATE_DOWNLOADS and later == ["state"]  # slots come back


def test_chunk_serving_is_bounded_per_peer_and_in_all() -> None:
    import asyncio
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from p2p_diloco.swarm.access import MAX_CHUNK_STREAMS, MAX_CHUNK_STREAMS_PER_PEER, AccessControlMixin

    class Serving:
        def __init__(self) -> None:
            self.gate = asyncio.Event()

        async def rpc_state_chunk(self, request, context):  # noqa: ANN001, ANN202
            await self.gate.wait()
            yield "chunk"

    class Donor(AccessControlMixin, Serving):
        _banned: dict[str, str] = {}  # noqa: RUF012
        peer_id = PeerID(b"\x01" * 34)

    def context(peer: int) -> SimpleNamespace:
        return SimpleNamespace(remote_id=PeerID(bytes([peer + 2]) * 34))

    async def ask(donor: Donor, peer: int) -> list[str]:
        return [m async for m in donor.rpc_state_chunk(None, context(peer))]

    async def scenario() -> tuple[list[str], list[str], list[list[str]], list[str]]:
        donor = Donor()
        per_peer = MAX_CHUNK_STREAMS_PER_PEER
        busy = [asyncio.create_task(ask(donor, p // per_peer)) for p in range(MAX_CHUNK_STREAMS)]
        await asyncio.sleep(0.05)  # every slot taken: 16 requests from 4 peers
        own, other = await ask(donor, 0), await ask(donor, 99)
        donor.gate.set()
        return own, other, await asyncio.gather(*busy), await ask(donor, 0)

    own, other, served, later = asyncio.run(scenario())
    assert own == [] and other == []  # one more from a peer at its limit, and one past the total: refused
    assert served == [["chunk"]] * MAX_CHUNK_STREAMS and later == ["chunk"]  # slots come back
