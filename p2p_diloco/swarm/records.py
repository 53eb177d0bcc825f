"""The DHT record schema: per-peer progress and per-epoch parameter checksums.

Keys (all prefixed by the run id, so runs sharing one DHT never read each other's records):

- ``{run_id}_progress``: one subkey per peer (its base58 peer id) holding a ``ProgressRecord``-shaped dict.
- ``{run_id}_checksum_e{epoch}``: one subkey per peer holding the 64-hex-character sha256 of its parameters
  right after the outer step that produced ``epoch``.

Anyone can write anything into a DHT, so every record read back is validated: hivemind's ``SchemaValidator``
(pydantic, strict types) rejects malformed progress records on every node that installed it, and the
explicit checks below drop what slips through (records relayed by nodes without the validator, non-finite
numbers, oversized values, expired entries). Dropped records are logged, never raised.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import hivemind
from hivemind.dht.schema import SchemaValidator
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time
from pydantic.v1 import BaseModel, StrictBool, ValidationError, confloat, conint, constr

logger = logging.getLogger(__name__)

PEER_ID_REGEX = r"^[1-9A-HJ-NP-Za-km-z]{20,80}$"  # base58 alphabet, lengths of real libp2p peer ids
FINGERPRINT_REGEX = r"^[0-9a-f]{8,64}$"
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
_PEER_ID_PATTERN = re.compile(PEER_ID_REGEX)
_MAX_EPOCH = 10**9
_MAX_RATE = 1e12
_MAX_SUBKEYS = 4096  # a swarm larger than this is not expected; a flood beyond it is ignored, not parsed
_DHT_TIMEOUT_S = 30.0


class ProgressRecord(BaseModel):
    """What one peer tells the swarm about itself; strict types so ``3.0`` never passes for ``3``."""

    epoch: conint(ge=0, le=_MAX_EPOCH, strict=True)  # type: ignore[valid-type]
    inner_step: conint(ge=0, le=10**12, strict=True)  # type: ignore[valid-type]
    steps_per_s: confloat(ge=0.0, le=_MAX_RATE, strict=True)  # type: ignore[valid-type]
    samples_per_s: confloat(ge=0.0, le=_MAX_RATE, strict=True)  # type: ignore[valid-type]
    tokens_per_s: confloat(ge=0.0, le=_MAX_RATE, strict=True)  # type: ignore[valid-type]
    fingerprint: constr(regex=FINGERPRINT_REGEX, strict=True)  # type: ignore[valid-type]
    time: confloat(ge=0.0, le=1e11, strict=True)  # type: ignore[valid-type]
    client_mode: StrictBool


class ProgressSchema(BaseModel):
    """hivemind ``SchemaValidator`` schema of the ``{run_id}_progress`` key (subkey: base58 peer id)."""

    progress: dict[constr(regex=PEER_ID_REGEX, strict=True), Optional[ProgressRecord]]  # type: ignore[valid-type]  # noqa: UP045


@dataclass(frozen=True)
class PeerProgress:
    """A validated, unexpired progress record."""

    peer_id: str
    epoch: int
    inner_step: int
    steps_per_s: float
    samples_per_s: float
    tokens_per_s: float
    fingerprint: str
    time: float
    client_mode: bool
    expiration_time: float


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def checksum_key(run_id: str, epoch: int) -> str:
    return f"{run_id}_checksum_e{int(epoch)}"


def install_validators(dht: hivemind.DHT, run_id: str) -> None:
    """Make ``dht`` reject malformed progress records for ``run_id`` (stores and lookups alike); call once."""
    dht.add_validators([SchemaValidator(ProgressSchema, prefix=run_id)])


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def publish_progress(
    dht: hivemind.DHT,
    run_id: str,
    *,
    epoch: int,
    inner_step: int,
    steps_per_s: float,
    samples_per_s: float,
    tokens_per_s: float,
    fingerprint: str,
    client_mode: bool = False,
    ttl_s: float = 120.0,
) -> bool:
    """Store this peer's progress for ``ttl_s`` seconds; returns whether the DHT accepted it.

    Republish well before ``ttl_s`` runs out (every step or every ``ttl_s / 2``): the record is this peer's
    presence in the swarm's view. ``steps_per_s`` is what DyLU compares between peers.
    """
    now = get_dht_time()
    record = ProgressRecord(
        epoch=int(epoch),
        inner_step=int(inner_step),
        steps_per_s=float(steps_per_s),
        samples_per_s=float(samples_per_s),
        tokens_per_s=float(tokens_per_s),
        fingerprint=str(fingerprint),
        time=float(now),
        client_mode=bool(client_mode),
    )
    if not _finite(record.steps_per_s, record.samples_per_s, record.tokens_per_s):
        raise ValueError("progress rates must be finite")
    return _store(dht, progress_key(run_id), record.dict(), now + ttl_s)


def _parse_progress(peer_id: Any, entry: Any, now: float) -> PeerProgress | str:
    """A ``PeerProgress``, or the reason the entry is dropped."""
    if not isinstance(peer_id, str) or not _PEER_ID_PATTERN.fullmatch(peer_id):
        return f"subkey {str(peer_id)[:80]!r} is not a base58 peer id"
    try:
        PeerID.from_base58(peer_id)
    except Exception:
        return "subkey is not a valid peer id"
    if not isinstance(entry, ValueWithExpiration):
        return f"entry of type {type(entry).__name__}"
    if not isinstance(entry.expiration_time, (int, float)) or not entry.expiration_time > now:
        return "expired"
    value = entry.value
    if value is None:
        return "withdrawn"
    if not isinstance(value, dict) or len(value) > 16:
        return f"value of type {type(value).__name__} (or too many fields)"
    try:
        parsed = ProgressRecord.parse_obj(value)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:4])
        return f"schema mismatch ({problems})"
    if parsed.dict() != value:
        return "value needed type conversions"
    if not _finite(parsed.steps_per_s, parsed.samples_per_s, parsed.tokens_per_s, parsed.time):
        return "non-finite number"
    return PeerProgress(peer_id=peer_id, expiration_time=float(entry.expiration_time), **parsed.dict())


def _store(dht: hivemind.DHT, key: str, value: Any, expiration_time: float) -> bool:
    """Store under this peer's subkey; ``False`` (logged) if the DHT refuses or does not answer in time."""
    future = dht.store(
        key, subkey=dht.peer_id.to_base58(), value=value, expiration_time=expiration_time, return_future=True
    )
    try:
        return bool(future.result(timeout=_DHT_TIMEOUT_S))
    except TimeoutError:
        logger.warning("DHT store of %s timed out after %.0f s", key, _DHT_TIMEOUT_S)
        return False


def _fetch_subkeys(dht: hivemind.DHT, key: str) -> dict[Any, Any]:
    found = dht.get(key, latest=True, return_future=True).result(timeout=_DHT_TIMEOUT_S)
    if found is None:
        return {}
    if not isinstance(found, ValueWithExpiration) or not isinstance(found.value, dict):
        logger.warning("Dropped DHT value under %s: expected a dictionary of per-peer records", key)
        return {}
    items = found.value
    if len(items) > _MAX_SUBKEYS:
        logger.warning("DHT key %s holds %d records; reading only %d of them", key, len(items), _MAX_SUBKEYS)
        items = dict(list(items.items())[:_MAX_SUBKEYS])
    return dict(items)


def fetch_progress(dht: hivemind.DHT, run_id: str) -> list[PeerProgress]:
    """Every valid, unexpired progress record of ``run_id``, sorted by peer id; malformed ones are logged."""
    now = get_dht_time()
    records = []
    for peer_id, entry in _fetch_subkeys(dht, progress_key(run_id)).items():
        parsed = _parse_progress(peer_id, entry, now)
        if isinstance(parsed, PeerProgress):
            records.append(parsed)
        elif parsed not in ("expired", "withdrawn"):
            logger.warning("Dropped progress record from %s: %s", str(peer_id)[:80], parsed)
    return sorted(records, key=lambda r: r.peer_id)


def global_epoch(
    records: Sequence[PeerProgress], *, min_peers: int = 1, fingerprint: str | None = None
) -> int | None:
    """The swarm's current epoch: the largest epoch reached by at least ``min_peers`` fresh non-client peers.

    With ``min_peers=1`` this is the maximum, as in hivemind's ``ProgressTracker``: epochs only grow, and a
    peer at epoch ``e`` proves that round ``e - 1`` completed, so any peer below it is behind and should
    catch up (download state) instead of holding the swarm back; a minimum or median would let one stalled
    peer drag everybody's view backwards. The price is that a single peer lying about its epoch can push the
    view forward; raise ``min_peers`` (e.g. 2) to require corroboration. Client-mode peers are ignored
    because they cannot serve the state of the epoch they claim. ``fingerprint`` keeps only peers training
    the same model. Returns ``None`` when no record qualifies.
    """
    if min_peers < 1:
        raise ValueError(f"min_peers must be at least 1, got {min_peers}")
    epochs = sorted(
        (
            r.epoch
            for r in records
            if not r.client_mode and (fingerprint is None or r.fingerprint == fingerprint)
        ),
        reverse=True,
    )
    return epochs[min_peers - 1] if len(epochs) >= min_peers else None


def publish_checksum(
    dht: hivemind.DHT, run_id: str, epoch: int, sha256_hex: str, *, ttl_s: float = 1800.0
) -> bool:
    """Publish the sha256 of this peer's parameters after the outer step that produced ``epoch``."""
    if not isinstance(sha256_hex, str) or not SHA256_PATTERN.fullmatch(sha256_hex):
        raise ValueError(f"sha256_hex must be 64 lowercase hex characters, got {sha256_hex!r}")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= _MAX_EPOCH:
        raise ValueError(f"epoch must be an integer within [0, {_MAX_EPOCH}], got {epoch!r}")
    return _store(dht, checksum_key(run_id, epoch), sha256_hex, get_dht_time() + ttl_s)


def fetch_checksums(dht: hivemind.DHT, run_id: str, epoch: int) -> dict[str, str]:
    """Valid, unexpired checksums published for ``epoch``: peer id -> sha256 hex."""
    now = get_dht_time()
    result = {}
    for peer_id, entry in _fetch_subkeys(dht, checksum_key(run_id, epoch)).items():
        if not isinstance(peer_id, str) or not _PEER_ID_PATTERN.fullmatch(peer_id):
            logger.warning("Dropped checksum record: subkey %r is not a peer id", str(peer_id)[:80])
            continue
        if not isinstance(entry, ValueWithExpiration) or not entry.expiration_time > now:
            continue
        if not isinstance(entry.value, str) or not SHA256_PATTERN.fullmatch(entry.value):
            logger.warning("Dropped checksum record from %s: not a sha256 hex digest", peer_id)
            continue
        result[peer_id] = entry.value
    return result


def majority_checksum(dht: hivemind.DHT, run_id: str, epoch: int) -> tuple[str | None, int, int]:
    """``(sha, count, total)``: the most published checksum for ``epoch``, how many peers published it, and
    how many valid checksums there are. Ties go to the lexicographically smallest digest, so every peer
    picks the same one. ``(None, 0, 0)`` when nobody published. Treat it as authoritative only when
    ``2 * count > total``.
    """
    checksums = fetch_checksums(dht, run_id, epoch)
    if not checksums:
        return None, 0, 0
    counts = Counter(checksums.values())
    sha, count = min(counts.items(), key=lambda item: (-item[1], item[0]))
    return sha, count, len(checksums)
