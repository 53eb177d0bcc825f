"""What the swarm-performance report's sections share: where results live, loading them, plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"perf_{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _met(ok: bool) -> str:
    return "yes" if ok else "no"


def _plot(name: str, draw) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    draw(ax)
    fig.tight_layout()
    path = RESULTS / f"perf_{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"![{name}](benchmarks/results/{path.name})"
