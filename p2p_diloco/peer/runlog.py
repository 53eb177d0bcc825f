"""The per-round JSON-lines log that benchmarks and dashboards read (``--log-file``)."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, TextIO


def _clean(value: Any) -> Any:
    # JSON has no NaN/Infinity; write null so every reader can parse the line.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class RunLog:
    """Appends one JSON object per line, flushed at once so a crash loses at most the line being written."""

    def __init__(self, path: str | None) -> None:
        self._file: TextIO | None = None
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = _clean({"event": event, "time": time.time(), **fields})
        if self._file is not None:
            line = json.dumps(record, sort_keys=True)
            with self._lock:
                self._file.write(line + "\n")
                self._file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_records(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The records of a ``--log-file`` (only those of ``event`` when given), also while its peer still writes it.

    Only lines that end in a newline are records: a reader can see the line being appended half written (a
    write of a long record is not atomic for a reader in another process), so the text after the last newline
    is left for the next read. A missing file has no records yet. A complete line that is not a JSON object
    raises ``ValueError`` naming the file and line: that is not a log this module wrote.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    records = []
    for number, line in enumerate(text[: text.rfind("\n") + 1].splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number} is not JSON; pass the JSON-lines files run_peer --log-file "
                             "writes") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number} is not a run_peer log record (not a JSON object)")
        if event is None or record.get("event") == event:
            records.append(record)
    return records
