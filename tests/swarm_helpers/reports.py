"""What every attacker script of the red-team tests shares: its JSON report, written so a test never reads half."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_report(path: Path, report: dict) -> None:
    """Replace ``path`` with ``report`` as JSON atomically (the test polls the file while the script runs)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, path)
