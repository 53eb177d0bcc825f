"""State sharing for joiners: serve (parameters, outer-optimizer tensors, metadata) and download it verified.

Serving goes through hivemind's state protocol: a donor announces itself under ``{prefix}.all_averagers``
with its epoch as priority, and answers ``rpc_download_state`` with msgpack metadata and protobuf tensors from
``get_current_state`` (nothing is pickled). The donor serves its live anchors and momentum, not a copy: before
they change (an outer step, a resync) the host withdraws them (``StateServer.withdraw``), waits for downloads
in flight to end (at most ``state_download_timeout_s``, the joiner's own limit), and bumps a version that a
stream checks before every message it sends, after the tensor it carries was serialized; so a download is
either all of one epoch or cut short (the joiner then rejects it and asks the next donor). Downloading asks donors one at a time, highest epoch first, through
the averager's own stub, and accepts a state only after checking it:

- metadata: run id and model fingerprint equal ours, counts of parameter and optimizer tensors as expected;
- tensors: count, shapes and dtypes equal the local template, every value finite, byte size bounded;
- epoch: not older than the swarm's (``records.global_epoch`` unless ``min_epoch`` is given), and not past
  ``core.evidence.EPOCH_LIMIT``;
- parameters and momentum: their digest (``checksum.state_sha256``) equals the one the donor claims, and the
  published checksums of that epoch allow it (``core.evidence.state_verdict``): with ``trusted`` peers, a
  state from any other donor must carry a digest trusted peers published; without trusted peers, no vote
  counts (a head count of free identities).

Donors this peer trusts are asked first; the rest in the order of their self-declared priority.

A rejected donor is logged with the reason and the next one is tried. ``None`` means nobody served an
acceptable state: start fresh if this is the first peer, otherwise wait and retry.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import multiprocessing as mp
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator  # noqa: UP035 - hivemind detects streaming RPCs by typing's alias only

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, ValueWithExpiration
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.core.evidence import EPOCH_LIMIT, state_verdict
from p2p_diloco.swarm.checksum import params_sha256, state_sha256
from p2p_diloco.swarm.records import SHA256_PATTERN, fetch_checksums, fetch_progress, global_epoch

if TYPE_CHECKING:
    from p2p_diloco.swarm.averager import RoundAverager

logger = logging.getLogger(__name__)

STATE_VERSION = 2
"""2: ``sha`` covers the outer momentum too (``checksum.state_sha256``)."""
_MAX_METADATA_BYTES = 65536
_GRACE_S = 10.0
StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


@dataclass
class SwarmState:
    """A verified state, ready to load: CPU tensors in the template's shapes and dtypes."""

    params: list[torch.Tensor]
    opt_tensors: list[torch.Tensor]
    epoch: int
    state_sha256: str
    """``checksum.state_sha256`` of the parameters and momentum."""
    params_sha256: str
    """``checksum.params_sha256`` of the parameters alone (part of the above: reused, not hashed again)."""
    donor: str
    """Peer id the state came from."""
    rejected: tuple[str, ...] = ()
    """Donors tried before, each as "peer id: reason"."""


class StateSharingMixin:
    """State serving and per-donor download, mixed into ``RoundAverager`` (a hivemind averager).

    Call :meth:`init_state_sharing` before the averager process starts: the two counters it creates live in
    shared memory, read and written by both processes."""

    _state_provider: StateProvider | None = None

    def init_state_sharing(self) -> None:
        self._state_version = mp.Value(ctypes.c_int64, 0)
        """Bumped by the host before the served tensors change; a stream stops when it changed."""
        self._streams_open = mp.Value(ctypes.c_int64, 0)
        """Downloads being served right now (the host waits for them before changing the state)."""

    def bump_state_version(self) -> None:
        with self._state_version.get_lock():
            self._state_version.value += 1

    def streams_open(self) -> int:
        return int(self._streams_open.value)

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's stream, stopped as soon as the host's state changed under it (see the module docstring)."""
        with self._streams_open.get_lock():
            self._streams_open.value += 1
        try:
            version = self._state_version.value
            async for message in super().rpc_download_state(request, context):  # type: ignore[misc]
                # the tensor in ``message`` was serialized before this check: if the version still holds, the
                # host had not started changing the state then
                if self._state_version.value != version:
                    logger.info("Stopped serving a state download: this peer's state changed meanwhile")
                    return
                yield message
        finally:
            with self._streams_open.get_lock():
                self._streams_open.value -= 1

    def set_state_provider(self, provider: StateProvider | None) -> None:
        """Serve ``provider()`` (metadata dict, tensors) to joiners from now on; ``None`` stops serving."""
        self._state_provider = provider
        self.allow_state_sharing = provider is not None  # type: ignore[attr-defined]

    def get_current_state(self) -> tuple[dict[str, Any], list[torch.Tensor], None]:
        """Called by hivemind in this (host) process when a peer downloads our state."""
        provider = self._state_provider
        if provider is None:
            raise RuntimeError("this peer is not sharing state")
        metadata, tensors = provider()
        return metadata, list(tensors), None

    def state_donors(self) -> list[tuple[str, float]]:
        """Peers announcing shareable state for this run and model: ``(peer id, priority)``, best first."""
        key = f"{self.prefix}.all_averagers"  # type: ignore[attr-defined]
        found = self.dht.get(key, latest=True, return_future=True).result(timeout=30)  # type: ignore[attr-defined]
        if not isinstance(found, ValueWithExpiration) or not isinstance(found.value, dict):
            return []
        donors = []
        for subkey, entry in list(found.value.items())[:4096]:
            try:
                peer = PeerID(subkey)
            except Exception:
                continue
            priority = entry.value if isinstance(entry, ValueWithExpiration) else None
            if (
                isinstance(priority, bool)
                or not isinstance(priority, (int, float))
                or not math.isfinite(priority)
            ):
                continue  # None marks a peer that stopped sharing
            allowed = getattr(self, "_allowed", None)
            if allowed is not None and peer.to_base58() not in allowed:
                continue  # a private swarm takes state only from its own members
            if peer != self.peer_id:  # type: ignore[attr-defined]
                donors.append((peer.to_base58(), float(priority), random.random()))
        return [(peer, priority) for peer, priority, _ in sorted(donors, key=lambda d: (-d[1], d[2]))]

    def download_state_from(
        self, peer: str, *, timeout: float, max_bytes: int, dtypes: Sequence[str], max_tensors: int
    ) -> tuple[bytes | None, list[torch.Tensor]]:
        """Raw ``(metadata bytes, tensors)`` from one donor, bounded in time, bytes and tensor count."""
        future = MPFuture()
        request = dict(
            peer=PeerID.from_base58(peer).to_bytes(),
            timeout=timeout,
            max_bytes=max_bytes,
            dtypes=tuple(dtypes),
            max_tensors=max_tensors,
            future=future,
        )
        self._outer_pipe.send(("_download_state_from", [], request))  # type: ignore[attr-defined]
        return future.result(timeout=timeout + _GRACE_S)

    async def _download_state_from(
        self,
        peer: bytes,
        timeout: float,
        max_bytes: int,
        dtypes: tuple[str, ...],
        max_tensors: int,
        future: MPFuture,
    ) -> None:
        try:
            fetched = await asyncio.wait_for(
                self._fetch_state(PeerID(peer), max_bytes, dtypes, max_tensors), timeout
            )
            future.set_result(fetched)
        except Exception as e:
            # a plain RuntimeError: the original may not survive the trip to the host process
            future.set_exception(RuntimeError(f"{type(e).__name__}: {e}"))

    async def _fetch_state(
        self, peer: PeerID, max_bytes: int, dtypes: tuple[str, ...], max_tensors: int
    ) -> tuple[bytes | None, list[torch.Tensor]]:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)  # type: ignore[attr-defined]
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, parts, tensors, received, started = None, [], [], 0, 0
        async for message in aiter_with_timeout(stream, self.next_chunk_timeout):  # type: ignore[attr-defined]
            received += message.ByteSize()
            if received > max_bytes:
                raise ValueError(f"donor sent more than the expected {max_bytes} bytes")
            if message.metadata:
                if metadata is not None or len(message.metadata) > _MAX_METADATA_BYTES:
                    raise ValueError("donor sent metadata twice or too large")
                metadata = bytes(message.metadata)
            part = message.tensor_part
            if part.dtype:
                if part.dtype not in dtypes:
                    raise ValueError(f"donor sent a tensor of unexpected dtype {part.dtype[:32]!r}")
                started += 1
                if started > max_tensors:
                    raise ValueError(f"donor sent more than {max_tensors} tensors")
                if parts:
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
            parts.append(part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return metadata, tensors


def make_state_metadata(
    run_id: str, fingerprint: str, epoch: int, sha: str, n_params: int, n_opt: int
) -> dict:
    return {
        "v": STATE_VERSION,
        "run": run_id,
        "fp": fingerprint,
        "ep": epoch,
        "sha": sha,
        "np": n_params,
        "no": n_opt,
    }


class StateServer:
    """Serves this peer's live state to joiners: ``publish`` after each change, ``withdraw`` before the next.

    No copy is kept: the tensors served are the anchors and momentum themselves (CPU), so serving costs no
    memory beyond hivemind's per-tensor serialization. The price: the owner must call :meth:`withdraw` before
    changing them, which waits for downloads in flight (bounded, see the module docstring).
    """

    def __init__(self, averager: RoundAverager):
        self._averager = averager
        self._lock = threading.Lock()
        self._state: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        self.served = 0
        """Downloads handed the state so far. hivemind runs ``get_current_state`` in this (host) process
        (its background thread answers the averager process), so a plain counter under the lock is exact."""
        self.waited_s = 0.0
        """Seconds :meth:`withdraw` spent waiting for downloads in flight, in total."""

    def publish(self, params: Sequence[torch.Tensor], opt_tensors: Sequence[torch.Tensor], epoch: int,
                sha: str | None = None) -> str:
        """Serve ``params`` and ``opt_tensors`` (CPU tensors, not copied) as the state of ``epoch``; returns
        its digest (``checksum.state_sha256``). ``sha``: the parameters' sha256 when the caller hashed them
        already (one pass over them per round; the digest then adds only the momentum's pass).

        A client-mode peer serves nothing: it accepts no incoming connections, so no joiner could download
        from it, and hivemind refuses to announce its state. It only gets the checksum back.
        """
        sha = sha if sha is not None else params_sha256(params)
        if self._averager.client_mode:
            return state_sha256(params, opt_tensors, params_sha=sha)
        tensors = [t.detach() for t in (*params, *opt_tensors)]
        if any(t.device.type != "cpu" for t in tensors):
            raise ValueError("the served state must be CPU tensors (keep anchors and momentum on the CPU)")
        sha = state_sha256(params, opt_tensors, params_sha=sha)
        cfg = self._averager.cfg
        metadata = make_state_metadata(
            cfg.run_id, self._averager.fingerprint, int(epoch), sha, len(params), len(opt_tensors)
        )
        with self._lock:
            self._state = (metadata, tensors)
        self._averager.state_sharing_priority = float(epoch)  # donors with newer state are asked first
        self._averager.set_state_provider(self._provide)
        return sha

    def _provide(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        with self._lock:
            if self._state is None:
                raise RuntimeError("this peer's state is changing; ask another donor")
            self.served += 1
            return self._state

    def withdraw(self, timeout: float) -> None:
        """The served tensors are about to change: stop handing them out, wait up to ``timeout`` s for the
        downloads in flight to end, then make any still running stop before their next message."""
        with self._lock:
            self._state = None
        if self._averager.client_mode or not self._averager.is_alive():
            return
        began = time.monotonic()
        deadline = began + timeout
        while self._averager.streams_open() > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._averager.streams_open() > 0:
            logger.warning("A state download still runs after %.0f s; cutting it off to apply the outer step",
                           timeout)
        self._averager.bump_state_version()
        self.waited_s += time.monotonic() - began

    def stop(self) -> None:
        """Stop serving (e.g. while this peer resyncs itself)."""
        self._averager.set_state_provider(None)


def check_state_metadata(raw: bytes | None, run_id: str, fingerprint: str, n_params: int, n_opt: int) -> dict | str:
    """A donor's state metadata if it is valid and describes our run and model, else the reason it is not."""
    if raw is None:
        return "donor sent no metadata (it is probably not sharing state)"
    try:
        meta = MSGPackSerializer.loads(raw)
    except Exception:
        return "metadata is not valid msgpack"
    if not isinstance(meta, dict) or set(meta) != {"v", "run", "fp", "ep", "sha", "np", "no"}:
        return "metadata lacks the expected fields"
    if meta["v"] != STATE_VERSION:
        return f"unsupported state version {meta['v']!r}"
    if meta["run"] != run_id or meta["fp"] != fingerprint:
        return f"state of run {str(meta['run'])[:64]!r} / model {str(meta['fp'])[:64]!r}, not ours"
    if isinstance(meta["ep"], bool) or not isinstance(meta["ep"], int) or not 0 <= meta["ep"] <= 10**9:
        return "invalid epoch"
    if meta["ep"] > EPOCH_LIMIT:
        return f"implausible epoch {meta['ep']} (over {EPOCH_LIMIT})"
    if not isinstance(meta["sha"], str) or not SHA256_PATTERN.fullmatch(meta["sha"]):
        return "invalid parameter checksum"
    if meta["np"] != n_params or meta["no"] != n_opt:
        return f"donor has {meta['np']!r} parameter and {meta['no']!r} optimizer tensors, expected {n_params} and {n_opt}"
    return meta


def _check_tensors(tensors: list[torch.Tensor], templates: Sequence[torch.Tensor]) -> str | None:
    if len(tensors) != len(templates):
        return f"donor sent {len(tensors)} tensors, expected {len(templates)}"
    for i, (tensor, template) in enumerate(zip(tensors, templates, strict=True)):
        if tuple(tensor.shape) != tuple(template.shape) or tensor.dtype != template.dtype:
            return f"tensor {i} is {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(template.shape)} {template.dtype}"
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"tensor {i} holds NaN or infinite values"
    return None


def download_state(
    averager: RoundAverager,
    template_params: Sequence[torch.Tensor],
    template_opt: Sequence[torch.Tensor] = (),
    *,
    min_epoch: int | None = None,
    timeout: float | None = None,
    max_donors: int = 8,
    trusted: frozenset[str] | None = None,
) -> SwarmState | None:
    """Download and verify the swarm's state, trying up to ``max_donors`` donors within ``timeout`` seconds
    (default ``cfg.state_download_timeout_s``). ``min_epoch`` defaults to the swarm's global epoch.
    ``trusted``: the peers whose donors and checksums this peer trusts (``core.evidence``), or ``None`` when
    none of them is online (a newcomer)."""
    cfg = averager.cfg
    deadline = time.monotonic() + (timeout if timeout is not None else cfg.state_download_timeout_s)
    templates = list(template_params) + list(template_opt)
    try:
        donors = averager.state_donors()
        if trusted:
            donors.sort(key=lambda donor: donor[0] not in trusted)  # stable: by priority within each kind
        donors = donors[:max_donors]
        if min_epoch is None:
            progress = fetch_progress(averager.dht, cfg.run_id)
            min_epoch = global_epoch(progress, fingerprint=averager.fingerprint) or 0
    except Exception as e:
        logger.warning("Cannot look up state donors or the swarm's epoch: %r", e)
        return None
    expected_bytes = sum(t.numel() * t.element_size() for t in templates)
    max_bytes = int(expected_bytes * 1.05) + 2**20 + len(templates) * 1024  # protobuf fields and part headers
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in templates})
    votes: dict[int, dict[str, str]] = {}
    rejected: list[str] = []
    outvoted_only: list[str] = []  # newcomers: donors whose only fault was a head count of untrusted votes

    def attempt(peer: str, count_votes: bool) -> tuple[SwarmState | None, str | None, bool]:
        """(state, problem, vetoed by votes alone) of one donor."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None, "not tried, state_download_timeout_s ran out", False
        try:
            raw, tensors = averager.download_state_from(
                peer, timeout=remaining, max_bytes=max_bytes, dtypes=dtypes, max_tensors=len(templates)
            )
            meta = check_state_metadata(
                raw, cfg.run_id, averager.fingerprint, len(template_params), len(template_opt)
            )
            problem = meta if isinstance(meta, str) else _check_tensors(tensors, templates)
        except Exception as e:
            return None, f"download failed: {e}", False
        if problem is None and meta["ep"] < min_epoch:
            problem = f"state of epoch {meta['ep']} is older than the swarm's epoch {min_epoch}"
        if problem is not None:
            return None, problem, False
        params = tensors[: len(template_params)]
        params_sha = params_sha256(params)
        sha = state_sha256(params, tensors[len(template_params) :], params_sha=params_sha)
        if sha != meta["sha"]:
            return None, f"parameters and momentum hash to {sha[:12]}..., the donor claims {meta['sha'][:12]}...", False
        if count_votes:
            if meta["ep"] not in votes:
                votes[meta["ep"]] = fetch_checksums(averager.dht, cfg.run_id, meta["ep"])
            verdict = state_verdict(peer, sha, votes[meta["ep"]], trusted)
            if verdict is not None:
                return None, f"parameters {sha[:12]}... {verdict} for epoch {meta['ep']}", trusted is None
        state = SwarmState(params=params, opt_tensors=tensors[len(template_params) :], epoch=meta["ep"],
                           state_sha256=sha, params_sha256=params_sha, donor=peer, rejected=tuple(rejected))
        return state, None, False

    for peer, _priority in donors:
        state, problem, vetoed = attempt(peer, count_votes=True)
        if state is not None:
            logger.info("Loaded state of epoch %d from %s", state.epoch, peer)
            return state
        logger.warning("Rejected state from %s: %s", peer, problem)
        rejected.append(f"{peer}: {problem}")
        if vetoed:
            outvoted_only.append(peer)
        if problem.startswith("not tried"):
            break
    # A newcomer counts votes only to choose among donors: voters it cannot tell apart are free identities,
    # and letting them veto every donor kept joiners from the honest state and split the swarm at start-up
    # (ten Sybil votes against the one honest donor, tests/integration/test_red_team.py). An attacker that
    # serves a state can vote for it as well, so the veto protected nothing a newcomer could otherwise keep.
    for peer in outvoted_only:
        state, problem, _ = attempt(peer, count_votes=False)
        if state is not None:
            logger.warning("Loaded state of epoch %d from %s, which only untrusted checksum votes contradicted "
                           "(no trusted peer is online to tell; give --trusted-peers in an open swarm)",
                           state.epoch, peer)
            return state
        rejected.append(f"{peer}: {problem}")
    logger.info("No acceptable state from %d donor(s)", len(rejected))
    return None
