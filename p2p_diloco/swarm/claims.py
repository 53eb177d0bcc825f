"""Group metadata signed by each member: a leader relays its members' claims, it cannot make them up.

hivemind's matchmaking has each follower send its metadata (``group.encode_gather``: weight, norms, epoch,
mode) to the leader, which hands every member the list ``GroupInfo.gathered``. Unsigned, that list is the
leader's word: it could invent a member's weight or norm, or attribute an over-the-cap weight to an honest
peer, and every follower would plan with it and ban on it. So each member signs its own metadata with its
libp2p identity key (the one its DHT records are signed with, ``signing``), and every member checks each
entry before ``plan_group`` sees it:

- the entry carries the signer's public key, and that key's libp2p peer id must be the member's id in the
  group (so a claim names the one peer that could have made it);
- the signature covers a fixed context string and the metadata, which names the run, the model and the epoch,
  and the member's ``carried`` norm: what its error-feedback residual adds to the parts it is about to send
  (``core.codecs.ErrorFeedback.carried_norm``; ``core.bounds.fresh_limits`` bounds its parts, and so the
  reducers' replies, with it). The host builds the metadata; the averager process, which holds the codec and
  its residuals, adds the carried norm and signs both when the round's search begins (``round_process``).

An entry that fails is refused for the round as malformed, and nobody is banned: it may be the leader's forgery
as well as the member's junk, and this peer cannot tell which. A valid entry is the member's own claim, so
the bans ``plan_group`` decides on it (a weight over ``max_round_weight``, a peer outside
``--allowed-peers``) rest on evidence signed by the banned peer. A leader can still replay a member's claim
of the same run and epoch into another group, or leave members out: either only makes the round fail, as a
leader that never starts it does too.

Wire form: msgpack ``[metadata, carried, public key, signature]``, ``carried`` a float in ``[0, MAX_CARRIED]``.

Cost: one RSA signature per round and member (about a millisecond) and one verification per member and round
(tens of microseconds); a verified key is cached per peer id.
"""

from __future__ import annotations

import logging
import math
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.swarm.signing import peer_id_of_public_key, signing_key

__all__ = ["Claim", "open_claim", "open_gather", "open_gathered", "sign_gather", "signing_key", "unsigned_payload"]

logger = logging.getLogger(__name__)

CONTEXT = b"p2p_diloco group metadata v2\x00"
"""Prefix of every signed claim, so that a claim's signature is worth nothing as any other signed message."""
MAX_SIGNED_GATHER_BYTES = 8192
"""The largest signed entry read: metadata (at most 4096 bytes), a public key and a signature of up to
4096-bit RSA."""
MAX_CARRIED = 1e30
"""The largest carried norm read (``group.MAX_NORM``'s bound on norms)."""
_MAX_CACHED_KEYS = 4096
_KEYS: OrderedDict[bytes, tuple[bytes, RSAPublicKey]] = OrderedDict()  # peer id -> (ssh key, parsed key)


class Claim(NamedTuple):
    """One member's verified claim: its metadata (``group.decode_gather`` reads it) and its carried norm."""

    metadata: bytes
    carried: float


def _signed_message(inner: bytes, carried: float) -> bytes:
    return CONTEXT + struct.pack("<Id", len(inner), carried) + inner


def sign_gather(inner: bytes, key: RSAPrivateKey, carried: float = 0.0) -> bytes:
    """``inner`` (``group.encode_gather``) and the ``carried`` norm signed with ``key``: what hivemind gathers
    from this member. ``ValueError`` unless ``carried`` is a finite float in ``[0, MAX_CARRIED]``."""
    carried = float(carried)
    if not 0.0 <= carried <= MAX_CARRIED:  # also refuses NaN
        raise ValueError(f"carried norm must be within [0, {MAX_CARRIED}], got {carried!r}")
    return MSGPackSerializer.dumps([inner, carried, key.get_public_key().to_bytes(),
                                    key.sign(_signed_message(inner, carried))])


def unsigned_payload(raw: object) -> bytes | None:
    """The metadata inside a signed entry, without checking the signature (for cheap early decisions about
    a peer that is talking to us directly, e.g. its epoch when it asks to join); ``None`` if unreadable."""
    entry = _split(raw)
    return None if isinstance(entry, str) else entry[0]


def open_gather(raw: object, peer_id: PeerID) -> bytes | str:
    """The metadata ``peer_id`` signed in ``raw``, or why ``raw`` is not such a claim."""
    claim = open_claim(raw, peer_id)
    return claim if isinstance(claim, str) else claim.metadata


def open_claim(raw: object, peer_id: PeerID) -> Claim | str:
    """The metadata and carried norm ``peer_id`` signed in ``raw``, or why ``raw`` is not such a claim."""
    entry = _split(raw)
    if isinstance(entry, str):
        return entry
    inner, carried, public_key, signature = entry
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
        valid = parsed.verify(_signed_message(inner, carried), signature)
    except Exception:  # noqa: BLE001
        valid = False
    return Claim(inner, carried) if valid else "metadata signature does not verify"


def open_gathered(peer_ids: Sequence[PeerID], gathered: Sequence[object]) -> list[bytes | str]:
    """Per member, its verified metadata or why it is refused (``plan_group`` takes both)."""
    return [open_gather(raw, peer) for peer, raw in zip(peer_ids, gathered, strict=True)]


def _split(raw: object) -> tuple[bytes, float, bytes, bytes] | str:
    if not isinstance(raw, bytes) or len(raw) > MAX_SIGNED_GATHER_BYTES:
        return "signed metadata is not bytes of a sane size"
    try:
        entry = MSGPackSerializer.loads(raw)
    except Exception:  # noqa: BLE001
        return "signed metadata is not valid msgpack"
    if (not isinstance(entry, (list, tuple)) or len(entry) != 4
            or not all(isinstance(entry[i], bytes) for i in (0, 2, 3))):
        return "metadata is not signed (expected [metadata, carried norm, public key, signature])"
    carried = entry[1]
    if not isinstance(carried, float) or not math.isfinite(carried) or not 0.0 <= carried <= MAX_CARRIED:
        return f"carried norm must be a float within [0, {MAX_CARRIED:g}]"
    return entry[0], carried, entry[2], entry[3]
