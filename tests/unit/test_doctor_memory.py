"""The doctor's host-memory estimate against what benchmarks/memory.py measured (no timing, no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2p_diloco.cli import doctor_resources as dr

MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "memory.json"


def _largest_after(*, every_phase: bool) -> dict:
    """The largest measured peer; ``every_phase``: of a run with a joiner (serving and a download too)."""
    runs = [r for r in json.loads(MEASURED.read_text())["runs"] if r["label"] == "after" and r["preset"] != "tiny"
            and (r.get("joiner") or not every_phase)]
    if not runs:
        pytest.skip("no measurement in benchmarks/results/memory.json")
    return max(runs, key=lambda r: r["params"])


@pytest.mark.parametrize("every_phase", [True, False])
def test_the_doctors_host_estimate_is_within_20_percent_of_the_measured_peer(every_phase: bool) -> None:
    run = _largest_after(every_phase=every_phase)
    n = run["params"]
    model_side = run["model_side_b_per_param"] * n  # training on this CPU: the model side is host memory too
    steady = run["phases"]["training"]["steady_bytes"]
    assert dr.host_bytes(n, peak=False) + model_side == pytest.approx(steady, rel=0.2)
    if every_phase:  # the peak is a download's; a run without a joiner has none
        peak = max(p["peak_bytes"] for p in run["phases"].values())
        assert dr.host_bytes(n, peak=True) + model_side == pytest.approx(peak, rel=0.2)


def test_the_doctor_names_the_option_that_makes_a_model_fit() -> None:
    shape = dr.ModelShape(parameters=1_100_000_000, layers=22, hidden=2048, heads=32, vocab=32000)
    plain = dr.training_bytes(shape, 1, 2048, True)
    options = dict(dr.gpu_options(shape, 1, 2048, True, free=24 * 10**9))
    assert options["--gradient-checkpointing"] < plain
    assert options["--weights-dtype bf16"] < plain
    assert options["--gradient-checkpointing --weights-dtype bf16"] < min(options["--gradient-checkpointing"],
                                                                          options["--weights-dtype bf16"])
    first = dr.gpu_options(shape, 1, 2048, True, free=24 * 10**9)[0]
    assert first[1] <= 24 * 10**9 < plain  # the first option named fits where the plain setup does not
    assert dr.GPU_BYTES_PER_PARAM == {"fp32": 16, "bf16": 8}
