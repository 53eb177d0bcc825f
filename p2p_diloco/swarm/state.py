"""A peer's state as joiners get it: the manifest both sides agree on, and the verified download from several
donors at once, in chunks. Serving it is ``swarm.state_server``'s.

A state is (parameters, outer-optimizer tensors, metadata). Its manifest (:func:`make_state_metadata`) is
msgpack metadata and the sha256 of every 1 MiB chunk (``core.chunks``); nothing is pickled.

Downloading (:func:`download_state`) reads every donor's manifest and accepts a state only after checking:

- manifest: run id and model fingerprint equal ours, tensor counts and chunk digests as our template needs,
  and the digest computed from the chunk digests and our template's layout (``checksum.manifest_sha``)
  equals the one the donor claims; so a manifest is tied to the digest the checksum vote uses;
- epoch: not older than the swarm's (``records.global_epoch`` unless ``min_epoch`` is given), and not past
  ``core.evidence.EPOCH_LIMIT``;
- the digest (``checksum.state_sha256``: parameters and momentum) against the published checksums of that
  epoch (``core.evidence.state_verdict``): with ``trusted`` peers, a state from any other donor must carry a
  digest trusted peers published; without trusted peers, no vote counts (a head count of free identities);
- every chunk against its manifest digest, on receipt, before it is written (a donor that sends a bad one is
  dropped and named); at the end every value finite.

Donors this peer trusts come first; the rest in the order of their self-declared priority. The first
acceptable digest is fetched from every donor whose manifest names the same digest: chunks are
content-addressed, so any of them may serve any chunk, trusted or not. A donor that fails, stalls or sends
a bad chunk loses its chunks to the others (``core.chunks.ChunkPlan``); verified chunks are kept under
``partial_dir`` so a restart resumes (``swarm.partial``).

A rejected donor is logged with the reason and the next digest is tried. ``None`` means nobody served an
acceptable state: start fresh if this is the first peer, otherwise wait and retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.core.chunks import CHUNK_BYTES, DIGEST_BYTES, ChunkMap
from p2p_diloco.core.evidence import EPOCH_LIMIT, plausible_epoch, state_verdict
from p2p_diloco.swarm.checksum import TensorManifest, combine_state_sha, manifest_sha
from p2p_diloco.swarm.chunk_transfer import BAD_CHUNK, INCOMPLETE, fetch_verified, state_chunk_map
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.records import SHA256_PATTERN, fetch_checksums, fetch_progress, global_epoch

logger = logging.getLogger(__name__)

STATE_VERSION = 3
"""2: ``sha`` covers the outer momentum too (``checksum.state_sha256``). 3: served in chunks, with a manifest
of chunk digests from which ``sha`` is computed."""
StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class ServingAverager(Protocol):
    """What :class:`StateServer` and :func:`download_state` use of the averager (``swarm.averager``'s
    ``RoundAverager``), named here so that this module does not import the averager that imports it."""

    cfg: SwarmConfig
    dht: Any
    fingerprint: str
    client_mode: bool
    state_sharing_priority: float

    def is_alive(self) -> bool: ...
    def downloading(self) -> bool: ...
    def manifests_served(self) -> int: ...
    def bump_state_version(self) -> None: ...
    def mark_state_live(self, live: bool) -> None: ...
    def set_state_provider(self, provider: StateProvider | None) -> None: ...
    def state_donors(self) -> list[tuple[str, float]]: ...
    def fetch_manifests(self, peers: Sequence[str], *, timeout: float, max_bytes: int,
                        base: str | None = None) -> dict[str, bytes | str]: ...


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
    """Peer id that delivered the most verified chunks of it (``""`` when all came from a partial download
    kept on disk): whom a log names. Whom the loading peer vouches for is ``core.evidence.credited``'s."""
    rejected: tuple[str, ...] = ()
    """Donors tried before or dropped during the download, each as "peer id: reason"."""
    sources: tuple[str, ...] = ()
    """Every donor asked for chunks of this state (``donor`` first)."""
    params_manifest: TensorManifest | None = None
    """The parameters' manifest (its ``sha`` is ``params_sha256``): serving the state needs no hash pass."""
    delivered: dict[str, int] | None = None
    """Donor -> verified chunks it delivered (a donor that sent a bad chunk is not in it)."""


def make_state_metadata(run_id: str, fingerprint: str, epoch: int, sha: str, params: TensorManifest,
                        momentum: TensorManifest, n_params: int, n_opt: int) -> dict:
    """The served manifest: who and what the state is, and the sha256 of each of its chunks."""
    return {"v": STATE_VERSION, "run": run_id, "fp": fingerprint, "ep": epoch, "sha": sha, "np": n_params,
            "no": n_opt, "cs": CHUNK_BYTES, "pc": params.chunks, "mc": momentum.chunks}


def check_state_metadata(raw: bytes | str | None, run_id: str, fingerprint: str,
                         layouts: tuple[list[tuple[torch.dtype, tuple[int, ...]]], ...],
                         chunks: ChunkMap) -> dict | str:
    """A donor's manifest if it is valid, describes our run and model, and hashes to the digest it claims;
    else the reason it is not. ``layouts``: (dtype, shape) of our parameters and of our momentum."""
    if raw is None or isinstance(raw, str):
        return raw or "donor sent no manifest (it is probably not sharing state)"
    if len(raw) > max_manifest_bytes(chunks):
        return "manifest too large"
    try:
        meta = MSGPackSerializer.loads(raw)
    except Exception:
        return "manifest is not valid msgpack"
    if not isinstance(meta, dict) or set(meta) != {"v", "run", "fp", "ep", "sha", "np", "no", "cs", "pc", "mc"}:
        return "manifest lacks the expected fields"
    if meta["v"] != STATE_VERSION:
        return f"unsupported state version {meta['v']!r}"
    if meta["run"] != run_id or meta["fp"] != fingerprint:
        return f"state of run {str(meta['run'])[:64]!r} / model {str(meta['fp'])[:64]!r}, not ours"
    if not plausible_epoch(meta["ep"]):
        return f"implausible epoch {str(meta['ep'])[:32]} (over {EPOCH_LIMIT} or not an integer)"
    if not isinstance(meta["sha"], str) or not SHA256_PATTERN.fullmatch(meta["sha"]):
        return "invalid state checksum"
    params_layout, opt_layout = layouts
    if meta["np"] != len(params_layout) or meta["no"] != len(opt_layout):
        return (f"donor has {str(meta['np'])[:16]} parameter and {str(meta['no'])[:16]} optimizer tensors, "
                f"expected {len(params_layout)} and {len(opt_layout)}")
    if meta["cs"] != CHUNK_BYTES:
        return f"chunks of {str(meta['cs'])[:16]} bytes, expected {CHUNK_BYTES}"
    for key, count in (("pc", chunks.region_chunks[0]), ("mc", chunks.region_chunks[1])):
        if not isinstance(meta[key], bytes) or len(meta[key]) != count * DIGEST_BYTES:
            return f"manifest does not list the {count} chunk digests our model's state has"
    sha = combine_state_sha(manifest_sha(params_layout, chunks.region_bytes[0], meta["pc"]),
                            manifest_sha(opt_layout, chunks.region_bytes[1], meta["mc"]))
    if sha != meta["sha"]:
        return f"manifest hashes to {sha[:12]}..., the donor claims {meta['sha'][:12]}... (or another layout)"
    return meta


def max_manifest_bytes(chunks: ChunkMap) -> int:
    return 4096 + chunks.count * (DIGEST_BYTES + 1)


def nonfinite(tensors: Sequence[torch.Tensor]) -> str | None:
    for i, tensor in enumerate(tensors):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"tensor {i} holds NaN or infinite values"
    return None


def download_state(
    averager: ServingAverager,
    template_params: Sequence[torch.Tensor],
    template_opt: Sequence[torch.Tensor] = (),
    *,
    min_epoch: int | None = None,
    timeout: float | None = None,
    max_donors: int = 8,
    trusted: frozenset[str] | None = None,
    partial_dir: Path | None = None,
    backed: dict[str, int] | None = None,
    selector: str | None = None,
    run_id: str | None = None,
) -> SwarmState | None:
    """Download and verify the swarm's state from up to ``max_donors`` donors within ``timeout`` seconds
    (default ``cfg.state_download_timeout_s``). ``min_epoch`` defaults to the swarm's global epoch.
    ``trusted``: the peers whose donors and checksums this peer trusts (``core.evidence``), or ``None`` when
    none of them is online (a newcomer). ``partial_dir``: where verified chunks are kept so that a download
    cut by a restart resumes (``swarm.partial``); ``None`` keeps nothing. ``backed``: filled with the donors
    that handed out the manifest of a state of ``min_epoch`` or newer and stopped serving it before the
    download completed (a donor that sent a bad chunk does not count), with that state's epoch. The caller
    believes those whose records moved past that epoch meanwhile (``Evidence.unbacked``): they stepped on to
    the next round's state mid-download. Chunks delivered are not required: donors of short rounds on a loaded
    machine stepped on between their manifest and the first chunk, the joiner marked all three unbacked and
    trained a round alone from its own state (seen in ``tests/integration/test_peer_swarm.py``); verified
    chunks prove nothing anyway (a relay delivers them), and ``MOVED_ON_PASSES`` bounds the forgiveness.

    Every donor's manifest is read first (small) and checked against the digest it claims; the first
    acceptable digest in donor order (trusted donors first, then by epoch) is downloaded from every donor
    serving that same digest at once (``swarm.chunk_transfer``), each chunk checked on receipt.

    ``selector`` and ``run_id``: one fragment's state (``chunk_transfer.fragment_selector``, and the fragment's
    namespace, which its manifest names and its votes are read under); the templates are its tensors."""
    cfg = averager.cfg
    run_id = run_id or cfg.run_id
    deadline = time.monotonic() + (timeout if timeout is not None else cfg.state_download_timeout_s)
    templates = list(template_params) + list(template_opt)
    layouts = ([(t.dtype, tuple(t.shape)) for t in template_params], [(t.dtype, tuple(t.shape)) for t in template_opt])
    chunks = state_chunk_map(templates, len(template_params))
    try:
        donors = averager.state_donors()
        if trusted:
            donors.sort(key=lambda donor: donor[0] not in trusted)  # stable: by priority within each kind
        donors = donors[:max_donors]
        if min_epoch is None:
            progress = fetch_progress(averager.dht, run_id)
            min_epoch = global_epoch(progress, fingerprint=averager.fingerprint) or 0
        raw = averager.fetch_manifests([peer for peer, _ in donors], max_bytes=max_manifest_bytes(chunks),
                                       timeout=max(1.0, min(cfg.next_chunk_timeout_s, deadline - time.monotonic())),
                                       base=selector)
    except Exception as e:
        logger.warning("Cannot look up state donors, their manifests or the swarm's epoch: %r", e)
        return None
    manifests: dict[str, dict] = {}
    rejected: list[str] = []
    for peer, _priority in donors:
        meta = check_state_metadata(raw.get(peer), run_id, averager.fingerprint, layouts, chunks)
        if isinstance(meta, dict) and meta["ep"] < min_epoch:
            meta = f"state of epoch {meta['ep']} is older than the swarm's epoch {min_epoch}"
        if isinstance(meta, str):
            logger.warning("Rejected state from %s: %s", peer, meta)
            rejected.append(f"{peer}: {meta}")
        else:
            manifests[peer] = meta
    votes: dict[int, dict[str, str]] = {}
    tried: set[str] = set()
    dest: list[torch.Tensor] = []

    def attempt(peer: str, count_votes: bool) -> tuple[SwarmState | None, str | None, bool]:
        """(state, problem, vetoed by votes alone) of the digest ``peer`` serves."""
        meta = manifests[peer]
        sha = meta["sha"]
        if count_votes:
            if meta["ep"] not in votes:
                votes[meta["ep"]] = fetch_checksums(averager.dht, run_id, meta["ep"])
            verdict = state_verdict(peer, sha, votes[meta["ep"]], trusted)
            if verdict is not None:
                return None, f"parameters {sha[:12]}... {verdict} for epoch {meta['ep']}", trusted is None
        if sha in tried:
            return None, "its state failed already from other donors", False
        tried.add(sha)
        sources = [peer] + [p for p, m in manifests.items() if m["sha"] == sha and p != peer]
        if not dest:
            dest.extend(torch.empty_like(t, memory_format=torch.contiguous_format).share_memory_()
                        for t in templates)
        problem, dropped, served = fetch_verified(averager, sources, meta, dest, chunks, partial_dir, deadline)
        if backed is not None and problem is not None and problem.startswith(INCOMPLETE):
            # donors that handed out this state's manifest and stopped serving it midway, with or without chunks
            # delivered (none that sent a bad chunk): ``Evidence.unbacked`` forgives those whose records moved on
            backed.update({p: meta["ep"] for p in sources if BAD_CHUNK not in dropped.get(p, "")})
        rejected.extend(f"{p}: {reason}" for p, reason in dropped.items())
        problem = problem or nonfinite(dest)
        if problem is not None:
            return None, problem, False
        n = len(template_params)
        top = max(served, key=lambda p: (served[p], p == peer), default="")
        state = SwarmState(params=dest[:n], opt_tensors=dest[n:], epoch=meta["ep"], state_sha256=sha,
                           params_sha256=manifest_sha(layouts[0], chunks.region_bytes[0], meta["pc"]),
                           donor=top, rejected=tuple(rejected), sources=tuple(sources), delivered=dict(served),
                           params_manifest=TensorManifest(manifest_sha(layouts[0], chunks.region_bytes[0],
                                                                       meta["pc"]), meta["pc"]))
        return state, None, False

    outvoted_only: list[str] = []  # newcomers: donors whose only fault was a head count of untrusted votes
    for peer in manifests:
        if time.monotonic() >= deadline:
            rejected.append(f"{peer}: not tried, state_download_timeout_s ran out")
            break
        state, problem, vetoed = attempt(peer, count_votes=True)
        if state is not None:
            logger.info("Loaded state of epoch %d from %d donor(s), most of it from %s", state.epoch,
                        len(state.sources), state.donor or "our partial download")
            return state
        logger.warning("Rejected state from %s: %s", peer, problem)
        rejected.append(f"{peer}: {problem}")
        if vetoed:
            outvoted_only.append(peer)
    # A newcomer counts votes only to choose among donors: voters it cannot tell apart are free identities,
    # and letting them veto every donor kept joiners from the honest state and split the swarm at start-up
    # (ten Sybil votes against the one honest donor, tests/integration/test_red_team.py). An attacker that
    # serves a state can vote for it as well, so the veto protected nothing a newcomer could otherwise keep.
    for peer in outvoted_only:
        if time.monotonic() >= deadline:
            break
        state, problem, _ = attempt(peer, count_votes=False)
        if state is not None:
            logger.warning("Loaded state of epoch %d from %s, which only untrusted checksum votes contradicted "
                           "(no trusted peer is online to tell; give --trusted-peers in an open swarm)",
                           state.epoch, peer)
            return state
        rejected.append(f"{peer}: {problem}")
    logger.info("No acceptable state from %d donor(s)", len(donors))
    return None

