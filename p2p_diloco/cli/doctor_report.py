"""One line of the preflight's report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Check:
    """One line of the report: ``status`` is ok, warn (joining works, but look at it) or fail."""

    name: str
    status: str
    detail: str
    fix: str = ""
