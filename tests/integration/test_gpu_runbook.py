"""The GPU run-book's dry run: the command a GPU machine runs, on this CPU, through the same sections.

``benchmarks/gpu_runbook.sh`` falls back to ``--dry-run`` without CUDA; the dry run trains tiny shapes on the
CPU through the same probes, peers and simulator as the GPU run and writes its JSON with ``"dry_run": true``.
The first test runs the in-process and child-process sections (a training probe, the simulator); the second,
marked slow, the sections that start real peers (the memory section's peer and the two-peer swarm).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.cli.doctor_resources import host_bytes

ROOT = Path(__file__).resolve().parents[2]


def _runbook(tmp_path: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "runbook.json"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_runbook.sh"), *args, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_without_cuda_the_runbook_runs_its_dry_run(tmp_path: Path) -> None:
    done, data = _runbook(tmp_path, "--sections", "throughput,simulator", timeout=600)
    assert "running the dry run instead" in done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    assert data["dry_run"] is True and data["device"] == "cpu" and data["ok"] is True
    assert "memory" not in data and "swarm" not in data  # only the sections asked for
    (tiny,) = data["throughput"]["presets"]
    assert tiny["ok"] and tiny["model"] == "tiny" and tiny["tokens_per_s"] > 0
    assert tiny["mfu"] is None and tiny["gpu"] is None  # no GPU figure is ever claimed on the CPU
    sim = data["simulator"]
    assert set(sim["runs"]) == {"ddp", "diloco-defaults", "diloco-lr1"}
    assert sim["runs"]["diloco-lr1"]["outer_lr"] == 1.0 and sim["runs"]["diloco-lr1"]["outer_momentum"] == 0.0
    # equal compute: k x H x rounds sequences on both sides
    assert sim["runs"]["ddp"]["total_inner_steps"] == sim["runs"]["diloco-lr1"]["total_inner_steps"]
    assert all(math.isfinite(r) and r > 0 for r in sim["ratio_to_ddp"].values())


@pytest.mark.slow
@pytest.mark.long
def test_the_dry_run_starts_real_peers_for_memory_and_the_swarm(tmp_path: Path) -> None:
    done, data = _runbook(tmp_path, "--dry-run", "--sections", "memory,swarm", timeout=900)
    assert done.returncode == 0, json.dumps({k: data.get(k) for k in ("memory", "swarm")})[-4000:]
    memory = data["memory"]
    probe = memory["device_probe"]
    assert probe["checkpointing"] is True and probe["predicted_device_bytes"] > 0
    host = memory["host"]
    assert host["exit_codes"] == {"peer0": 0} and host["steady_bytes"] > 0
    # The run-book compares what the peer held with the doctor's prediction for the model it trained. On the CPU
    # the ratio itself says nothing (tiny shapes, the process overhead dominates), so what is checked is that the
    # comparison is the right one: the doctor's own formula (host side plus, training on the CPU, the device
    # side) for the parameters the probe and the peer both counted, and the ratios of those numbers.
    assert host["params"] == probe["params"] > 0, (host["params"], probe["params"])
    on_host_training = probe["predicted_device_bytes"]
    assert host["doctor_steady_bytes"] == host_bytes(probe["params"], peak=False) + on_host_training, host
    assert host["doctor_peak_bytes"] == host_bytes(probe["params"], peak=True) + on_host_training, host
    assert host["steady_over_doctor"] == pytest.approx(host["steady_bytes"] / host["doctor_steady_bytes"]), host
    assert host["peak_over_doctor"] == pytest.approx(host["peak_bytes"] / host["doctor_peak_bytes"]), host
    swarm = data["swarm"]
    assert len(swarm["identical_epochs"]) >= 3 and swarm["identical_epochs"] == swarm["averaged_epochs"]
