"""Verified chunks of a state download kept on disk, so a download cut by a restart resumes.

Layout, under the peer's ``<checkpoint_dir>/state-partial/``: ``<digest>.part`` holds every received chunk
at its fixed offset (``ChunkMap.file_offset``, a sparse file), ``<digest>.done`` the 4-byte indices of the
chunks written, appended after each chunk's bytes. Nothing is trusted on reading back: an index outside the
state is skipped and every chunk is hashed again against the manifest (already checked against the digest
the swarm voted for) before it is used, so a torn write or a tampered file costs a re-download, never a
wrong state. No fsync per chunk: a chunk lost in a crash is just fetched again.

Bounded: one partial at most, the state the peer wants now (at most one state's size on disk). Opening the
store for a digest deletes every other partial (a stale state is never wanted again: the swarm moved on), and
a completed download deletes its own. With fragments, each fragment's partial lies in ``fragment-<f>/``, and
:func:`drop_unused` deletes at start those this peer's layout cannot use (another ``--fragments`` before).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

from p2p_diloco.core.chunks import DIGEST_BYTES, ChunkMap

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[0-9a-f]{64}\.(part|done)")
_FRAGMENT_DIR = re.compile(r"fragment-(\d{1,4})")


def drop_unused(directory: Path, fragments: int) -> None:
    """Delete the partial downloads under ``directory`` that a peer with ``fragments`` fragments never resumes:
    the whole model's when it has fragments, and every ``fragment-<f>/`` with f at or above ``fragments``
    (all of them without fragments). Only files named as partials are deleted; best effort."""
    try:
        _drop_unused(directory, fragments)
    except OSError as e:
        logger.warning("Could not clear unused partial state downloads in %s: %s", directory, e)


def _drop_unused(directory: Path, fragments: int) -> None:
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        found = _FRAGMENT_DIR.fullmatch(path.name)
        if found and path.is_dir() and int(found.group(1)) >= (fragments if fragments > 1 else 0):
            for inner in path.iterdir():
                if _NAME.fullmatch(inner.name):
                    logger.info("Deleting a partial state download of fragment %s (this peer has %d fragments)",
                                found.group(1), fragments)
                    inner.unlink(missing_ok=True)
            try:
                path.rmdir()
            except OSError:  # something else in it: left alone
                logger.debug("Kept %s: it holds other files", path)
        elif fragments > 1 and _NAME.fullmatch(path.name):
            logger.info("Deleting a partial state download of the whole model (this peer has %d fragments)",
                        fragments)
            path.unlink(missing_ok=True)


class PartialStore:
    """The partial download of state ``sha`` under ``directory``, for a state laid out as ``chunks``."""

    def __init__(self, directory: Path, sha: str, chunks: ChunkMap) -> None:
        if not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise ValueError(f"not a sha256 digest: {sha[:80]!r}")
        self.directory, self.sha, self.chunks = Path(directory), sha, chunks
        self.part = self.directory / f"{sha}.part"
        self.done = self.directory / f"{sha}.done"

    def prepare(self) -> None:
        """Create the directory and delete every other partial download in it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in self.directory.iterdir():
            if _NAME.fullmatch(path.name) and not path.name.startswith(self.sha):
                logger.info("Deleting a stale partial state download %s", path.name)
                path.unlink(missing_ok=True)

    def write(self, index: int, data: bytes) -> None:
        """Keep verified chunk ``index`` (best effort: a full disk only costs the resume)."""
        try:
            fd = os.open(self.part, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.pwrite(fd, data, self.chunks.file_offset(index))
            finally:
                os.close(fd)
            with open(self.done, "ab") as f:
                f.write(struct.pack("<I", index))
        except OSError as e:
            logger.warning("Could not keep chunk %d of the state download on disk: %s", index, e)

    def load(self, digests: bytes, write: Callable[[int, bytes], None]) -> set[int]:
        """Hand every kept chunk that still hashes to its manifest digest to ``write(index, data)``; returns
        their indices."""
        try:
            raw = self.done.read_bytes()[: 4 * self.chunks.count * 2]  # each index at most twice, bounded
        except OSError:
            return set()
        have: set[int] = set()
        try:
            with open(self.part, "rb") as f:
                for (index,) in struct.iter_unpack("<I", raw[: len(raw) - len(raw) % 4]):
                    if index >= self.chunks.count or index in have:
                        continue
                    f.seek(self.chunks.file_offset(index))
                    data = f.read(self.chunks.length(index))
                    expected = digests[index * DIGEST_BYTES:(index + 1) * DIGEST_BYTES]
                    if len(data) == self.chunks.length(index) and hashlib.sha256(data).digest() == expected:
                        write(index, data)
                        have.add(index)
        except OSError as e:
            logger.warning("Could not read the partial state download: %s", e)
        if have:
            logger.info("Resuming a state download: %d of %d chunks were on disk", len(have), self.chunks.count)
        return have

    def remove(self) -> None:
        self.part.unlink(missing_ok=True)
        self.done.unlink(missing_ok=True)
