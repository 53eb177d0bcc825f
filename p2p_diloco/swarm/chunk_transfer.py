"""The wire half of the multi-donor state download: serve a state chunk by chunk, fetch chunks from donors.

Both halves run in the averager process, which owns this peer's hivemind ``P2P``. One RPC,
``rpc_state_chunk`` on the averager's servicer, carries both kinds of request in hivemind's own protobuf
messages (nothing is pickled):

- request: ``DownloadData.metadata`` = 32 bytes of digest + 4 bytes little-endian chunk index; index
  ``MANIFEST`` asks for a manifest: with an all-zero digest the served state's (msgpack metadata with the
  sha256 of every chunk, ``swarm.state``), with a state's digest the manifest of the last round's update
  from that state to the served one (``swarm.catchup``); any other index asks for a chunk of the state or
  update of that digest; with fragments, with a fragment's selector (:func:`fragment_selector`), that
  fragment's served state's manifest;
- answer: the manifest in ``metadata``, or the chunk's bytes in ``tensor_part.buffer``, in parts of
  :data:`PART_BYTES` so that ``next_chunk_timeout`` measures progress, not a whole chunk's transfer at
  1 Mbit/s. An empty answer means "not served" (another digest now, refused, or busy).

A donor serves its live anchors and momentum, fetched once from the host process per version of the state
(:class:`ChunkServer`), and stops a stream as soon as the host withdrew them, as the whole-state stream does.
The fetching side sizes everything before decoding: a manifest is bounded by the template's chunk count, a
chunk by its known length, and a chunk is hashed before a byte of it is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import logging
import multiprocessing as mp
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol  # noqa: UP035 - hivemind detects streaming RPCs by typing's alias only

import torch
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.core.chunks import DIGEST_BYTES, MANIFEST_GRACE_S, ChunkMap, ChunkPlan, manifest_wait_s
from p2p_diloco.swarm import commands
from p2p_diloco.swarm.partial import PartialStore

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

MANIFEST = 0xFFFFFFFF
"""The chunk index that asks for the manifest."""
PART_BYTES = 1 << 18
"""256 KiB per message: 2 s at 1 Mbit/s, so a stalled donor is noticed within ``next_chunk_timeout``."""
DEPTH = 2
"""Chunk requests out per donor (``ChunkPlan.depth``)."""
_GRACE_S = 10.0
REPUBLISH_WAIT_S = 2.0
"""How long a manifest request that finds this donor's state withdrawn (its outer step and the new state's hash
pass) waits for the new state before answering nothing. Why: the donors of one group step at the same moment,
and a joiner asking all of them then got no manifest at all; it could not tell that from donors that lie about
their epoch, struck their claims for a minute and trained alone from epoch 0 (seen twice in CI rehearsals, with
rounds of about a second). Longer than that window on a small model; a 1B model's may be longer, and its joiner
is then answered nothing as before. Cost: one idle coroutine per request for at most this long."""
INCOMPLETE = "download incomplete"
"""How :func:`fetch_verified` names a download whose donors stopped serving before every chunk came."""
BAD_CHUNK = "failed its hash"
"""How a donor dropped for a chunk that does not match the manifest is named."""


def fragment_selector(fragment: int) -> str:
    """The digest a manifest request names to ask for one fragment's served state (Streaming DiLoCo,
    ``swarm.fragment_swarm``), where the all-zero digest asks for the whole model's: a fixed hash of the
    fragment's index, which no state or update digest can equal unless sha256 collides."""
    return hashlib.sha256(f"p2p_diloco fragment {int(fragment)}".encode()).hexdigest()


def encode_request(sha: str | None, index: int) -> bytes:
    return (bytes.fromhex(sha) if sha else bytes(DIGEST_BYTES)) + struct.pack("<I", index)


def decode_request(raw: bytes) -> tuple[str, int] | None:
    if len(raw) != DIGEST_BYTES + 4:
        return None
    return raw[:DIGEST_BYTES].hex(), struct.unpack("<I", raw[DIGEST_BYTES:])[0]


def state_chunk_map(tensors: Sequence[torch.Tensor], n_params: int) -> ChunkMap:
    """The chunks of a state: the first ``n_params`` tensors are one region, the rest another."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    return ChunkMap([sizes[:n_params], sizes[n_params:]])


def _byte_views(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    return [t.detach().reshape(-1).view(torch.uint8).numpy() for t in tensors]


def read_chunk(views: Sequence[np.ndarray], chunks: ChunkMap, index: int) -> bytes:
    return b"".join(views[t][a:b].tobytes() for t, a, b in chunks.spans(index))


def write_chunk(views: Sequence[np.ndarray], chunks: ChunkMap, index: int, data: bytes) -> None:
    import numpy as np

    source = np.frombuffer(data, dtype=np.uint8)
    offset = 0
    for t, a, b in chunks.spans(index):
        views[t][a:b] = source[offset:offset + b - a]
        offset += b - a


_ANY = bytes(DIGEST_BYTES).hex()

PIN_S = MANIFEST_GRACE_S + 2.0
"""A donor that served a manifest or a chunk this recently counts as serving a download (see
``StateServer.withdraw``). A joiner asks for its first chunk only once the other donors' manifests had their
grace (``core.chunks.MANIFEST_GRACE_S``, all of it when one directory entry stays silent), then checks them and
sends the request: the pin covers that grace plus 2 s for the check and the request on a loaded machine. Shorter,
a donor of rounds shorter than the grace stepped on in the gap, and every chunk request found another state."""


class ServingCounters:
    """What both processes know of the state this peer serves: counters in shared memory.

    Made by ``RoundAverager`` before its process starts, so both processes hold the same ``multiprocessing``
    values: the averager process counts what it serves (:class:`ChunkServer`), the training process
    reads the counts and marks the state live or withdrawn (``state_server.StateServer``)."""

    def __init__(self) -> None:
        self.version = mp.Value(ctypes.c_int64, 0)
        """Bumped by the host before the served tensors change; a stream stops when it changed."""
        self.streams_open = mp.Value(ctypes.c_int64, 0)
        """Downloads and chunk requests being served right now (the host waits for them before changing the
        state)."""
        self.manifests_served = mp.Value(ctypes.c_int64, 0)
        """Manifests handed to joiners: each download (or catch-up) of our state starts with one."""
        self.last_served = mp.Value(ctypes.c_double, 0.0)
        """Wall time the last manifest or state chunk was served: a joiner between two requests is still
        downloading."""
        self.published = mp.Value(ctypes.c_int64, 0)
        """Bumped by the host each time it publishes a state: the averager process fetches what it serves again
        (its cache is of an older publication), without cutting the streams under way as a version change
        does. Why: with fragments, one fragment is published beside the others, and a request served between
        its withdrawal and its publication cached the others alone, hiding it until every stream closed."""
        self.live = mp.Value(ctypes.c_bool, False)
        """The host serves a state now (published and not withdrawn): a manifest request that finds it
        withdrawn waits for the next one (``chunk_transfer.REPUBLISH_WAIT_S``)."""

    def bump_version(self) -> None:
        with self.version.get_lock():
            self.version.value += 1

    def bump_published(self) -> None:
        with self.published.get_lock():
            self.published.value += 1

    def downloading(self) -> bool:
        """A joiner is downloading our state: a stream is open, or a manifest or chunk was served moments ago
        (a joiner between two requests)."""
        return int(self.streams_open.value) > 0 or time.time() - self.last_served.value < PIN_S




@dataclass
class _Served:
    """What the averager process serves for one version of the host's state (views, not copies)."""

    version: int
    manifests: dict[str, bytes]
    """Request digest -> manifest (msgpack): all zeros for the state's, the base state's digest for the
    update's."""
    objects: dict[str, tuple[list[np.ndarray], ChunkMap]]
    """Digest -> byte views of its tensors and their chunks."""
    published: int = 0
    """``ServingCounters.published`` when it was fetched."""

    @classmethod
    def of(cls, version: int, metadata: dict, tensors: Sequence[torch.Tensor]) -> _Served:
        if "f" in metadata:
            return cls.of_fragments(version, metadata["f"], tensors)
        state, update = metadata["s"], metadata.get("u")
        n_state = state["np"] + state["no"]
        views = _byte_views(tensors)
        manifests = {_ANY: MSGPackSerializer.dumps(state)}
        objects = {state["sha"]: (views[:n_state], state_chunk_map(tensors[:n_state], state["np"]))}
        if update is not None:
            manifests[update["base"]] = MSGPackSerializer.dumps(update)
            objects[update["sha"]] = (views[n_state:], state_chunk_map(tensors[n_state:], update["np"]))
        return cls(version, manifests, objects)

    @classmethod
    def of_fragments(cls, version: int, metas: Sequence[dict | None], tensors: Sequence[torch.Tensor]) -> _Served:
        """Each fragment's state (``StateServer``'s fragments, in order; None: not served now), its manifest
        under :func:`fragment_selector`."""
        views = _byte_views(tensors)
        manifests: dict[str, bytes] = {}
        objects: dict[str, tuple[list[np.ndarray], ChunkMap]] = {}
        at = 0
        for fragment, meta in enumerate(metas):
            if meta is None:
                continue
            n = meta["np"] + meta["no"]
            manifests[fragment_selector(fragment)] = MSGPackSerializer.dumps(meta)
            objects[meta["sha"]] = (views[at:at + n], state_chunk_map(tensors[at:at + n], meta["np"]))
            at += n
        return cls(version, manifests, objects)


class ChunkServer:
    """The donor's half, in the averager process: ``rpc_state_chunk``'s answers (the module docstring).

    :param counters: the shared counters both processes read (``state_server.ServingCounters``).
    :param host_state: hivemind's fetch of the served state from the training process (metadata, tensors, _).
    :param sharing: whether this peer shares state now (hivemind's ``allow_state_sharing``, set by the host).
    :param fault_hook: test-only, see ``runner.FaultHook``.
    """

    def __init__(self, counters: ServingCounters, host_state: Callable[[], Awaitable[tuple[Any, Any, Any]]],
                 sharing: Callable[[], bool], fault_hook: Callable[[str], Any]):
        self.counters, self._host_state, self._sharing, self._fault_hook = counters, host_state, sharing, fault_hook
        self._cache: _Served | None = None
        """What was fetched from the host for the current version (views, not copies); dropped once nobody
        downloads, so it holds no old tensors alive."""

    async def _served(self, version: int) -> _Served | None:
        cache = self._cache
        published = self.counters.published.value  # read before the fetch: a publication after it refetches
        if cache is not None and cache.version == version and cache.published == published:
            return cache
        self._cache = None
        if not self._sharing():
            logger.debug("No state to serve: this peer does not share state now")
            return None
        try:
            metadata, tensors, _ = await self._host_state()
        except Exception as e:  # noqa: BLE001 - withdrawn meanwhile: not served
            logger.debug("No state to serve: %r", e)
            return None
        if self.counters.version.value != version:
            logger.debug("No state to serve: the state changed while it was fetched from the training process")
            return None
        cache = self._cache = _Served.of(version, MSGPackSerializer.loads(metadata), tensors)
        cache.published = published
        return cache

    async def _until_republished(self) -> None:
        """While this peer shares state but has withdrawn it to step on, wait (at most ``REPUBLISH_WAIT_S``) for
        the new one. A shared flag polled every 20 ms: the host publishes from another process."""
        deadline = time.monotonic() + REPUBLISH_WAIT_S
        while self._sharing() and not self.counters.live.value and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def serve(self, request: averaging_pb2.DownloadData) -> AsyncIterator[averaging_pb2.DownloadData]:
        """One chunk of the served state or update, or a manifest (see the module docstring); the caller has
        checked who asks (``access.AccessGate.chunk_slot``)."""
        parsed = decode_request(request.metadata)
        if parsed is None:
            return
        sha, index = parsed
        counters = self.counters
        if index == MANIFEST:
            # before counting as an open stream: the host waits for open streams before it steps on
            await self._until_republished()
        with counters.streams_open.get_lock():
            counters.streams_open.value += 1
        try:
            version = counters.version.value
            served = await self._served(version)
            if served is None:
                return
            if index == MANIFEST:
                manifest = served.manifests.get(sha)
                if manifest is None:
                    logger.debug("No manifest for digest %s: another state is served now", sha[:12])
                else:
                    with counters.manifests_served.get_lock():
                        counters.manifests_served.value += 1
                    # A joiner holding a manifest is downloading: it asks for chunks once the other donors it
                    # asked answered (core.chunks.manifest_wait_s). Unpinned, a donor of sub-second rounds
                    # changed its state in that gap, and every chunk request found another state (seen: a
                    # joiner failed 6 downloads in a row, 0 chunks each, in test_poisoned_catch_up.py).
                    counters.last_served.value = time.time()
                    yield averaging_pb2.DownloadData(metadata=manifest)
                return
            found = served.objects.get(sha)
            if found is None or index >= found[1].count:
                return
            data = read_chunk(*found, index)
            self._fault_hook("state_chunk")
            for offset in range(0, len(data), PART_BYTES):
                if counters.version.value != version:
                    logger.info("Stopped serving a state chunk: this peer's state changed meanwhile")
                    return
                yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(
                    buffer=data[offset:offset + PART_BYTES]))
            counters.last_served.value = time.time()
        finally:
            with counters.streams_open.get_lock():
                counters.streams_open.value -= 1
                if counters.streams_open.value == 0:
                    self._cache = None


# ------------------------------------------------------------------ fetching (training process)


def request_manifests(pipe: Any, peers: Sequence[str], *, timeout: float, max_bytes: int,
                      base: str | None = None) -> dict[str, bytes | str]:
    """Each donor's raw state manifest (msgpack, at most ``max_bytes``), or why there is none; with ``base``,
    the manifest of the update it serves from state ``base`` to its own. ``pipe``: the averager's command pipe;
    the averager process fetches (:meth:`ChunkFetcher.fetch_manifests`)."""
    future = MPFuture()
    commands.send(pipe, commands.FetchManifests(list(peers), timeout, max_bytes, base, future))
    return future.result(timeout=timeout + _GRACE_S)


def request_chunks(pipe: Any, peers: Sequence[str], sha: str, dest: Sequence[torch.Tensor], n_params: int,
                   digests: bytes, have: set[int], partial: Path | None, timeout: float) -> dict[str, Any]:
    """Fetch the chunks of state ``sha`` not in ``have`` from ``peers`` in parallel, each checked against
    ``digests`` and written into ``dest`` (shared-memory tensors), and kept in ``partial`` if given.
    Returns ``done`` (chunk indices now held) and ``dropped`` (donor -> reason). ``pipe``: as above."""
    future = MPFuture()
    commands.send(pipe, commands.FetchChunks(
        list(peers), sha, list(dest), n_params, digests, sorted(have), str(partial) if partial else None, timeout,
        future))
    return future.result(timeout=timeout + _GRACE_S)


# ------------------------------------------------------------------ fetching (averager process)


class ChunkFetcher:
    """The joiner's half, in the averager process: manifests and chunks from donors, each answer bounded.

    :param stub: hivemind's stub of the averager servicer on a donor (base58 id), made on this process's
      ``P2P``.
    :param next_chunk_timeout: longest wait for a donor's next message (hivemind's ``next_chunk_timeout``).
    """

    def __init__(self, stub: Callable[[str], Any], next_chunk_timeout: float | None):
        self._stub, self._next_chunk_timeout = stub, next_chunk_timeout

    async def request(self, peer: str, sha: str | None, index: int, max_bytes: int) -> tuple[bytes, bytes]:
        """(metadata, data) of one answer, at most ``max_bytes`` in all; raises when the donor sent nothing."""
        stream = await self._stub(peer).rpc_state_chunk(averaging_pb2.DownloadData(metadata=encode_request(sha, index)))
        metadata, parts, received = b"", [], 0
        async for message in aiter_with_timeout(stream, self._next_chunk_timeout):
            received += len(message.metadata) + len(message.tensor_part.buffer)
            if received > max_bytes:
                raise ValueError(f"sent more than the expected {max_bytes} bytes")
            metadata = metadata or bytes(message.metadata)
            parts.append(message.tensor_part.buffer)
        if not received:
            raise ValueError("sent nothing (it serves another state now, or is busy)")
        return metadata, b"".join(parts)

    async def fetch_manifests(self, peers: list[str], timeout: float, max_bytes: int, base: str | None,
                              future: MPFuture) -> None:
        """``commands.FetchManifests``: ``future`` gets each donor's manifest or why there is none."""
        async def one(peer: str) -> bytes | str:
            try:
                metadata, _ = await asyncio.wait_for(self.request(peer, base, MANIFEST, max_bytes), timeout)
                return metadata
            except Exception as e:  # noqa: BLE001 - any failure is this donor's
                return f"no manifest: {type(e).__name__}: {e}"

        # Not a gather of every answer: one silent donor held every joiner for the whole timeout
        # (core.chunks.manifest_wait_s says how long the others get once one answered).
        tasks = {asyncio.create_task(one(p)): p for p in peers}
        try:
            began, first = time.monotonic(), None
            pending = set(tasks)
            while pending:
                left = manifest_wait_s(first, timeout) - (time.monotonic() - began)
                if left <= 0:
                    break
                done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if first is None and any(isinstance(t.result(), bytes) for t in done):
                    first = time.monotonic() - began
            for task in pending:
                task.cancel()
            future.set_result({peer: task.result() if task.done() and not task.cancelled()
                               else "no manifest: did not answer while the other donors did"
                               for task, peer in tasks.items()})
        except Exception as e:  # noqa: BLE001 - a plain RuntimeError survives the trip to the host
            for task in tasks:
                task.cancel()
            future.set_exception(RuntimeError(f"{type(e).__name__}: {e}"))

    async def fetch_chunks(self, peers: list[str], sha: str, dest: list[torch.Tensor], n_params: int,
                           digests: bytes, have: list[int], partial: str | None, timeout: float,
                           future: MPFuture) -> None:
        """``commands.FetchChunks``: ``future`` gets the chunks now held, the donors dropped and what each served."""
        chunks = state_chunk_map(dest, n_params)
        plan = ChunkPlan(chunks.count, peers, have=have, depth=DEPTH)
        views = _byte_views(dest)
        store = PartialStore(Path(partial), sha, chunks) if partial else None
        changed, complete = asyncio.Event(), asyncio.Event()

        def drop(peer: str, reason: str) -> None:
            if peer in plan.out:
                logger.warning("Dropped state donor %s: %s (its chunks go to the other donors)", peer, reason)
                plan.failed(peer, reason)
            changed.set()

        async def worker(peer: str) -> None:
            while not plan.finished and peer in plan.out:
                index = plan.next(peer)
                if index is None:
                    changed.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(changed.wait(), 1.0)
                    continue
                length = chunks.length(index)
                try:
                    _, data = await self.request(peer, sha, index, length)
                except Exception as e:  # noqa: BLE001 - any failure is this donor's
                    drop(peer, f"chunk {index}: {type(e).__name__}: {e}")
                    return
                if len(data) != length:  # the stream ended early without an error (the donor stopped serving)
                    drop(peer, f"chunk {index} cut short: {len(data)} of {length} bytes")
                    return
                if hashlib.sha256(data).digest() != digests[index * DIGEST_BYTES:(index + 1) * DIGEST_BYTES]:
                    drop(peer, f"chunk {index} {BAD_CHUNK}")
                    return
                if plan.received(peer, index):
                    write_chunk(views, chunks, index, data)
                    if store is not None:
                        store.write(index, data)
                    if plan.finished:
                        complete.set()
                changed.set()

        try:
            # Ends when every chunk is in, even while copies of the last requests are still out at slow donors
            # (they are cancelled), when every donor was dropped, or at the deadline.
            tasks = [asyncio.create_task(worker(p)) for p in peers for _ in range(DEPTH)]
            workers = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
            finished = asyncio.create_task(complete.wait())
            await asyncio.wait({workers, finished}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in (*tasks, finished):
                task.cancel()
            await asyncio.gather(workers, finished, return_exceptions=True)
            for peer in list(plan.out):
                if not plan.finished:
                    drop(peer, "the download ran out of time")
            for peer, count in plan.overtaken.items():
                logger.warning("State donor %s was slow: %d of its chunk requests were answered first by other "
                               "donors", peer, count)
            logger.info("State chunks per donor: %s", ", ".join(f"{p} {n}" for p, n in plan.served.items()))
            future.set_result(dict(done=sorted(plan.done), dropped=dict(plan.dropped), served=dict(plan.served)))
        except Exception as e:  # noqa: BLE001 - a plain RuntimeError survives the trip to the host
            future.set_exception(RuntimeError(f"{type(e).__name__}: {e}"))


class ChunkSource(Protocol):
    """What :func:`fetch_verified` uses of the averager (``RoundAverager.fetch_chunks``)."""

    def fetch_chunks(self, peers: Sequence[str], sha: str, dest: Sequence[torch.Tensor], n_params: int,
                     digests: bytes, have: set[int], partial: Path | None, timeout: float) -> dict[str, Any]: ...


def fetch_verified(averager: ChunkSource, sources: list[str], meta: dict, dest: list[torch.Tensor],
                   chunks: ChunkMap, partial_dir: Path | None, deadline: float
                   ) -> tuple[str | None, dict[str, str], dict[str, int]]:
    """Fill ``dest`` with the state ``meta`` describes (a verified manifest, ``swarm.state``): chunks kept on
    disk first, then from ``sources`` in parallel. Returns (what went wrong or ``None``, donors dropped with
    their reasons, verified chunks each donor delivered; a donor that sent a bad chunk is left out of the
    last)."""
    digests = meta["pc"] + meta["mc"]
    store = PartialStore(partial_dir, meta["sha"], chunks) if partial_dir is not None else None
    have: set[int] = set()
    if store is not None:
        try:
            store.prepare()
        except OSError as e:
            logger.warning("Cannot keep the state download on disk (%s): it will not resume after a restart", e)
            store = None
    if store is not None:
        views = [t.reshape(-1).view(torch.uint8).numpy() for t in dest]
        have = store.load(digests, lambda index, data: write_chunk(views, chunks, index, data))
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return "state_download_timeout_s ran out", {}, {}
    try:
        result = averager.fetch_chunks(sources, meta["sha"], dest, meta["np"], digests, have,
                                       store.directory if store is not None else None, remaining)
    except Exception as e:
        return f"download failed: {e}", {}, {}
    missing = chunks.count - len(result["done"])
    served = {p: n for p, n in result["served"].items() if n > 0 and BAD_CHUNK not in result["dropped"].get(p, "")}
    if missing:
        return f"{INCOMPLETE}: {missing} of {chunks.count} chunks missing (kept the rest)", result["dropped"], served
    if store is not None:
        store.remove()
    return None, result["dropped"], served
