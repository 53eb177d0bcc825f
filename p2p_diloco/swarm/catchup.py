"""A joiner one round behind applies the round it missed instead of downloading the whole state again.

Why: a state download that outlasts a round leaves the joiner at epoch ``e`` while the swarm moved to
``e + 1``. Downloading the newest state again takes as long again, during which the swarm moves on again:
at 1 Mbit/s a joiner chased the swarm forever (BENCHMARKS.md). Fetching only the changed chunks does not
help, as every outer step changes every parameter. The round's update is what changed, and it is half a
state (no momentum) or less: the fresh mean of the all-reduce, plus the late-work term in rounds that
folded late work. Every member of the round applied the same tensors (``core.delayed.apply_round``), bitwise
identical on all of them, so a joiner that applies them to state ``e`` gets state ``e + 1`` bitwise, and
checks it against the digest of ``e + 1`` the swarm published, with the same trust rules as a download.

Serving costs the donors no memory in a blocking round: the fresh mean is the averager's own shared buffer,
untouched until the next round's pseudo-gradient is written into it (``StateServer.withdraw_update``); a
late-work term is kept for that one round. Only when a joiner fetched a manifest from the donor since the
update was published does the donor copy the update then (4 bytes per parameter) and serve the copy through
that round, until its outer step: a joiner whose state download lasts about a round finishes it during the
next round, and still finds the update it needs. The update's manifest is
hashed only when a joiner first asks for it. Eager rounds serve no update (their peers' parameters differ by
design and publish no checksums).

The transfer is the state's (``swarm.chunk_transfer``): the update is asked for by the digest of the state it
applies to, its manifest checked against the digest the donor claims for it, its chunks fetched from every
donor serving the same update, each checked on receipt, then every value (:func:`implausible`); an update
with no terms is refused. Donors this peer trusts are asked first. The result is checked by the caller
before it replaces anything (``core.sync.Catchup``, which applies the update to copies): its digest must
equal the one the donor claimed, and that digest must pass ``core.evidence.state_verdict`` for epoch
``e + 1``; otherwise the joiner downloads the state again. Whom it then vouches for is
``core.evidence.credited``'s: only a donor that delivered verified chunks, and none when trusted evidence
accepted the result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.core.chunks import CHUNK_BYTES, DIGEST_BYTES, ChunkMap
from p2p_diloco.swarm.checksum import combine_state_sha, manifest_sha
from p2p_diloco.swarm.chunk_transfer import fetch_verified, state_chunk_map
from p2p_diloco.swarm.records import SHA256_PATTERN
from p2p_diloco.swarm.state import STATE_VERSION, max_manifest_bytes, nonfinite

if TYPE_CHECKING:
    from p2p_diloco.swarm.averager import RoundAverager

logger = logging.getLogger(__name__)

_FIELDS = {"v", "run", "fp", "ep", "sha", "np", "no", "cs", "pc", "mc", "base", "to"}
MAX_ABS_VALUE = 1e6
"""The largest magnitude a value of a round's update, or of the state it leads to, may have. A round's fresh
mean is an average of pseudo-gradients (how far H inner steps moved a parameter), and parameters and momentum
of a trained model stay within a few hundred; 3e38 passes as finite and overflows to infinity on the step."""


@dataclass
class SwarmUpdate:
    """A round's update, each chunk verified against its manifest (the result is checked by the caller)."""

    fresh: list[torch.Tensor] | None
    stale: list[torch.Tensor] | None
    epoch: int
    """The epoch of the state it applies to; applying it gives ``epoch + 1``."""
    result_sha: str
    """The state digest the donors claim the update leads to."""
    donor: str
    """The donor that delivered the most verified chunks (what a log names; ``""`` if none did)."""
    sources: tuple[str, ...]
    delivered: dict[str, int] | None = None
    """Donor -> verified chunks it delivered: whom ``core.evidence.credited`` may vouch for, never the donor
    merely listed first (a relay of one manifest was credited, then trusted, before)."""
    vouching: str = ""
    """A trusted donor among those that delivered verified chunks and serve this update, else ``donor``:
    whose word ``core.evidence.state_verdict`` weighs for the result."""


def check_update_metadata(raw: bytes | str | None, run_id: str, fingerprint: str,
                          layout: list[tuple[torch.dtype, tuple[int, ...]]], base_sha: str,
                          base_epoch: int) -> dict | str:
    """A donor's update manifest if it is valid, applies to ``base_sha`` and hashes to the digest it
    claims; else the reason. ``layout``: (dtype, shape) of our anchors (each term has their layout)."""
    if raw is None or isinstance(raw, str):
        return raw or "no update manifest"
    if len(raw) > max_manifest_bytes(_chunks(layout, len(layout), len(layout))):
        return "update manifest too large"
    try:
        meta = MSGPackSerializer.loads(raw)
    except Exception:
        return "update manifest is not valid msgpack"
    if not isinstance(meta, dict) or set(meta) != _FIELDS:
        return "update manifest lacks the expected fields"
    if meta["v"] != STATE_VERSION or meta["cs"] != CHUNK_BYTES:
        return "unsupported update version or chunk size"
    if meta["run"] != run_id or meta["fp"] != fingerprint:
        return "update of another run or model"
    if meta["base"] != base_sha or meta["ep"] != base_epoch:
        return "update from another state"
    if not isinstance(meta["to"], str) or not SHA256_PATTERN.fullmatch(meta["to"]):
        return "invalid result checksum"
    if meta["np"] not in (0, len(layout)) or meta["no"] not in (0, len(layout)):
        return "update terms of another layout"
    if meta["np"] == 0 and meta["no"] == 0:
        return "an update with no terms (nothing to apply: a round always has a fresh mean or a late term)"
    chunks = _chunks(layout, meta["np"], meta["no"])
    for key, count in (("pc", chunks.region_chunks[0]), ("mc", chunks.region_chunks[1])):
        if not isinstance(meta[key], bytes) or len(meta[key]) != count * DIGEST_BYTES:
            return "update manifest does not list the chunk digests our model needs"
    sha = combine_state_sha(manifest_sha(layout[:meta["np"]], chunks.region_bytes[0], meta["pc"]),
                            manifest_sha(layout[:meta["no"]], chunks.region_bytes[1], meta["mc"]))
    if sha != meta["sha"]:
        return "update manifest does not hash to the digest it claims"
    return meta


def _chunks(layout: list[tuple[torch.dtype, tuple[int, ...]]], n_fresh: int, n_stale: int) -> ChunkMap:
    sizes = [torch.empty(0, dtype=dtype).element_size() * int(torch.Size(shape).numel()) for dtype, shape in layout]
    return ChunkMap([sizes[:n_fresh], sizes[:n_stale]])


def implausible(tensors: Sequence[torch.Tensor], limit: float = MAX_ABS_VALUE) -> str | None:
    """Why ``tensors`` cannot be a round's update or a state (a value not finite, or beyond ``limit`` in
    magnitude), or ``None``."""
    problem = nonfinite(tensors)
    if problem is not None:
        return problem
    for i, tensor in enumerate(tensors):
        if tensor.is_floating_point() and tensor.numel() and float(tensor.abs().max()) > limit:
            return f"tensor {i} holds values beyond {limit:g} in magnitude"
    return None


def download_update(averager: RoundAverager, templates: Sequence[torch.Tensor], base_sha: str, base_epoch: int,
                    *, timeout: float, max_donors: int = 8, trusted: frozenset[str] | None = None
                    ) -> SwarmUpdate | None:
    """The update from state ``base_sha`` (epoch ``base_epoch``) that donors at ``base_epoch + 1`` serve, or
    ``None`` (nobody serves it: they moved on further, or the round was eager). ``trusted``: as for
    ``swarm.state.download_state``; their donors are asked first, then the rest by declared priority (a
    claim, which put an attacker's relay first before)."""
    cfg = averager.cfg
    deadline = time.monotonic() + timeout
    layout = [(t.dtype, tuple(t.shape)) for t in templates]
    try:
        donors = [peer for peer, _ in averager.state_donors()]
        if trusted:
            donors.sort(key=lambda peer: peer not in trusted)  # stable: by priority within each kind
        donors = donors[:max_donors]
        raw = averager.fetch_manifests(donors, base=base_sha, timeout=max(1.0, min(cfg.next_chunk_timeout_s, timeout)),
                                       max_bytes=max_manifest_bytes(_chunks(layout, len(layout), len(layout))))
    except Exception as e:  # noqa: BLE001 - no update: the caller downloads the state
        logger.info("No round update to catch up with: %r", e)
        return None
    manifests = {}
    for peer in donors:
        meta = check_update_metadata(raw.get(peer), cfg.run_id, averager.fingerprint, layout, base_sha, base_epoch)
        if isinstance(meta, dict):
            manifests[peer] = meta
        else:
            logger.debug("No update from %s: %s", peer, meta)
    tried = set()
    for peer, meta in manifests.items():
        key = (meta["sha"], meta["to"])
        if key in tried:
            continue
        tried.add(key)
        sources = [p for p, m in manifests.items() if (m["sha"], m["to"]) == key]
        dest = [torch.empty_like(t, memory_format=torch.contiguous_format).share_memory_()
                for t in (*templates[:meta["np"]], *templates[:meta["no"]])]
        chunks = state_chunk_map(dest, meta["np"])
        problem, dropped, served = fetch_verified(averager, sources, meta, dest, chunks, None, deadline)
        problem = problem or implausible(dest)
        for donor, reason in dropped.items():
            logger.warning("Update donor %s dropped: %s", donor, reason)
        if problem is None:
            logger.info("Fetched the update of epoch %d -> %d from %d donor(s)", base_epoch, base_epoch + 1,
                        len(sources))
            top = max(served, key=lambda p: served[p], default="")
            vouching = next((p for p in sources if trusted and p in trusted and served.get(p, 0) > 0), top)
            return SwarmUpdate(dest[:meta["np"]] or None, dest[meta["np"]:] or None, base_epoch, meta["to"], top,
                               tuple(sources), dict(served), vouching)
        logger.warning("Could not fetch the update of epoch %d from %s: %s", base_epoch, peer, problem)
    return None
