"""Signed, attributable DHT records: each peer signs what it publishes with its libp2p identity key.

A DHT subkey is only a name: without signatures anyone could write a record under any peer id, overwrite
an honest peer's progress, or write junk in its name to get it banned. So every record a peer publishes
carries the subkey ``<base58 peer id>[owner:<ssh-rsa public key>]`` (bytes), and hivemind's
``RSASignatureValidator`` appends a signature over (key, subkey, value, expiration) made with the peer's
libp2p identity key. The key's libp2p peer id (sha2-256 multihash of the protobuf ``PublicKey``, as p2pd
computes it) must equal the peer id the subkey claims, so a record names the one peer that could have
written it.

``RecordGuard`` (installed by ``dht.start_dht`` on every node before it joins) judges each record on receipt,
both when another node asks to store it and when it arrives in the answer to a lookup:

=====================================================  =================  ===============================
record                                                 dropped as         attributed to (banned)
=====================================================  =================  ===============================
no owner key, under a key that takes signed records    ``unsigned``       nobody
owner key but no signature                             ``unsigned``       nobody
signature that does not verify, unreadable owner key   ``bad_signature``  nobody
valid signature, claimed peer id is not the key's      ``wrong_owner``    the key's peer
valid signature, value over ``MAX_VALUE_BYTES``        ``oversized``      the key's peer
valid signature, value breaks the key's schema         ``malformed``      the key's peer
valid signature, ``protocol`` field of another version  ``version``        nobody
=====================================================  =================  ===============================

Only a record with a valid signature is certainly its key holder's doing, so only those get their author
banned. Unsigned or wrongly signed records cannot be attributed: the subkey names whoever the writer wished
and the sender of a store request may be an honest node passing a record on, so they are dropped and counted
and nobody is banned. A record of another protocol version (``swarm.protocol``) is a peer of another release,
not an attacker: it is dropped before the schema check, and its writer is not banned. Records that are not ours (hivemind's matchmaking and state keys) pass untouched,
except that every subkey must be bytes (as all of hivemind's averaging and ours are): hivemind's storage
fails on subkeys of mixed types, which a writer could otherwise use to jam any key (this excludes
``hivemind.moe``, whose int subkeys this project does not use).

Counting: each distinct rejected record is counted once in a ``RejectionLog`` of the process that rejected it
(the DHT's own process for the table above); ``RecordAudit`` collects those counts into the host process,
adds the drops its readers make (``records``), and keeps the run's bans.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import hivemind
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.swarm.protocol import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

MAX_VALUE_BYTES = 4096
"""Largest serialized value, signature included, of a signed record. A progress record is about 200 bytes
and a 2048-bit signature about 360; 4096 leaves room for 4096-bit keys and nothing for payloads."""
REJECTED_RECORD_KINDS = ("unsigned", "bad_signature", "wrong_owner", "malformed", "oversized", "version")
SIGNED_SUBKEY_REGEX = rb"^([1-9A-HJ-NP-Za-km-z]{20,80})\[owner:(ssh-rsa [A-Za-z0-9+/]{100,2000}={0,2})\]$"
_SIGNED_SUBKEY = re.compile(SIGNED_SUBKEY_REGEX)
_SHA2_256_PREFIX = b"\x12\x20"  # multihash code and digest length of sha2-256
_MAX_PENDING_OWNERS = 1024
_LOG_EVERY_S = 5.0
_COLLECT_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Why a record was dropped: one of ``REJECTED_RECORD_KINDS``, the peer that certainly wrote it (``None``
    when it cannot be known) and a detail for the log."""

    kind: str
    owner: str | None
    detail: str


# ------------------------------------------------------------------------------------------------ identity


def load_identity_key(data: bytes) -> RSAPrivateKey:
    """hivemind's ``RSAPrivateKey`` from the bytes of a libp2p identity file (protobuf ``PrivateKey``)."""
    message = crypto_pb2.PrivateKey.FromString(data)
    loaded = serialization.load_der_private_key(message.data, password=None)
    if message.key_type != crypto_pb2.RSA or not isinstance(loaded, rsa.RSAPrivateKey):
        raise ValueError("the identity key is not an RSA key (hivemind signs DHT records with RSA only)")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": message.data})  # hivemind's own unpickling: DER, traditional OpenSSL
    return key


def peer_id_of_public_key(ssh_public_key: bytes) -> PeerID:
    """The libp2p peer id of an RSA public key given in OpenSSH format (``ValueError`` if it is not one)."""
    key = serialization.load_ssh_public_key(ssh_public_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(_SHA2_256_PREFIX + hashlib.sha256(encoded).digest())


def signed_subkey(peer_id: PeerID, key: RSAPrivateKey) -> bytes:
    """The subkey under which the holder of ``key`` publishes: its peer id and its public key."""
    public = key.get_public_key().to_bytes()
    return peer_id.to_base58().encode() + RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", public)


def looks_signed(subkey: Any) -> bool:
    """Whether ``subkey`` has the signed subkey's shape (a cheap test: the owner key is not parsed)."""
    return isinstance(subkey, bytes) and _SIGNED_SUBKEY.fullmatch(subkey) is not None


def parse_signed_subkey(subkey: Any) -> tuple[str, str] | str:
    """``(claimed peer id, peer id of the owner key)`` of a signed subkey, or why it is not one."""
    if not isinstance(subkey, bytes):
        return f"subkey of type {type(subkey).__name__}, not a signed subkey"
    match = _SIGNED_SUBKEY.fullmatch(subkey)
    if match is None:
        return f"subkey {subkey[:60]!r}... is not '<peer id>[owner:<ssh-rsa key>]'"
    try:
        owner = peer_id_of_public_key(match.group(2)).to_base58()
    except Exception:  # noqa: BLE001 - any parse failure of hostile bytes means the same
        return "the owner key is not a readable RSA public key"
    return match.group(1).decode(), owner


_SIGNERS: weakref.WeakKeyDictionary[hivemind.DHT, bytes] = weakref.WeakKeyDictionary()
_SIGNING_KEYS: weakref.WeakKeyDictionary[hivemind.DHT, RSAPrivateKey] = weakref.WeakKeyDictionary()


def register_signer(dht: hivemind.DHT, key: RSAPrivateKey) -> None:
    """Remember that ``dht`` runs a ``RecordGuard`` signing with ``key``, its libp2p identity."""
    subkey = signed_subkey(dht.peer_id, key)
    _, owner = parse_signed_subkey(subkey)
    if owner != dht.peer_id.to_base58():
        raise ValueError(f"the signing key belongs to peer {owner}, the node runs as {dht.peer_id}")
    _SIGNERS[dht] = subkey
    _SIGNING_KEYS[dht] = key


def signing_key(dht: hivemind.DHT) -> RSAPrivateKey:
    """The identity key ``dht`` signs with (its group metadata too, ``claims``); only nodes started by
    ``dht.start_dht`` have one."""
    key = _SIGNING_KEYS.get(dht)
    if key is None:
        raise RuntimeError("this DHT has no identity key to sign with; start it with swarm.start_dht")
    return key


def own_subkey(dht: hivemind.DHT) -> bytes:
    """The signed subkey this node publishes under; only nodes started by ``dht.start_dht`` have one."""
    subkey = _SIGNERS.get(dht)
    if subkey is None:
        raise RuntimeError("this DHT has no identity key to sign records with; start it with swarm.start_dht")
    return subkey


# ------------------------------------------------------------------------------------------------ counting


class RejectionLog:
    """Distinct rejected records seen in one process, waiting to be collected.

    Each record (by digest) is counted once however often it is read back; ``remember`` bounds the digests
    kept, so a flood of distinct junk costs bounded memory (an old record seen again after that many newer
    ones counts again). Log lines are limited to one per kind every few seconds, with a count of the rest.
    """

    def __init__(self, remember: int = 4096) -> None:
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember
        self._counts: Counter[str] = Counter()
        self._owners: dict[str, str] = {}
        self._last_logged: dict[str, float] = {}
        self._unlogged: Counter[str] = Counter()

    def add(self, digest: bytes, rejection: Rejection) -> bool:
        """Count ``rejection`` unless this record was counted before; returns whether it was new."""
        kind, owner, detail = rejection.kind, rejection.owner, rejection.detail
        with self._lock:
            if digest in self._seen:
                self._seen.move_to_end(digest)
                return False
            self._seen[digest] = None
            if len(self._seen) > self._remember:
                self._seen.popitem(last=False)
            self._counts[kind] += 1
            if owner is not None and owner not in self._owners and len(self._owners) < _MAX_PENDING_OWNERS:
                self._owners[owner] = f"signed a DHT record rejected as {kind} ({detail})"
            now = time.monotonic()
            if now - self._last_logged.get(kind, -_LOG_EVERY_S) < _LOG_EVERY_S:
                self._unlogged[kind] += 1
                return True
            self._last_logged[kind] = now
            more = self._unlogged.pop(kind, 0)
        logger.warning(
            "Rejected a DHT record as %s%s: %s%s",
            kind,
            f" (signed by {owner})" if owner else "",
            detail,
            f"; {more} more of this kind in the last {_LOG_EVERY_S:.0f} s" if more else "",
        )
        return True

    def drain(self) -> tuple[dict[str, int], dict[str, str]]:
        """Counts by kind and ``{peer id: reason}`` of attributable records since the last drain."""
        with self._lock:
            counts, owners = dict(self._counts), dict(self._owners)
            self._counts.clear()
            self._owners.clear()
        return counts, owners


_RECEIVED = RejectionLog()  # filled by the RecordGuard of a DHT running in this process


def _fresh_log_in_child() -> None:
    # hivemind forks each DHT into its own process: the child must report only what it rejects itself, not
    # what the parent (or an earlier DHT of the parent) had counted, and must not inherit a held lock.
    global _RECEIVED
    _RECEIVED = RejectionLog()


os.register_at_fork(after_in_child=_fresh_log_in_child)


async def _drain_received(_dht: Any, _node: Any) -> tuple[dict[str, int], dict[str, str]]:
    return _RECEIVED.drain()


class RecordAudit:
    """The host side of one DHT: what its guard and its readers dropped, and the peers banned for it.

    ``collect`` pulls the DHT process's counts (one call into that process); readers add their own drops
    with ``note``. Bans last for the run: the readers in ``records`` skip a banned peer's records from then
    on. Two consumers take what is new: ``take_bans`` (to ban the peers in the averager too) and
    ``take_report`` (counts and bans for the round's report and metrics).
    """

    def __init__(self, own_peer_id: str = "", attributable: bool = True) -> None:
        self.own_peer_id = own_peer_id
        self.attributable = attributable
        """Whether records read back were signature-checked on receipt (a ``RecordGuard`` ran from the start);
        only then may a reader's drop be attributed to the signer."""
        self.banned: dict[str, str] = {}
        self._readers = RejectionLog()
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._new_bans: dict[str, str] = {}
        self._report_bans: list[str] = []

    def note(self, identity: Sequence[Any], rejection: Rejection) -> None:
        """A reader dropped a record; ``identity`` (key, subkey, expiration) counts it once however often read."""
        if not self.attributable and rejection.owner is not None:
            rejection = dataclasses.replace(rejection, owner=None)
        digest = hashlib.sha256(repr(tuple(identity)).encode()).digest()
        self._readers.add(digest, rejection)

    def is_banned(self, peer_id: str) -> bool:
        return peer_id in self.banned

    def collect(self, dht: hivemind.DHT | None) -> None:
        """Merge what ``dht``'s guard rejected and what readers noted; ban newly attributed peers."""
        counts, owners = self._readers.drain()
        if dht is not None:
            try:
                received, received_owners = dht.run_coroutine(_drain_received, return_future=True).result(
                    timeout=_COLLECT_TIMEOUT_S
                )
            except Exception as e:  # noqa: BLE001 - a busy or closing DHT only delays the counts
                logger.debug("Could not collect the DHT's rejected records: %r", e)
            else:
                counts = dict(Counter(counts) + Counter(received))
                owners = {**received_owners, **owners}
        with self._lock:
            self._counts.update(counts)
            for peer, reason in owners.items():
                if peer == self.own_peer_id or peer in self.banned:
                    continue
                logger.warning("Banning %s for the rest of the run: it %s", peer, reason)
                self.banned[peer] = reason
                # bounded, for a node whose consumers never take (the bootstrap takes no bans)
                if len(self._new_bans) < _MAX_PENDING_OWNERS:
                    self._new_bans[peer] = reason
                if len(self._report_bans) < _MAX_PENDING_OWNERS:
                    self._report_bans.append(f"{peer}: {reason}")

    def take_bans(self) -> dict[str, str]:
        """Bans made since the last call, ``{peer id: reason}``."""
        with self._lock:
            bans, self._new_bans = self._new_bans, {}
        return bans

    def take_report(self) -> tuple[dict[str, int], list[str]]:
        """Counts by kind and "peer id: reason" bans since the last call."""
        with self._lock:
            counts, bans = dict(self._counts), self._report_bans
            self._counts.clear()
            self._report_bans = []
        return counts, bans


_AUDITS: weakref.WeakKeyDictionary[hivemind.DHT, RecordAudit] = weakref.WeakKeyDictionary()
_AUDITS_LOCK = threading.Lock()


def record_audit(dht: hivemind.DHT) -> RecordAudit:
    """The ``RecordAudit`` of ``dht`` in this process (created on first use)."""
    with _AUDITS_LOCK:
        audit = _AUDITS.get(dht)
        if audit is None:
            signed = dht in _SIGNERS
            audit = RecordAudit(dht.peer_id.to_base58() if signed else "", attributable=signed)
            _AUDITS[dht] = audit
        return audit


# ------------------------------------------------------------------------------------------------ guard


class RecordGuard(RSASignatureValidator):
    """hivemind's ``RSASignatureValidator`` with the checks of the module docstring and rejection counting.

    :param private_key: this node's identity key: records whose subkey carries its public key are signed with
      it. ``None`` makes a check-only guard, which ``merge_with`` folds into the node's signing one.
    :param schemas: hivemind ``SchemaValidator`` per key (e.g. the run's progress schema), applied after the
      signature check so that a malformed signed record is known to be its signer's.
    :param signed_keys: raw DHT keys whose records must be signed (an unsigned one is dropped as ``unsigned``).

    One guard per node: guards installed later (one per run) merge their schemas and keys into the first.
    """

    def __init__(
        self,
        private_key: RSAPrivateKey | None = None,
        schemas: Sequence[SchemaValidator] = (),
        signed_keys: Iterable[str] = (),
    ) -> None:
        if private_key is not None:
            super().__init__(private_key)
        else:
            self._private_key = None
            self._local_public_key = b"\x00no key\x00"
        self._schema: SchemaValidator | None = None
        for schema in schemas:
            if self._schema is None:
                self._schema = schema
            else:
                self._schema.merge_with(schema)
        self._signed_keys = {DHTID.generate(source=key).to_bytes() for key in signed_keys}

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._private_key is None:
            return record.value
        return super().sign_value(record)

    def validate(self, record: DHTRecord) -> bool:
        try:
            rejection = self.judge(record)
        except Exception as e:  # noqa: BLE001 - hostile bytes must never break the DHT's handlers
            rejection = Rejection("malformed", None, f"unreadable record ({type(e).__name__})")
        if rejection is None:
            return True
        _RECEIVED.add(hashlib.sha256(self._serialize_record(record)).digest(), rejection)
        return False

    def judge(self, record: DHTRecord) -> Rejection | None:
        """Why ``record`` is dropped (see the module docstring), or ``None`` to accept it."""
        must_sign = record.key in self._signed_keys
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # noqa: BLE001 - any unreadable subkey is simply not a signed one
            subkey = None
        # hivemind's storage orders entries of equal expiration by subkey, and subkeys of different types
        # cannot be compared: one str subkey next to bytes ones would break every store and lookup of the key.
        odd_subkey = not isinstance(subkey, bytes) and record.subkey != DHTProtocol.IS_REGULAR_VALUE
        owner_keys = self._PUBLIC_KEY_RE.findall(record.key) + self._PUBLIC_KEY_RE.findall(record.subkey)
        if not owner_keys:
            if odd_subkey:
                return Rejection("unsigned", None, f"subkey of type {type(subkey).__name__}, not bytes")
            if not must_sign:
                return None  # not a record of ours
            kind = "oversized" if len(record.value) > MAX_VALUE_BYTES else "unsigned"
            return Rejection(kind, None, f"{len(record.value)}-byte record without an owner key")
        signatures = len(self._SIGNATURE_RE.findall(record.value))
        try:
            verified = super().validate(record)
        except Exception:  # noqa: BLE001 - hivemind raises on an owner key that does not parse
            verified = False
        if not verified:
            if signatures == 0:
                return Rejection("unsigned", None, "owner key without a signature")
            return Rejection("bad_signature", None, "the signature does not verify with the owner key")
        # The signature verifies: whoever holds this owner key wrote exactly this record.
        parsed = parse_signed_subkey(subkey)
        if isinstance(parsed, str):
            if not must_sign and not odd_subkey:
                return None  # another application's signed record
            return Rejection("malformed", _owner_of(owner_keys[0]), parsed)
        claimed, owner = parsed
        if claimed != owner:
            return Rejection("wrong_owner", owner, f"claims to be {claimed}'s record")
        if len(record.value) > MAX_VALUE_BYTES:
            return Rejection("oversized", owner, f"{len(record.value)}-byte value")
        if self._schema is not None:
            stripped = dataclasses.replace(record, value=self.strip_value(record))
            version = _protocol_of(stripped.value) if must_sign else None
            if version is not None and version != PROTOCOL_VERSION:
                return Rejection("version", None, other_version_detail(version))
            try:
                matches = self._schema.validate(stripped)
            except Exception:  # noqa: BLE001 - hivemind catches only ValueError while deserializing
                matches = False
            if not matches:
                return Rejection("malformed", owner, "the value does not match the key's schema")
        return None

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if isinstance(other, RecordGuard):
            if self._private_key is None and other._private_key is not None:
                self._private_key, self._local_public_key = other._private_key, other._local_public_key
            if other._schema is not None:
                if self._schema is None:
                    self._schema = other._schema
                else:
                    self._schema.merge_with(other._schema)
            self._signed_keys |= other._signed_keys
            return True
        return super().merge_with(other)  # hivemind keeps a single signature validator per node


def _protocol_of(value: bytes) -> object:
    """The ``protocol`` field of a msgpack dict value, or ``None`` when there is none to read."""
    try:
        decoded = MSGPackSerializer.loads(value)
    except Exception:  # noqa: BLE001 - not ours to read: the schema check says why
        return None
    return decoded.get("protocol") if isinstance(decoded, dict) else None


def other_version_detail(version: object) -> str:
    return (f"a record of protocol version {str(version)[:16]}, this release speaks {PROTOCOL_VERSION}: its writer "
            "runs another release of p2p_diloco; it is neither averaged with nor banned (run one release "
            "across the swarm)")


def _owner_of(public_key: bytes) -> str | None:
    try:
        return peer_id_of_public_key(public_key).to_base58()
    except Exception:  # noqa: BLE001
        return None
