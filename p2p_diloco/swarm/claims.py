"""Group metadata signed by each member: a leader relays its members' claims, it cannot make them up.

hivemind's matchmaking has each follower send its metadata (``group.encode_gather``: weight, norms, epoch,
mode) to the leader, which hands every member the list ``GroupInfo.gathered``. Unsigned, that list is the
leader's word: it could invent a member's weight or norm, or attribute an over-the-cap weight to an honest
peer, and every follower would plan with it and ban on it. So each member signs its own metadata with its
libp2p identity key (the one its DHT records are signed with, ``signing``), and every member checks each
entry before ``plan_group`` sees it:

- the entry carries the signer's public key, and that key's libp2p peer id must be the member's id in the
  group (so a claim names the one peer that could have made it);
- the signature covers a fixed context string and the metadata, which names the run, the model and the epoch.

An entry that fails is refused for the round as malformed, and nobody is banned: it may be the leader's forgery
as well as the member's junk, and this peer cannot tell which. A valid entry is the member's own claim, so
the bans ``plan_group`` decides on it (a weight over ``max_round_weight``, a peer outside
``--allowed-peers``) rest on evidence signed by the banned peer. A leader can still replay a member's claim
of the same run and epoch into another group, or leave members out: either only makes the round fail, as a
leader that never starts it does too.

Cost: one RSA signature per round and member (about a millisecond) and one verification per member and round
(tens of microseconds); a verified key is cached per peer id.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.swarm.signing import peer_id_of_public_key, signing_key

__all__ = ["open_gather", "open_gathered", "sign_gather", "signing_key", "unsigned_payload"]

logger = logging.getLogger(__name__)

CONTEXT = b"p2p_diloco group metadata v1\x00"
"""Prefix of every signed claim, so that a claim's signature is worth nothing as any other signed message."""
MAX_SIGNED_GATHER_BYTES = 8192
"""The largest signed entry read: metadata (at most 4096 bytes), a public key and a signature of up to
4096-bit RSA."""
_MAX_CACHED_KEYS = 4096
_KEYS: OrderedDict[bytes, tuple[bytes, RSAPublicKey]] = OrderedDict()  # peer id -> (ssh key, parsed key)


def sign_gather(inner: bytes, key: RSAPrivateKey) -> bytes:
    """``inner`` (``group.encode_gather``) signed with ``key``: what hivemind gathers from this member."""
    return MSGPackSerializer.dumps([inner, key.get_public_key().to_bytes(), key.sign(CONTEXT + inner)])


def unsigned_payload(raw: object) -> bytes | None:
    """The metadata inside a signed entry, without checking the signature (for cheap early decisions about
    a peer that is talking to us directly, e.g. its epoch when it asks to join); ``None`` if unreadable."""
    entry = _split(raw)
    return None if isinstance(entry, str) else entry[0]


def open_gather(raw: object, peer_id: PeerID) -> bytes | str:
    """The metadata ``peer_id`` signed in ``raw``, or why ``raw`` is not such a claim."""
    entry = _split(raw)
    if isinstance(entry, str):
        return entry
    inner, public_key, signature = entry
    known = _KEYS.get(peer_id.to_bytes())
    if known is not None and known[0] == public_key:
        parsed = known[1]
        _KEYS.move_to_end(peer_id.to_bytes())
    else:
        try:
            owner = peer_id_of_public_key(public_key)
            loaded = serialization.load_ssh_public_key(public_key)
        except Exception:  # noqa: BLE001 - any parse failure of hostile bytes means the same
            return "metadata signed with an unreadable public key"
        if not isinstance(loaded, rsa.RSAPublicKey) or loaded.key_size > 4096 or loaded.public_numbers().e != 65537:
            return "metadata signed with an unusual key (RSA of at most 4096 bits, exponent 65537, expected)"
        parsed = RSAPublicKey(loaded)
        if owner != peer_id:
            return f"metadata signed by {owner.to_base58()}, not by the member"
        _KEYS[peer_id.to_bytes()] = (public_key, parsed)
        while len(_KEYS) > _MAX_CACHED_KEYS:
            _KEYS.popitem(last=False)
    try:
        valid = parsed.verify(CONTEXT + inner, signature)
    except Exception:  # noqa: BLE001
        valid = False
    return inner if valid else "metadata signature does not verify"


def open_gathered(peer_ids: Sequence[PeerID], gathered: Sequence[object]) -> list[bytes | str]:
    """Per member, its verified metadata or why it is refused (``plan_group`` takes both)."""
    return [open_gather(raw, peer) for peer, raw in zip(peer_ids, gathered, strict=True)]


def _split(raw: object) -> tuple[bytes, bytes, bytes] | str:
    if not isinstance(raw, bytes) or len(raw) > MAX_SIGNED_GATHER_BYTES:
        return "signed metadata is not bytes of a sane size"
    try:
        entry = MSGPackSerializer.loads(raw)
    except Exception:  # noqa: BLE001
        return "signed metadata is not valid msgpack"
    if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(isinstance(x, bytes) for x in entry):
        return "metadata is not signed (expected [metadata, public key, signature])"
    return entry[0], entry[1], entry[2]
