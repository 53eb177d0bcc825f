"""The per-round JSON-lines log that benchmarks and dashboards read (``--log-file``)."""

from __future__ import annotations

import json
import math
import os
import threading
import time
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
