"""The DHT record schema: per-peer progress and per-epoch parameter checksums.

Keys (all prefixed by the run id, so runs sharing one DHT never read each other's records):

- ``{run_id}_progress_v{protocol}``: one subkey per peer holding a ``ProgressRecord``-shaped dict.
- ``{run_id}_checksum_v{protocol}_e{epoch}``: one subkey per peer holding the 64-hex-character sha256 of its
  parameters right after the outer step that produced ``epoch``.
- With Streaming DiLoCo's fragments, both again under each fragment's namespace (:func:`fragment_records_id`
  in place of the run id), holding that fragment's epoch and state digest (``swarm.fragment_swarm``).

``protocol`` is ``swarm.protocol.PROTOCOL_VERSION``: peers of another release publish under other keys, so
neither side reads, nor bans for, records it cannot parse (version 1, before the version existed, used
``{run_id}_progress`` and ``{run_id}_checksum_e{epoch}``); :func:`other_versions` counts them.

Each peer writes only under its signed subkey ``<base58 peer id>[owner:<its public key>]`` and signs every
record with its libp2p identity key (``signing``), so a record names the one peer that wrote it.

Anyone can write anything into a DHT, so every record is checked twice. On receipt, every node's
``signing.RecordGuard`` drops unsigned, wrongly signed, forged, oversized and (for progress, with hivemind's
``SchemaValidator`` of ``run_validator``, passed to ``start_dht``) malformed records. On reading, the explicit checks
below drop what still slips through (records relayed by nodes without the guard, checksum records, whose
per-epoch keys no schema can name, non-finite numbers, expired entries). Every drop is logged and counted in
the DHT's ``signing.RecordAudit``; a record that was correctly signed gets its signer banned for the run,
after which the readers here skip that peer's records. Nothing is raised.
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
from hivemind.dht.schema import SchemaValidator, conbytes
from hivemind.utils import ValueWithExpiration, get_dht_time
from pydantic.v1 import BaseModel, StrictBool, ValidationError, confloat, conint, constr, create_model

from p2p_diloco.core.evidence import EPOCH_LIMIT
from p2p_diloco.swarm.protocol import PROTOCOL_VERSION, neighbours, versioned
from p2p_diloco.swarm.signing import (
    SIGNED_SUBKEY_REGEX,
    RecordAudit,
    RecordGuard,
    Rejection,
    looks_signed,
    other_version_detail,
    own_subkey,
    parse_signed_subkey,
    record_audit,
)

logger = logging.getLogger(__name__)

FINGERPRINT_REGEX = r"^[0-9a-f]{8,64}$"
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
_MAX_EPOCH = EPOCH_LIMIT
"""Records claiming more are malformed (and their signer banned): see ``core.evidence.EPOCH_LIMIT``."""
_MAX_RATE = 1e12
_MAX_SUBKEYS = 1024
"""Subkeys read per key: far above any expected swarm; beyond it signed-looking subkeys are kept first and the
rest is dropped (as ``oversized``) without being parsed."""
_DHT_TIMEOUT_S = 30.0
MAX_RECORD_TTL_S = 86400.0 + 3600.0
"""No peer stores a record for longer than a day (``progress_ttl_s`` and ``checksum_ttl_s`` are capped at
86400 s), plus an hour of clock skew; an entry expiring later is junk meant to outlive its writer (a
far-future record would pin a claim, or fill the key, for ever) and is dropped as malformed."""


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
    phase_s: confloat(ge=0.0, le=1e7, strict=True)  # type: ignore[valid-type]
    protocol: conint(ge=PROTOCOL_VERSION, le=PROTOCOL_VERSION, strict=True)  # type: ignore[valid-type]
    """``swarm.protocol.PROTOCOL_VERSION``; a record of another version is dropped unread, never banned."""


ProgressSchema = create_model(
    "ProgressSchema",
    __module__=__name__,  # pickled by name into the DHT's process: it must be found here, not in pydantic
    **{versioned("progress"): (dict[conbytes(regex=SIGNED_SUBKEY_REGEX), Optional[ProgressRecord]], ...)},  # type: ignore[valid-type]  # noqa: UP045
)
ProgressSchema.__doc__ = """hivemind ``SchemaValidator`` schema of the ``{run_id}_progress_v<PROTOCOL_VERSION>`` key (subkey: a signed subkey); the
field is named after the key, :func:`progress_key`, so it follows ``PROTOCOL_VERSION`` by construction."""


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
    phase_s: float = 0.0
    """Seconds the peer had spent in the inner phase of ``epoch`` when it wrote the record (0: not training
    yet). A claim like every other field: ``core.dylu.phase_elapsed_s`` says how a joiner uses it."""

    def age_s(self) -> float:
        """Seconds since the record was written, by this machine's DHT clock against the writer's claimed
        ``time`` (negative when the writer's clock runs ahead)."""
        return get_dht_time() - self.time


def progress_key(run_id: str, protocol: int = PROTOCOL_VERSION) -> str:
    return versioned(f"{run_id}_progress", protocol)


def fragment_records_id(run_id: str, tag: str, fragment: int) -> str:
    """The namespace of one fragment's records (progress and checksums) in run ``run_id`` under the fragment
    layout ``tag`` (``BufferLayout.tag``), used where the run's id is (``swarm.fragment_swarm``): peers with
    another F or assignment never read each other's fragment records."""
    return f"{run_id}{tag}_f{int(fragment)}"


def checksum_key(run_id: str, epoch: int, protocol: int = PROTOCOL_VERSION) -> str:
    return f"{versioned(f'{run_id}_checksum', protocol)}_e{int(epoch)}"


def run_validator(run_id: str) -> RecordGuard:
    """The validator that drops unsigned and malformed progress records of ``run_id`` on receipt (stores and
    lookups alike), on top of the signature checks every node started by ``dht.start_dht`` makes.

    Pass it to ``start_dht(cfg, record_validators=...)``: a node is reachable as soon as it starts, and one
    that gets its validators only afterwards stores whatever a vandal sends it in between.
    """
    schema = SchemaValidator(ProgressSchema, prefix=run_id)
    return RecordGuard(schemas=[schema], signed_keys=[progress_key(run_id)])


def install_validators(dht: hivemind.DHT, run_id: str) -> None:
    """Add ``run_validator(run_id)`` to a running ``dht`` (records it received before are not checked)."""
    dht.add_validators([run_validator(run_id)])


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
    phase_s: float = 0.0,
) -> bool:
    """Store this peer's progress for ``ttl_s`` seconds; returns whether the DHT accepted it.

    Republish well before ``ttl_s`` runs out (every step or every ``ttl_s / 2``): the record is this peer's
    presence in the swarm's view. ``steps_per_s`` is what DyLU compares between peers; ``phase_s`` (seconds
    into the inner phase of ``epoch``) is how far a joiner that downloads this epoch's state is behind.
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
        phase_s=float(phase_s),
        protocol=PROTOCOL_VERSION,
    )
    if not _finite(record.steps_per_s, record.samples_per_s, record.tokens_per_s, record.phase_s):
        raise ValueError("progress rates must be finite")
    return _store(dht, progress_key(run_id), record.dict(), now + ttl_s)


def _parse_entry(subkey: Any, entry: Any, now: float) -> tuple[str, Any] | Rejection | None:
    """``(peer id, value)`` of a live entry under a signed subkey whose owner key is that peer's, a
    ``Rejection``, or ``None`` for an expired entry. The owner is named only where the signature was checked
    on receipt, which the caller knows (``RecordAudit.attributable``)."""
    parsed = parse_signed_subkey(subkey)
    if isinstance(parsed, str):
        return Rejection("unsigned", None, parsed)
    claimed, owner = parsed
    if claimed != owner:
        return Rejection("wrong_owner", owner, f"claims to be {claimed}'s record")
    if not isinstance(entry, ValueWithExpiration) or isinstance(entry.expiration_time, bool):
        return Rejection("malformed", owner, f"entry of type {type(entry).__name__}")
    if not isinstance(entry.expiration_time, (int, float)) or not entry.expiration_time > now:
        return None
    if entry.expiration_time > now + MAX_RECORD_TTL_S:
        return Rejection("malformed", owner, f"expires in {entry.expiration_time - now:.3g} s, over the "
                                             f"{MAX_RECORD_TTL_S:.0f} s any peer sets")
    return owner, entry.value


def _parse_progress(subkey: Any, entry: Any, now: float) -> PeerProgress | Rejection | None:
    """A ``PeerProgress``, the ``Rejection`` of the entry, or ``None`` (expired or withdrawn: not an error)."""
    parsed = _parse_entry(subkey, entry, now)
    if not isinstance(parsed, tuple):
        return parsed
    peer_id, value = parsed
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16:
        return Rejection("malformed", peer_id, f"value of type {type(value).__name__} (or too many fields)")
    if not all(isinstance(name, str) for name in value):
        return Rejection("malformed", peer_id, "field names that are not strings")  # pydantic would raise TypeError
    if value.get("protocol", 1) != PROTOCOL_VERSION:
        return Rejection("version", None, other_version_detail(value.get("protocol", 1)))
    try:
        record = ProgressRecord.parse_obj(value)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:4])
        return Rejection("malformed", peer_id, f"schema mismatch ({problems})"[:400])
    if record.dict() != value:
        return Rejection("malformed", peer_id, "value needed type conversions")
    if not _finite(record.steps_per_s, record.samples_per_s, record.tokens_per_s, record.time, record.phase_s):
        return Rejection("malformed", peer_id, "non-finite number")
    fields = record.dict()
    del fields["protocol"]  # ours, checked above
    return PeerProgress(peer_id=peer_id, expiration_time=float(entry.expiration_time), **fields)


def _parse_checksum(subkey: Any, entry: Any, now: float) -> tuple[str, str] | Rejection | None:
    """``(peer id, sha256 hex)``, the ``Rejection`` of the entry, or ``None`` when it expired."""
    parsed = _parse_entry(subkey, entry, now)
    if not isinstance(parsed, tuple):
        return parsed
    peer_id, value = parsed
    if not isinstance(value, str) or not SHA256_PATTERN.fullmatch(value):
        return Rejection("malformed", peer_id, f"{type(value).__name__} value is not a sha256 hex digest")
    return peer_id, value


def _store(dht: hivemind.DHT, key: str, value: Any, expiration_time: float) -> bool:
    """Store under this peer's signed subkey; ``False`` (logged) if the DHT refuses or does not answer in time."""
    future = dht.store(
        key, subkey=own_subkey(dht), value=value, expiration_time=expiration_time, return_future=True
    )
    try:
        return bool(future.result(timeout=_DHT_TIMEOUT_S))
    except TimeoutError:
        logger.warning("DHT store of %s timed out after %.0f s", key, _DHT_TIMEOUT_S)
        return False


def _fetch_subkeys(dht: hivemind.DHT, key: str, audit: RecordAudit) -> dict[Any, Any]:
    found = dht.get(key, latest=True, return_future=True).result(timeout=_DHT_TIMEOUT_S)
    if found is None:
        return {}
    if not isinstance(found, ValueWithExpiration) or not isinstance(found.value, dict):
        expiration = getattr(found, "expiration_time", None)
        audit.note((key, None, expiration), Rejection("malformed", None, f"{key} holds no per-peer records"))
        return {}
    items = list(found.value.items())
    if len(items) > _MAX_SUBKEYS:
        items.sort(key=lambda item: not looks_signed(item[0]))  # stable: signed-looking subkeys first
        for subkey, entry in items[_MAX_SUBKEYS:]:
            identity = (key, subkey, getattr(entry, "expiration_time", None))
            audit.note(identity, Rejection("oversized", None, f"{key} holds over {_MAX_SUBKEYS} records"))
        items = items[:_MAX_SUBKEYS]
    return dict(items)


def _read(dht: hivemind.DHT, key: str, parse: Any) -> list[Any]:
    """Parse every entry under ``key``; note each rejection, skip expired entries and banned peers."""
    audit = record_audit(dht)
    now = get_dht_time()
    entries = _fetch_subkeys(dht, key, audit)
    audit.collect(dht)  # after the lookup, so whatever the guard refused in it counts (and bans) at once
    kept = []
    for subkey, entry in entries.items():
        parsed = parse(subkey, entry, now)
        if isinstance(parsed, Rejection):
            audit.note((key, subkey, getattr(entry, "expiration_time", None)), parsed)
        elif parsed is not None:
            kept.append(parsed)
    audit.collect(None)  # count this read's drops (and ban their signers) now
    return [p for p in kept if not audit.is_banned(p.peer_id if isinstance(p, PeerProgress) else p[0])]


def fetch_progress(dht: hivemind.DHT, run_id: str) -> list[PeerProgress]:
    """Every valid, unexpired progress record of ``run_id`` from peers not banned, sorted by peer id."""
    return sorted(_read(dht, progress_key(run_id), _parse_progress), key=lambda r: r.peer_id)


def global_epoch(
    records: Sequence[PeerProgress], *, min_peers: int = 1, fingerprint: str | None = None
) -> int | None:
    """The swarm's current epoch: the largest epoch reached by at least ``min_peers`` fresh non-client peers.

    A head count, for observers (the swarm exporter, tests). Peers do NOT act on it: one signed record
    from a free identity would move it, so the round policy believes epochs through
    ``core.evidence.Evidence`` (trusted peers only, once it has any). Client-mode peers are ignored
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
    """Valid, unexpired checksums published for ``epoch`` by peers not banned: peer id -> sha256 hex."""
    return dict(_read(dht, checksum_key(run_id, epoch), _parse_checksum))


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


def other_versions(dht: hivemind.DHT, run_id: str, timeout: float = 10.0) -> dict[int, int]:
    """Peers of ``run_id`` publishing progress under another protocol version's key (``swarm.protocol``):
    ``{version: live signed entries}``, only versions with some. Read once at start and by ``doctor``: these
    records are counted, never parsed nor banned (their schema may differ from ours)."""
    futures = {v: dht.get(progress_key(run_id, v), latest=True, return_future=True) for v in neighbours()}
    now, found = get_dht_time(), {}
    for version, future in futures.items():
        try:
            entries = future.result(timeout=timeout)
        except Exception as e:  # noqa: BLE001 - an unanswered lookup counts nobody
            logger.debug("Could not read the progress of protocol %d: %r", version, e)
            continue
        if not isinstance(entries, ValueWithExpiration) or not isinstance(entries.value, dict):
            continue
        live = sum(1 for subkey, entry in list(entries.value.items())[:_MAX_SUBKEYS]
                   if isinstance(parse_signed_subkey(subkey), tuple) and isinstance(entry, ValueWithExpiration)
                   and entry.value is not None and isinstance(entry.expiration_time, (int, float))
                   and entry.expiration_time > now)
        if live:
            found[version] = live
    return found
