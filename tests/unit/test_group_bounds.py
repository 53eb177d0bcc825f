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


def test_the_whole_state_stream_answers_nobody() -> None:
    """hivemind's whole-state download is closed: joiners fetch verified chunks, so nothing is left to bound."""
    import asyncio
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from p2p_diloco.swarm.averager import RoundAverager

    async def ask() -> list:
        context = SimpleNamespace(remote_id=PeerID(b"\x02" * 34))
        return [m async for m in RoundAverager.rpc_download_state(None, None, context)]  # type: ignore[arg-type]

    assert asyncio.run(ask()) == []


def test_chunk_serving_is_bounded_per_peer_and_in_all() -> None:
    import asyncio
    import contextlib
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from p2p_diloco.swarm.access import MAX_CHUNK_STREAMS, MAX_CHUNK_STREAMS_PER_PEER, AccessGate
    from tests.averager_process import process_for_tests

    def peer(n: int) -> PeerID:
        return PeerID(bytes([n + 2]) * 34)

    gate = AccessGate("me", None)
    with contextlib.ExitStack() as held:
        # every slot taken: 16 requests from 4 peers
        assert all(held.enter_context(gate.chunk_slot(peer(n // MAX_CHUNK_STREAMS_PER_PEER))) is None
                   for n in range(MAX_CHUNK_STREAMS))
        with gate.chunk_slot(peer(0)) as own, gate.chunk_slot(peer(99)) as other:
            assert own is not None and own.startswith("busy")  # one more from a peer at its limit: refused
            assert other is not None and other.startswith("busy")  # one past the total: refused
    with gate.chunk_slot(peer(0)) as later:
        assert later is None  # slots come back
    gate.ban({peer(5).to_base58(): "sent a bad part"})
    with gate.chunk_slot(peer(5)) as banned, AccessGate("me", frozenset({"x"})).chunk_slot(peer(0)) as stranger:
        assert banned == "banned: sent a bad part" and stranger == "not in allowed_peers"

    # The averager process answers a refused request with nothing, before the served state is even asked for.
    asked = []

    async def host_state() -> tuple:
        asked.append(1)
        raise RuntimeError("withdrawn")

    process = process_for_tests(host_state=host_state, sharing=lambda: True)
    process.gate.ban({peer(5).to_base58(): "sent a bad part"})

    async def ask(n: int) -> list:
        request = SimpleNamespace(metadata=b"\x00" * 36)
        return [m async for m in process.state_chunk(request, SimpleNamespace(remote_id=peer(n)))]  # type: ignore[arg-type]

    assert asyncio.run(ask(5)) == [] and asked == []
    assert asyncio.run(ask(0)) == [] and asked == [1]  # an allowed peer's request reaches the server
