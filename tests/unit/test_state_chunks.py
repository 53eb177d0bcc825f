"""The chunked state download's parts without a network: chunk map, manifest digests, the assignment policy
driven by a fake swarm of donors, the on-disk partial download, and a resumed download through
``download_state`` with an in-process stand-in for the averager's transfer calls."""

from __future__ import annotations

import hashlib
import heapq
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.utils.serializer import MSGPackSerializer
from serving_fake import FakeServing

from p2p_diloco.core.chunks import (
    CHUNK_BYTES,
    MANIFEST_GRACE_S,
    ChunkMap,
    ChunkPlan,
    ServeWait,
    manifest_wait_s,
)
from p2p_diloco.swarm.checksum import (
    combine_state_sha,
    manifest_sha,
    params_sha256,
    state_sha256,
    tensor_manifest,
)
from p2p_diloco.swarm.chunk_transfer import ChunkFetcher, read_chunk, state_chunk_map, write_chunk
from p2p_diloco.swarm.partial import PartialStore
from p2p_diloco.swarm.state import check_state_metadata, download_state, make_state_metadata
from p2p_diloco.swarm.state_server import StateServer

FINGERPRINT = "abcdef0123456789"


def _views(tensors: list[torch.Tensor]) -> list:
    return [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]


def _state() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """1.2 MiB of parameters in three tensors (chunk 0 spans all three) and as much momentum: 4 chunks."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 5, generator=g), torch.randn(300_000, generator=g), torch.randn(7, generator=g)]
    return params, [p * 0.5 for p in params]


def test_chunk_map_covers_every_byte_once_and_regions_start_new_chunks() -> None:
    chunks = ChunkMap([[5, 0, 7], [3, 9]], chunk_bytes=4)
    assert chunks.region_chunks == [3, 3] and chunks.count == 6
    assert chunks.spans(1) == [(0, 4, 5), (2, 0, 3)]  # across tensors, skipping the empty one
    assert chunks.spans(3) == [(3, 0, 3), (4, 0, 1)]  # the momentum's first chunk starts at its tensor 0
    assert [chunks.length(i) for i in range(6)] == [4, 4, 4, 4, 4, 4]
    covered = sorted((t, b) for i in range(6) for t, a, stop in chunks.spans(i) for b in range(a, stop))
    assert covered == sorted({(t, b) for t, n in enumerate([5, 0, 7, 3, 9]) for b in range(n)})


def test_manifest_digest_is_computed_from_the_chunk_digests_and_the_layout() -> None:
    params, momentum = _state()
    manifest = tensor_manifest(params)
    chunks = state_chunk_map(params + momentum, len(params))
    assert manifest.count == chunks.region_chunks[0] == 2
    views = _views(params + momentum)
    for i in range(manifest.count):  # each chunk's digest is the sha256 of the bytes the donor sends for it
        assert manifest.chunk(i) == hashlib.sha256(read_chunk(views, chunks, i)).digest()
    layout = [(t.dtype, tuple(t.shape)) for t in params]
    assert manifest_sha(layout, chunks.region_bytes[0], manifest.chunks) == manifest.sha == params_sha256(params)
    # another layout of the same bytes, or one flipped bit, gives another digest
    reshaped = [params[0].reshape(5, 3), *params[1:]]
    assert params_sha256(reshaped) != manifest.sha
    flipped = [t.clone() for t in params]
    flipped[1].view(torch.int32)[123_456] ^= 1
    assert params_sha256(flipped) != manifest.sha
    assert combine_state_sha(manifest.sha, params_sha256(momentum)) == state_sha256(params, momentum)


def test_a_manifest_whose_digests_do_not_give_the_claimed_digest_is_refused() -> None:
    params, momentum = _state()
    pm, mm = tensor_manifest(params), tensor_manifest(momentum)
    sha = combine_state_sha(pm.sha, mm.sha)
    layouts = ([(t.dtype, tuple(t.shape)) for t in params], [(t.dtype, tuple(t.shape)) for t in momentum])
    chunks = state_chunk_map(params + momentum, len(params))
    honest = make_state_metadata("run", FINGERPRINT, 3, sha, pm, mm, 3, 3)
    assert isinstance(check_state_metadata(MSGPackSerializer.dumps(honest), "run", FINGERPRINT, layouts, chunks), dict)
    forged = dict(honest, pc=bytes(32) + honest["pc"][32:])  # one chunk digest swapped, same claimed digest
    problem = check_state_metadata(MSGPackSerializer.dumps(forged), "run", FINGERPRINT, layouts, chunks)
    assert isinstance(problem, str) and "manifest hashes to" in problem
    short = dict(honest, mc=honest["mc"][:32])
    assert "chunk digests" in check_state_metadata(MSGPackSerializer.dumps(short), "run", FINGERPRINT, layouts, chunks)


def _simulate(plan: ChunkPlan, donors: dict[str, dict[str, Any]]) -> tuple[dict[int, str], float]:
    """A fake swarm: each donor answers a request after ``time`` s (two at once), ``dies_at`` stops it
    answering (its requests fail), ``corrupt`` makes every chunk it sends fail its hash. Returns who
    delivered each chunk first and when the download ended."""
    now = [0.0]
    plan._clock = lambda: now[0]  # noqa: SLF001 - the fake clock of this simulation
    events: list[tuple[float, int, str, int]] = []
    seq = 0

    def request(donor: str) -> None:
        nonlocal seq
        while (chunk := plan.next(donor)) is not None:
            spec = donors[donor]
            at = now[0] + spec["time"]
            heapq.heappush(events, (min(at, spec.get("dies_at", at)), seq, donor, chunk))
            seq += 1

    for donor in donors:
        request(donor)
    writers: dict[int, str] = {}
    for _ in range(10_000):
        if plan.finished or not events:
            break
        now[0], _, donor, chunk = heapq.heappop(events)
        spec = donors[donor]
        if donor not in plan.out:
            continue  # dropped meanwhile: its answer is ignored
        if now[0] >= spec.get("dies_at", float("inf")):
            plan.failed(donor, f"chunk {chunk}: connection reset")
        elif spec.get("corrupt"):
            plan.failed(donor, f"chunk {chunk} failed its hash")
        elif plan.received(donor, chunk):
            writers[chunk] = donor
        for other in list(plan.out):
            request(other)
    return writers, now[0]


def test_plan_moves_chunks_of_dead_corrupt_and_slow_donors_to_the_others() -> None:
    plan = ChunkPlan(40, ["fast", "slow", "dead", "corrupt"], have=[0, 1])
    donors = {"fast": dict(time=1.0), "slow": dict(time=10.0), "dead": dict(time=1.0, dies_at=3.5),
              "corrupt": dict(time=1.0, corrupt=True)}
    writers, ended = _simulate(plan, donors)
    assert plan.finished and set(writers) == set(range(2, 40))  # the two chunks on disk are not fetched
    assert set(plan.dropped) == {"dead", "corrupt"}
    assert "failed its hash" in plan.dropped["corrupt"] and "reset" in plan.dropped["dead"]
    assert not any(w in ("corrupt",) for w in writers.values())
    assert plan.served["fast"] > 4 * plan.served["slow"]  # pull-based: the slow donor just fetches fewer
    # the end: the slow donor's last requests were copied to the fast one, so the download did not wait
    # out the slow donor's 10 s per chunk after the fast one ran dry; the slow donor is named for it
    assert ended < 40 / 2 + 10
    assert plan.overtaken.get("slow", 0) >= 1 and "fast" not in plan.overtaken


def test_a_plan_with_every_donor_gone_is_hopeless_and_keeps_what_it_has() -> None:
    plan = ChunkPlan(10, ["a", "b"])
    writers, _ = _simulate(plan, {"a": dict(time=1.0, dies_at=2.5), "b": dict(time=1.0, corrupt=True)})
    assert plan.hopeless and not plan.finished and set(plan.done) == set(writers) and len(writers) == 4


def test_partial_store_resumes_verified_chunks_and_deletes_stale_ones(tmp_path: Path) -> None:
    params, momentum = _state()
    tensors = params + momentum
    chunks = state_chunk_map(tensors, len(params))
    digests = tensor_manifest(params).chunks + tensor_manifest(momentum).chunks
    views = _views(tensors)
    stale = tmp_path / f"{'b' * 64}.part"
    stale.write_bytes(b"old")
    store = PartialStore(tmp_path, "a" * 64, chunks)
    store.prepare()
    assert not stale.exists()
    for i in (0, 3):
        store.write(i, read_chunk(views, chunks, i))
    store.write(2, b"\x00" * chunks.length(2))  # a torn write: listed as done, but it fails its hash
    dest = [torch.zeros_like(t) for t in tensors]
    have = PartialStore(tmp_path, "a" * 64, chunks).load(digests, lambda i, d: write_chunk(_views(dest), chunks, i, d))
    assert have == {0, 3}
    for i in (0, 3):
        assert read_chunk(_views(dest), chunks, i) == read_chunk(views, chunks, i)
    assert read_chunk(_views(dest), chunks, 1) == bytes(chunks.length(1))  # never written: not loaded


class _FakeAverager:
    """Stands in for ``RoundAverager``'s transfer calls (``fetch_manifests``, ``fetch_chunks``) with one
    honest donor in this process; ``cut_after`` ends the first download after that many chunks (a restart)."""

    def __init__(self, params: list[torch.Tensor], momentum: list[torch.Tensor], cut_after: int | None) -> None:
        from p2p_diloco.swarm.config import SwarmConfig

        self.cfg = SwarmConfig.for_loopback(run_id="run")
        self.fingerprint, self.dht = FINGERPRINT, None
        self.tensors, self.n_params, self.cut_after = params + momentum, len(params), cut_after
        pm, mm = tensor_manifest(params), tensor_manifest(momentum)
        self.meta = make_state_metadata("run", FINGERPRINT, 3, combine_state_sha(pm.sha, mm.sha), pm, mm,
                                        len(params), len(momentum))
        self.fetched: list[list[int]] = []

    def state_donors(self) -> list[tuple[str, float]]:
        return [("donor", 3.0)]

    def fetch_manifests(self, peers: list[str], **_: Any) -> dict[str, bytes]:
        return {p: MSGPackSerializer.dumps(self.meta) for p in peers}

    def fetch_chunks(self, peers: list[str], sha: str, dest: list[torch.Tensor], n_params: int, digests: bytes,
                     have: set[int], partial: Path | None, timeout: float) -> dict[str, Any]:
        chunks = state_chunk_map(dest, n_params)
        store = PartialStore(partial, sha, chunks) if partial else None
        done, fetched = set(have), []
        for i in range(chunks.count):
            if i in done:
                continue
            if self.cut_after is not None and len(fetched) == self.cut_after:
                break
            data = read_chunk(_views(self.tensors), chunks, i)
            write_chunk(_views(dest), chunks, i, data)
            if store:
                store.write(i, data)
            done.add(i)
            fetched.append(i)
        self.fetched.append(fetched)
        self.cut_after = None
        return dict(done=sorted(done), dropped={} if len(done) == chunks.count else {"donor": "cut off"},
                    served={"donor": len(fetched)})


def test_a_download_cut_short_resumes_from_disk_and_fetches_only_the_rest(tmp_path: Path,
                                                                          monkeypatch: Any) -> None:
    import p2p_diloco.swarm.state as state_module

    monkeypatch.setattr(state_module, "fetch_checksums", lambda *_: {})
    params, momentum = _state()
    averager = _FakeAverager(params, momentum, cut_after=3)
    templates = ([torch.zeros_like(t) for t in params], [torch.zeros_like(t) for t in momentum])
    first = download_state(averager, *templates, min_epoch=0, partial_dir=tmp_path)  # type: ignore[arg-type]
    assert first is None and averager.fetched == [[0, 1, 2]]
    assert len(list(tmp_path.glob("*.part"))) == 1  # kept for the next try
    state = download_state(averager, *templates, min_epoch=0, partial_dir=tmp_path)  # type: ignore[arg-type]
    assert state is not None and averager.fetched[1] == [3]  # only the chunk the first try missed
    assert state_sha256(state.params, state.opt_tensors) == state.state_sha256 == averager.meta["sha"]
    assert state.params_manifest is not None and state.params_manifest.sha == params_sha256(params)
    assert not list(tmp_path.iterdir())  # done: the partial is gone
    assert CHUNK_BYTES == 1 << 20


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_the_threaded_manifest_equals_the_one_pass_manifest(threads: int, monkeypatch: Any) -> None:
    """Chunks cut across tensor boundaries, empty tensors and every dtype: the chunks hashed on ``threads``
    threads give the same digests as one pass over the bytes (the protocol's definition)."""
    import p2p_diloco.swarm.checksum as checksum

    monkeypatch.setattr(checksum, "HASH_THREADS", threads)
    monkeypatch.setattr(checksum, "_pool", None)
    gen = torch.Generator().manual_seed(threads)
    tensors = [torch.randn(CHUNK_BYTES // 4 + 3, generator=gen), torch.zeros(0), torch.randn(7, generator=gen),
               torch.randn(3 * CHUNK_BYTES // 8, generator=gen).to(torch.bfloat16),
               torch.randint(0, 9, (CHUNK_BYTES // 8 - 1,), generator=gen), torch.randn(1000, generator=gen)]
    one_pass = checksum._sequential_manifest(tensors)
    assert checksum.tensor_manifest(tensors) == one_pass
    # an iterator is consumed a tensor at a time (a sharded model gathers each in turn): hashing starts
    # before the second tensor is taken
    taken: list[int] = []

    def gathered():  # noqa: ANN202
        for t in tensors:
            taken.append(1)
            yield t.clone()

    seen_at_hash: list[int] = []
    real_sha = checksum.hashlib.sha256

    def watching_sha(*args):  # noqa: ANN002, ANN202
        seen_at_hash.append(len(taken))
        return real_sha(*args)

    monkeypatch.setattr(checksum.hashlib, "sha256", watching_sha)
    assert checksum.tensor_manifest(gathered()) == one_pass
    monkeypatch.setattr(checksum.hashlib, "sha256", real_sha)
    assert 1 in seen_at_hash, seen_at_hash  # drained first, every hash would see all 6 taken
    square = torch.randn(300, 300, generator=gen)  # not contiguous: hashed from a copy, on this thread
    assert checksum.tensor_manifest([*tensors, square.t()]) == checksum.tensor_manifest([*tensors, square.t().contiguous()])
    assert one_pass.count == -(-sum(t.numel() * t.element_size() for t in tensors) // CHUNK_BYTES)
    assert checksum.tensor_manifest(tensors[:1] + [tensors[1] + 0]) != checksum.tensor_manifest(tensors[:1])


def test_serve_wait_is_a_share_of_the_time_worked_since_the_last_cut() -> None:
    now = [100.0]
    wait = ServeWait(0.25, burst_s=0.0, clock=lambda: now[0])
    now[0] += 8.0  # a round of 8 s of work
    assert wait.allowance(600.0) == 2.0
    assert wait.allowance(1.5) == 1.5  # never past the caller's own limit
    now[0] += 2.0  # it waited those 2 s: they do not count as work
    wait.spend(2.0)
    now[0] += 0.4
    assert wait.allowance(600.0) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="share"):
        ServeWait(1.5)
    with pytest.raises(ValueError, match="burst"):
        ServeWait(0.1, burst_s=float("inf"))


def test_serve_wait_saves_unused_budget_up_to_its_burst_and_no_more() -> None:
    """A joiner of a swarm of short rounds gets the budget the donor saved while nobody downloaded; a leech
    that downloads without end spends it once and then gets each round's share, so over any stretch the
    waits stay within burst + share of the time worked."""
    now = [0.0]
    wait = ServeWait(0.25, burst_s=3.0, clock=lambda: now[0])
    for _ in range(40):  # 40 rounds of 1 s, nobody downloading: each withdrawal waits 0 s
        now[0] += 1.0
        wait.allowance(600.0)
        wait.spend(0.0)
    now[0] += 1.0
    assert wait.allowance(600.0) == 3.0  # saved: 40 x 0.25 s, capped at the burst
    now[0] += 3.0
    wait.spend(3.0)  # a download held the whole budget
    waited, worked = 3.0, 41.0
    for _ in range(20):  # a leech downloading without end: every withdrawal waits its whole allowance
        now[0] += 1.0
        worked += 1.0
        allowed = wait.allowance(600.0)
        assert allowed == pytest.approx(0.25)
        now[0] += allowed
        wait.spend(allowed)
        waited += allowed
    assert waited <= 3.0 + 0.25 * worked
    # a round longer than the burst's worth of work still gets its own share
    now[0] += 100.0
    assert wait.allowance(600.0) == pytest.approx(25.0)


class _Leeched:
    """An averager serving a downloader that never stops (a chunk every second, forever)."""

    client_mode = False

    def __init__(self) -> None:
        self.bumps = 0

    def is_alive(self) -> bool:
        return True

    def downloading(self) -> bool:
        return True

    def bump_state_version(self) -> None:
        self.bumps += 1

    def mark_state_live(self, live: bool) -> None:
        self.live = live


@pytest.mark.timeout(60)
def test_a_download_that_never_ends_holds_a_withdrawal_only_for_the_rounds_budget() -> None:
    """Reverted to waiting up to the joiner's limit (600 s here), this withdrawal would outlast the test."""
    averager = _Leeched()
    server = StateServer(averager)  # type: ignore[arg-type]
    now = [0.0]
    server.budget = ServeWait(0.25, burst_s=0.0, clock=lambda: now[0])
    now[0] = 0.4  # the donor worked 0.4 s since it last changed its state: 0.1 s may go to downloads
    server.withdraw(600.0)
    server.withdraw_update(600.0)  # nothing served: returns at once
    assert averager.bumps == 1 and server.cut_off == 1  # the download was cut off: the stream stops
    assert server.waited_s < 30.0  # a budget of 0.1 s, with room for a loaded machine


class _BadChunkDonor(_FakeAverager):
    """Two donors of one state: "bad", listed first (priority 10^6), sent one chunk, then one that failed its
    hash; "good" sent the rest."""

    def state_donors(self) -> list[tuple[str, float]]:
        return [("bad", 1e6), ("good", 3.0)]

    def fetch_chunks(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        result = super().fetch_chunks(*args, **kwargs)
        return dict(result, dropped={"bad": "chunk 2 failed its hash"},
                    served={"bad": 1, "good": len(result["done"]) - 1})


def test_a_donor_listed_first_that_sent_a_bad_chunk_earns_nothing(monkeypatch: Any) -> None:
    import p2p_diloco.swarm.state as state_module
    from p2p_diloco.core.evidence import credited

    monkeypatch.setattr(state_module, "fetch_checksums", lambda *_: {})
    params, momentum = _state()
    averager = _BadChunkDonor(params, momentum, cut_after=None)
    templates = ([torch.zeros_like(t) for t in params], [torch.zeros_like(t) for t in momentum])
    state = download_state(averager, *templates, min_epoch=0)  # type: ignore[arg-type]
    assert state is not None and state.sources[0] == "bad"  # asked first, as its priority claims
    assert state.delivered == {"good": 3} and state.donor == "good"  # its verified chunk counts for nothing
    assert credited(state.delivered, None) == "good"  # a newcomer would vouch for the donor that delivered
    assert any(line.startswith("bad: chunk 2 failed its hash") for line in state.rejected)


class _SteppedOnDonors(_FakeAverager):
    """Three donors hand out the manifest of epoch 3; "a" and "b" then serve another state (they stepped on),
    "bad" sends a chunk that fails its hash. No chunk arrives."""

    def state_donors(self) -> list[tuple[str, float]]:
        return [("a", 3.0), ("b", 3.0), ("bad", 3.0)]

    def fetch_chunks(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        moved = "chunk 0: ValueError: sent nothing (it serves another state now, or is busy)"
        return dict(done=[], served={}, dropped={"a": moved, "b": moved, "bad": "chunk 1 failed its hash"})


def test_donors_that_stepped_on_before_any_chunk_back_their_claim_but_a_bad_chunk_does_not(monkeypatch: Any) -> None:
    """What ``Evidence.unbacked`` gets to forgive: every donor that handed out the manifest and stopped, chunks
    delivered or not; none that sent a bad chunk."""
    import p2p_diloco.swarm.state as state_module

    monkeypatch.setattr(state_module, "fetch_checksums", lambda *_: {})
    params, momentum = _state()
    averager = _SteppedOnDonors(params, momentum, cut_after=None)
    templates = ([torch.zeros_like(t) for t in params], [torch.zeros_like(t) for t in momentum])
    backed: dict[str, int] = {}
    assert download_state(averager, *templates, min_epoch=0, backed=backed) is None  # type: ignore[arg-type]
    assert backed == {"a": 3, "b": 3}


def test_manifests_are_awaited_a_grace_after_the_first_answer_never_the_whole_timeout() -> None:
    assert manifest_wait_s(None, 30.0) == 30.0  # nobody answered yet: the whole timeout
    assert manifest_wait_s(0.01, 30.0) == pytest.approx(0.01 + MANIFEST_GRACE_S)
    assert manifest_wait_s(6.0, 30.0) == 12.0  # a slow network: as long again as the first answer took
    assert manifest_wait_s(20.0, 30.0) == 30.0


@pytest.mark.timeout(60)
def test_one_silent_donor_holds_a_manifest_fetch_only_a_grace_after_the_others_answered() -> None:
    """The averager process's fetch of manifests, with a donor that accepts the stream and never answers:
    reverted to waiting for every donor, the fetch takes the whole timeout (30 s here)."""
    import asyncio
    import time
    from concurrent.futures import Future

    class _Donors(ChunkFetcher):
        async def request(self, peer: str, sha: str | None, index: int, max_bytes: int) -> tuple[bytes, bytes]:
            if peer == "silent":
                await asyncio.sleep(3600)
            if peer == "empty":
                raise ValueError("sent nothing")
            return b"manifest of " + peer.encode(), b""

    future: Future = Future()
    began = time.monotonic()
    asyncio.run(_Donors(stub=lambda peer: None, next_chunk_timeout=5.0).fetch_manifests(
        ["silent", "honest", "empty"], timeout=30.0, max_bytes=1024, base=None, future=future))
    answers = future.result(timeout=1)
    assert time.monotonic() - began < 29.0  # bounded by the grace, with room for a loaded machine
    assert answers["honest"] == b"manifest of honest"
    assert answers["silent"].startswith("no manifest") and answers["empty"].startswith("no manifest")


def test_a_round_update_a_joiner_asked_for_is_copied_and_served_until_the_outer_step() -> None:
    from p2p_diloco.swarm.state_server import ServedUpdate

    averager = FakeServing()
    server = StateServer(averager)  # type: ignore[arg-type]
    params, momentum = [torch.arange(6, dtype=torch.float32)], [torch.zeros(6)]
    mean = [torch.full((6,), 0.5)]  # the averager's buffer: the next round's pseudo-gradient overwrites it
    # Nobody asked during the last two epochs: withdrawing the update keeps nothing.
    server.publish(params, momentum, 2)
    server.publish(params, momentum, 3, update=ServedUpdate("a" * 64, mean, None))
    server.withdraw_update(1.0)
    meta, tensors = averager.provider()
    assert meta["u"] is None and len(tensors) == 2 and server.kept_updates == 0
    # A joiner fetched our manifest of epoch 2 while we served it and finished as we stepped to 3: it needs the
    # update 2 -> 3 during our next round. The update is copied before the buffer changes and served on, with
    # the manifest of the same values.
    server.publish(params, momentum, 2)
    averager.served += 1
    server.publish(params, momentum, 3, update=ServedUpdate("a" * 64, mean, None))
    before = averager.provider()[0]["u"]
    server.withdraw_update(1.0)
    mean[0].fill_(9.0)  # the next round's pseudo-gradient
    meta, tensors = averager.provider()
    assert meta["u"] == before and meta["u"]["base"] == "a" * 64 and server.kept_updates == 1
    assert torch.equal(tensors[2], torch.full((6,), 0.5)) and meta["s"]["ep"] == 3
    server.withdraw_update(1.0)  # our own copy: nothing to withdraw until the outer step
    assert averager.provider()[0]["u"] == before and server.kept_updates == 1
    # The outer step changes the state: nothing is served until the next publish, the copy is gone.
    server.withdraw(1.0)
    with pytest.raises(RuntimeError):
        averager.provider()
    server.publish(params, momentum, 4, update=ServedUpdate("b" * 64, mean, None))
    assert averager.provider()[0]["u"]["base"] == "b" * 64


def test_partials_a_layout_cannot_use_are_deleted_at_start(tmp_path) -> None:
    """A peer that ran with --fragments 4 and now runs with 2 (or none) keeps no partial download it cannot
    resume: fragments 2 and 3's (all four without fragments), and the whole model's when it has fragments."""
    from p2p_diloco.swarm.partial import drop_unused

    def lay_out() -> None:
        (tmp_path / f"{'a' * 64}.part").write_bytes(b"x")
        for f in range(4):
            (tmp_path / f"fragment-{f}").mkdir(exist_ok=True)
            (tmp_path / f"fragment-{f}" / f"{'b' * 64}.done").write_bytes(b"x")
        (tmp_path / "notes.txt").write_text("mine")

    lay_out()
    drop_unused(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fragment-0", "fragment-1", "notes.txt"]
    assert (tmp_path / "fragment-1" / f"{'b' * 64}.done").exists()
    lay_out()
    drop_unused(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{'a' * 64}.part", "notes.txt"]
    drop_unused(tmp_path / "absent", 2)  # nothing there: nothing to do
