"""Crash-safe checkpoints: tensors in safetensors, everything else in a JSON manifest. Nothing is pickled.

Layout: ``DIR/ckpt-EEEEEEEE/{state.safetensors, manifest.json}`` with EEEEEEEE the outer epoch.

Writing is atomic: both files go to a hidden temporary folder, are fsynced, and the folder is renamed
into place, then the parent folder is fsynced. A crash at any moment leaves either the previous
checkpoints untouched plus a stray ``.tmp-*`` folder (removed at the next save), or the new complete
checkpoint. The manifest records the sha256 of the tensor file, so a checkpoint damaged later (bad
disk, manual edits) is detected at load time and skipped in favour of the next newest. When every
checkpoint is damaged, loading raises ``DamagedCheckpointError`` instead of answering "none": starting
over is the user's decision. A damaged checkpoint is never overwritten or rotated away: ``set_aside``
renames it ``damaged-ckpt-EEEEEEEE``, out of the way of later saves, for the user to inspect or repair.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TENSORS = "state.safetensors"
MANIFEST = "manifest.json"
PREFIX = "ckpt-"
DAMAGED_PREFIX = "damaged-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message says which and why."""


class DamagedCheckpointError(CheckpointError):
    """Checkpoints exist but none can be loaded; ``damaged`` lists each as (path, reason), newest first."""

    def __init__(self, message: str, damaged: list[tuple[Path, str]]) -> None:
        super().__init__(message)
        self.damaged = damaged


@dataclass
class Checkpoint:
    path: Path
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    skipped: tuple[tuple[Path, str], ...] = ()
    """Newer checkpoints that were damaged, as (path, reason); see ``set_aside``."""

    @property
    def epoch(self) -> int:
        return int(self.manifest["epoch"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(directory: str | os.PathLike, epoch: int, tensors: dict[str, torch.Tensor],
                    manifest: dict[str, Any], keep: int = 3) -> Path:
    """Write a checkpoint for ``epoch`` atomically and keep the newest ``keep`` ones."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for stray in root.glob(".tmp-*"):
        shutil.rmtree(stray, ignore_errors=True)
    final = root / f"{PREFIX}{epoch:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        contiguous = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(contiguous, str(tmp / TENSORS))
        _fsync(tmp / TENSORS)
        body = dict(manifest, format_version=FORMAT_VERSION, epoch=epoch, created_unix=time.time(),
                    tensors_sha256=_sha256(tmp / TENSORS))
        with open(tmp / MANIFEST, "w") as f:
            json.dump(body, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            # Same epoch saved again (e.g. after a resync): replace it, old copy first out of the way.
            old = root / f".tmp-old-{final.name}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync(root)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # safetensors reports write failures as SafetensorError carrying the OS message.
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e):
            raise CheckpointError(
                f"disk full while writing a checkpoint to {str(root)!r}; the previous checkpoints are untouched. "
                "Free space or point --checkpoint-dir at a larger disk"
            ) from None
        raise CheckpointError(
            f"cannot write a checkpoint to {str(root)!r}: {getattr(e, 'strerror', None) or e}"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _read(path: Path) -> Checkpoint:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: manifest unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown manifest format {manifest.get('format_version')!r}")
    if not isinstance(manifest.get("epoch"), int) or manifest["epoch"] < 0:
        raise CheckpointError(f"{path}: manifest epoch missing or invalid")
    if _sha256(path / TENSORS) != manifest.get("tensors_sha256"):
        raise CheckpointError(f"{path}: tensor file does not match the manifest's sha256 (damaged)")
    try:
        tensors = load_file(str(path / TENSORS))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: tensor file unreadable ({e})") from None
    return Checkpoint(path, manifest, tensors)


def load_latest(directory: str | os.PathLike) -> Checkpoint | None:
    """The newest complete, undamaged checkpoint in ``directory``, or None when there is no checkpoint.

    Raises ``DamagedCheckpointError`` when there are checkpoints but every one is damaged.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    damaged: list[tuple[Path, str]] = []
    for path in sorted(root.glob(f"{PREFIX}*"), reverse=True):
        try:
            return dataclasses.replace(_read(path), skipped=tuple(damaged))
        except (CheckpointError, FileNotFoundError) as e:
            logger.warning("skipping checkpoint: %s", e)
            damaged.append((path, str(e).removeprefix(f"{path}: ")))
    if not damaged:
        return None
    what = (f"the only checkpoint in {str(root)!r}, {damaged[0][0].name}, is damaged" if len(damaged) == 1
            else f"all {len(damaged)} checkpoints in {str(root)!r} are damaged")
    reasons = "; ".join(f"{path.name}: {reason}" for path, reason in damaged)
    raise DamagedCheckpointError(f"{what} ({reasons})", damaged)


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint folder to ``damaged-ckpt-...`` next to it, so no save replaces or rotates
    it away; returns the new path (a numbered suffix when that name is taken)."""
    target = path.with_name(DAMAGED_PREFIX + path.name)
    n = 1
    while target.exists():
        target = path.with_name(f"{DAMAGED_PREFIX}{path.name}.{n}")
        n += 1
    os.replace(path, target)
    return target


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The one checkpoint folder ``path`` (a ``ckpt-*`` folder), verified; raises ``CheckpointError``."""
    try:
        return _read(Path(path))
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: {e.strerror or e}") from None
