"""The swarm protocol's version, and the names under which each version's peers meet.

Peers of different releases can disagree on what a valid record or message is: when ``phase_s`` became a
required progress field, a previous release's record was malformed to the new one, a malformed signed record
bans its signer, and a rolling upgrade split the swarm with bans for the rest of the run. So every name peers
meet under carries the version: the progress key, the checksum keys and the averager's prefix (its
matchmaking key, its state donors' key and the namespace of its RPCs). Peers of two versions then never read
each other's records nor call each other's handlers: each side averages among its own, and nobody is banned,
on either side, including a release from before the version existed (version 1, whose names had none).
Records also carry the version (``records.ProgressRecord.protocol``): a record of another version under our
names (a release that changed a field but forgot the bump) is dropped with one log line, never banned.

A peer looks at the names of the versions next to its own once at start (``records.other_versions``) and
says so when it finds peers there; ``run_peer doctor`` reports it as a version mismatch.

Bump :data:`PROTOCOL_VERSION` with any change that a peer of the previous release would refuse or misread:
a record's fields, the group metadata, the state manifest, the wire codecs.
"""

from __future__ import annotations

from typing import Any

PROTOCOL_VERSION = 4
"""1: every release before the version existed (names without it). 2: progress records carry ``phase_s``
and ``protocol``. 3: each round matches under a key of its own epoch (:func:`round_group_bits`); a peer of
version 2 declares under the old key and would never meet one of version 3 in a group, so the two are told
apart by their names and refused with a log line instead. 4: the signed group metadata carries the member's
carried norm (``claims``), which reducers clip to and members bound replies by; a version 3 entry would be
refused as unsigned."""


def versioned(name: str, protocol: int = PROTOCOL_VERSION) -> str:
    """``name`` as peers of ``protocol`` spell it (version 1 used the bare name)."""
    return name if protocol == 1 else f"{name}_v{protocol}"


def averager_prefix(run_id: str, fingerprint: str, protocol: int = PROTOCOL_VERSION) -> str:
    """The averager's prefix: its matchmaking key, its state donors' key and its RPCs' namespace."""
    return f"{versioned(run_id, protocol)}_{fingerprint[:16]}"


def round_group_bits(epoch: int) -> str:
    """The bits of hivemind's matchmaking key (``<prefix>.0b<bits>``) under which the round of ``epoch`` meets:
    the epoch in binary, so that every round declares under a key of its own.

    Why not one key for the whole run: hivemind's DHT keeps, per key and peer, only the record with the LATEST
    expiration, and silently rejects a store that expires earlier. A search ends by marking this peer "not
    looking" with its last declared expiration, and a peer that stepped back (``quorum.EarlyAssembly``) last
    declared until the end of its search, up to ``matchmaking_timeout_s`` ahead. Under one key, the next
    round's declaration (now + window) expired earlier than that record, was rejected, and left this peer
    invisible as a leader: two peers that were both due and present never found each other, both stepped
    back at the end of the window, re-declared until the end of the search, and so met only then, every round
    (measured with 2 peers on loopback: each round waited the whole 7.5 s learned window; it began the first
    time the learned window came out shorter than the flag's 15 s, whose declarations had expired later than
    the next round's). A key per epoch starts every round with no record of this peer at all. It also keeps
    peers of different epochs from joining one group that ``group.plan_group`` would then refuse."""
    return format(max(0, int(epoch)), "b")


def use_round_key(matchmaking: Any, epoch: int) -> None:
    """Make hivemind's ``matchmaking`` declare and look under the key of ``epoch``'s round (call before its
    search begins; hivemind changes the bits again once a group forms, which the next round overrides)."""
    matchmaking.group_key_manager.group_bits = round_group_bits(epoch)


def neighbours(protocol: int = PROTOCOL_VERSION) -> tuple[int, ...]:
    """The versions a peer of ``protocol`` looks for at start: the previous ones (1 onwards) and the next two
    (a peer of a newer release knows our names, we can only guess theirs)."""
    return tuple(v for v in range(1, protocol + 3) if v != protocol)
