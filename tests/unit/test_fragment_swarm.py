"""Streaming DiLoCo's swarm side without a network: each fragment's records namespace, its served state and
manifest selector, and a fragment peer's checkpoint (the fragments' states as one model's, and back)."""

from __future__ import annotations

import pytest
import torch
from hivemind.utils.serializer import MSGPackSerializer
from serving_fake import FakeServing

from p2p_diloco.config import OuterConfig
from p2p_diloco.core.outer import MOMENTUM_KEY_PREFIX
from p2p_diloco.core.peer_state import ANCHOR_KEY_PREFIX, OuterState
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.peer.session import SwarmSession
from p2p_diloco.peer.streaming_session import StreamingSession, merge_fragment_tensors, split_fragment_tensors
from p2p_diloco.swarm.buffer_layout import BufferLayout
from p2p_diloco.swarm.chunk_transfer import _ANY, _Served, fragment_selector
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.facade import Swarm
from p2p_diloco.swarm.fragment_swarm import FragmentSwarm
from p2p_diloco.swarm.records import fragment_records_id
from p2p_diloco.swarm.state_server import StateServer


def test_each_fragment_has_its_own_records_namespace_per_layout() -> None:
    template = [torch.zeros(4), torch.zeros(2, 3), torch.zeros(5)]
    two = BufferLayout.of(template, [[0, 2], [1]])
    other = BufferLayout.of(template, [[0], [1, 2]])
    ids = {fragment_records_id("run", layout.tag, f) for layout in (two, other) for f in range(2)}
    assert len(ids) == 4 and all(i.startswith("run_F2x") for i in ids)
    swarm = Swarm(SwarmConfig.for_loopback(), "ab" * 8, template, fragments=[[0, 2], [1]])
    assert swarm.fragment_ids == [fragment_records_id(swarm.cfg.run_id, two.tag, f) for f in range(2)]
    assert FragmentSwarm(swarm, 1).records_id == swarm.fragment_ids[1]
    with pytest.raises(ValueError, match="fragment must be"):
        FragmentSwarm(swarm, 2)
    whole = Swarm(SwarmConfig.for_loopback(), "ab" * 8, template)
    assert whole.fragment_ids == []
    with pytest.raises(ValueError, match="no fragments"):
        FragmentSwarm(whole, 0)
    with pytest.raises(ValueError, match="2 fragment epochs for 0"):
        whole.publish_progress(epoch=0, inner_step=0, rates=(0.0, 0.0, 0.0), fragment_epochs=[0, 0])


def test_each_fragment_is_served_under_its_own_selector_and_withdrawn_alone() -> None:
    averager = FakeServing()
    server = StateServer(averager)  # type: ignore[arg-type]
    first = ([torch.arange(6, dtype=torch.float32)], [torch.zeros(6)])
    second = ([torch.ones(3, 2), torch.full((4,), 2.0)], [torch.zeros(3, 2), torch.zeros(4)])
    sha0 = server.publish(*first, 3, fragment=0, records_id="run_f0")
    sha1 = server.publish(*second, 2, fragment=1, records_id="run_f1")
    assert sha0 != sha1 and averager.state_sharing_priority == 5.0  # fragment rounds done: 3 + 2
    meta, tensors = averager.provider()
    served = _Served.of(1, meta, tensors)
    assert set(served.manifests) == {fragment_selector(0), fragment_selector(1)} and _ANY not in served.manifests
    got = [MSGPackSerializer.loads(served.manifests[fragment_selector(f)]) for f in (0, 1)]
    assert [(m["run"], m["ep"], m["sha"], m["np"], m["no"]) for m in got] == [("run_f0", 3, sha0, 1, 1),
                                                                              ("run_f1", 2, sha1, 2, 2)]
    views, chunks = served.objects[sha1]
    assert len(views) == 4 and sum(v.nbytes for v in views) == (6 + 4) * 4 * 2
    # fragment 0 changes (its round): only its state stops being served
    server.withdraw(1.0, fragment=0)
    meta, tensors = averager.provider()
    assert meta["f"][0] is None and meta["f"][1]["sha"] == sha1 and len(tensors) == 4
    assert set(_Served.of(2, meta, tensors).manifests) == {fragment_selector(1)}
    assert len({fragment_selector(f) for f in range(64)} | {_ANY}) == 65


def test_a_fragment_published_while_another_download_runs_is_served_at_once() -> None:
    """The averager process caches what it serves while streams are open; a fragment published after a request
    cached the others alone must not stay hidden until every stream closed (a joiner would drop this donor)."""
    import asyncio
    from types import SimpleNamespace

    from hivemind.proto import averaging_pb2

    from p2p_diloco.swarm.averager import RoundAverager
    from p2p_diloco.swarm.chunk_transfer import MANIFEST, ChunkServer, ServingCounters, encode_request

    host = FakeServing()
    server = StateServer(host)  # type: ignore[arg-type]
    counters = ServingCounters()
    published = SimpleNamespace(counters=counters)

    async def host_state() -> tuple[bytes, list[torch.Tensor], None]:
        meta, tensors = host.provider()
        return MSGPackSerializer.dumps(meta), tensors, None

    chunks = ChunkServer(counters, host_state, lambda: True, lambda _: None)

    async def manifest(fragment: int) -> list:
        request = averaging_pb2.DownloadData(metadata=encode_request(fragment_selector(fragment), MANIFEST))
        return [reply async for reply in chunks.serve(request)]

    server.publish([torch.ones(4)], [torch.zeros(4)], 1, fragment=0, records_id="run_f0")
    RoundAverager.mark_state_live(published, True)  # type: ignore[arg-type]  # what set_state_provider does
    with counters.streams_open.get_lock():
        counters.streams_open.value += 1  # a download of fragment 0 in flight keeps the cache
    assert asyncio.run(manifest(1)) == [] and len(asyncio.run(manifest(0))) == 1  # fragment 1 not served yet
    server.publish([torch.ones(2)], [torch.zeros(2)], 1, fragment=1, records_id="run_f1")
    RoundAverager.mark_state_live(published, True)  # type: ignore[arg-type]
    replies = asyncio.run(manifest(1))
    assert len(replies) == 1 and MSGPackSerializer.loads(replies[0].metadata)["run"] == "run_f1"


def test_a_fragment_caught_up_late_shortens_the_phase_once() -> None:
    """A joiner whose fragment download ended 3 s into the swarm's phase (5 steps to the next fragment's sync
    at 1 step/s) plans fewer steps to arrive with the others, floored at min_local_steps scaled to the phase."""
    cfg = PeerConfig(outer=OuterConfig(fragments=2, local_steps=10, min_local_steps=4),
                     swarm=SwarmConfig.for_loopback())
    params = [torch.randn(4, 4), torch.randn(4, 4)]
    session = StreamingSession(cfg, params, "ab" * 8, names=["layers.0.w", "layers.1.w"])
    session.my_speed = 1.0
    assert session.local_steps() == 5  # H / F
    session.ports[1].sync.late_start_s = 3.0
    assert session.local_steps() == 2  # (5 - 3 s x 1 step/s) / 2 = 1, floored at 4 x 5 / 10
    assert all(port.sync.late_start_s == 0.0 for port in session.ports)
    assert session.local_steps() == 5


def test_a_fragment_peers_checkpoint_is_one_models_state_and_loads_back_per_fragment() -> None:
    groups = [[0, 2], [1]]
    params = [torch.randn(4), torch.randn(2, 3), torch.randn(5)]
    states = [OuterState([params[i] for i in group]) for group in groups]
    parts = [state.state_tensors() for state in states]
    merged = merge_fragment_tensors(parts, groups)
    assert torch.equal(merged[f"{ANCHOR_KEY_PREFIX}2"], states[0].anchors[1])
    assert torch.equal(merged[f"{ANCHOR_KEY_PREFIX}1"], states[1].anchors[0])
    assert {k for k in merged if k.startswith(ANCHOR_KEY_PREFIX)} == {f"{ANCHOR_KEY_PREFIX}{i}" for i in range(3)}
    back = split_fragment_tensors(merged, groups)
    assert [sorted(p) for p in back] == [sorted(p) for p in parts]
    with pytest.raises(ValueError, match="fragments do not keep"):
        merge_fragment_tensors([{"eager.previous.0": torch.zeros(1)}, {}], groups)
    momentum = {f"{MOMENTUM_KEY_PREFIX}0": torch.ones(4)}
    assert split_fragment_tensors(momentum, groups) == [{f"{MOMENTUM_KEY_PREFIX}0": momentum[f"{MOMENTUM_KEY_PREFIX}0"]}, {}]


def test_a_streaming_session_saves_and_resumes_every_fragment_at_its_own_epoch() -> None:
    cfg = PeerConfig(outer=OuterConfig(fragments=2, local_steps=10), swarm=SwarmConfig.for_loopback())
    names = ["emb.weight", "layers.0.w", "layers.1.w", "norm.weight"]
    params = [torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4), torch.randn(4)]
    session = StreamingSession(cfg, params, "ab" * 8, names=names)
    # layer i to fragment i mod 2; the embeddings to the lighter (a tie: fragment 0), then the norm to fragment 1
    assert session.groups == [[0, 1], [2, 3]], session.groups
    for f, state in enumerate(session.states):
        state.epoch = 3 + f
    saved = session.state_dict()
    assert saved["fragment_epochs"] == [3, 4] and saved["epoch"] == 7
    assert torch.equal(saved["outer"][f"{ANCHOR_KEY_PREFIX}2"], params[2])  # numbered by parameter

    other = StreamingSession(cfg, [torch.zeros_like(p) for p in params], "ab" * 8, names=names)
    other.load_state_dict(saved)
    assert other.fragment_epochs == [3, 4] and other.epoch == 7
    assert all(torch.equal(a, b) for s, t in zip(session.states, other.states, strict=True)
               for a, b in zip(s.anchors, t.anchors, strict=True))
    # a whole-model checkpoint (no fragment epochs) is refused, naming why
    with pytest.raises(ValueError, match="another --fragments"):
        other.load_state_dict({"epoch": 7, "outer": saved["outer"]})
    # and the reverse: a session without fragments refuses a fragments checkpoint (its epoch is their sum)
    plain = SwarmSession(PeerConfig(outer=OuterConfig(local_steps=10), swarm=SwarmConfig.for_loopback()),
                         [torch.zeros_like(p) for p in params], "ab" * 8)
    with pytest.raises(ValueError, match="--fragments above 1"):
        plain.load_state_dict(saved)
    assert plain.epoch == 0
    with pytest.raises(ValueError, match="fragments > 1"):
        StreamingSession(PeerConfig(outer=OuterConfig(local_steps=10), swarm=SwarmConfig.for_loopback()), params,
                         "ab" * 8, names=names)
