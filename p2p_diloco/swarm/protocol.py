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

PROTOCOL_VERSION = 2
"""1: every release before the version existed (names without it). 2: progress records carry ``phase_s``
and ``protocol``."""


def versioned(name: str, protocol: int = PROTOCOL_VERSION) -> str:
    """``name`` as peers of ``protocol`` spell it (version 1 used the bare name)."""
    return name if protocol == 1 else f"{name}_v{protocol}"


def averager_prefix(run_id: str, fingerprint: str, protocol: int = PROTOCOL_VERSION) -> str:
    """The averager's prefix: its matchmaking key, its state donors' key and its RPCs' namespace."""
    return f"{versioned(run_id, protocol)}_{fingerprint[:16]}"


def neighbours(protocol: int = PROTOCOL_VERSION) -> tuple[int, ...]:
    """The versions a peer of ``protocol`` looks for at start: the previous ones (1 onwards) and the next two
    (a peer of a newer release knows our names, we can only guess theirs)."""
    return tuple(v for v in range(1, protocol + 3) if v != protocol)
