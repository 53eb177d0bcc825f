"""``python -m p2p_diloco.simulate sweep`` runs end to end at a tiny size; the single-worker and replica
baselines run."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig
from p2p_diloco.simulate import SimConfig, run
from p2p_diloco.simulate.sweep import SweepPoint, SweepResult


@pytest.mark.slow  # the sweep CLI in a process of its own (34 s in CI); the sweep itself is tested in-process
@pytest.mark.long
def test_sweep_cli_prints_plots_and_writes_the_best(tmp_path) -> None:
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    proc = subprocess.run(
        [sys.executable, "-m", "p2p_diloco.simulate", "sweep", "--modes", "diloco", "async-dn", "--workers", "2",
         "--rounds", "2", "--local-steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
         "--outer-lrs", "0.5", "1.0", "--outer-momenta", "0", "--seeds", "0", "--json", str(out),
         "--plot", str(png)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["points"]) == 4 and {p["mode"] for p in data["points"]} == {"diloco", "async-dn"}
    assert all(math.isfinite(f) for p in data["points"] for f in p["finals"])
    best = data["best"]["diloco"]
    assert best["mean"] == min(p["finals"][0] for p in data["points"] if p["mode"] == "diloco")
    assert "best diloco: outer lr" in proc.stdout and "best async-dn" in proc.stdout
    assert png.stat().st_size > 1000
    bad = subprocess.run([sys.executable, "-m", "p2p_diloco.simulate", "sweep", "--modes", "ddp"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--modes" in bad.stderr and "Traceback" not in bad.stderr


def test_sensitivity_names_the_neighbours() -> None:
    pts = [SweepPoint("diloco", lr, m, [loss]) for (lr, m, loss) in
           [(0.5, 0.0, 2.2), (1.0, 0.0, 2.0), (0.5, 0.9, 2.1), (1.0, 0.9, 3.0)]]
    res = SweepResult(2, 5, 3, [0], "tiny", pts)
    best = res.best("diloco")
    assert (best.outer_lr, best.outer_momentum) == (1.0, 0.0)
    sens = res.sensitivity("diloco")
    assert math.isclose(sens["lr_down"], 0.1) and math.isclose(sens["mom_up"], 0.5)
    assert "lr_up" not in sens and "mom_down" not in sens


def test_single_worker_and_replica_baselines_run() -> None:
    cfg = TrainConfig(model=ModelConfig("tiny", seq_len=32), data=DataConfig(eval_batches=1),
                      inner=InnerConfig(batch_size=2, lr=2e-3, warmup_steps=1),
                      outer=OuterConfig(local_steps=2, min_local_steps=1, lr=0.5, momentum=0.5),
                      run=RunConfig(seed=0))
    # FedAvg over one worker is plain single-worker training.
    single = run(cfg, SimConfig("fedavg", workers=1, rounds=2))
    assert single.total_inner_steps == 4 and single.total_bytes_sent_per_worker == 0
    assert single.final_eval_loss < single.initial_eval_loss
    for k in (1, 2):
        rep = run(cfg, SimConfig("diloco", workers=k, rounds=2))
        assert rep.total_inner_steps == 4 * k and math.isfinite(rep.final_eval_loss)


def test_late_arrival_rules_run_on_the_same_schedule() -> None:
    from p2p_diloco.simulate.late import run_late_arrivals

    cfg = TrainConfig(model=ModelConfig("tiny", seq_len=32), data=DataConfig(eval_batches=1),
                      inner=InnerConfig(batch_size=2, lr=2e-3, warmup_steps=1),
                      outer=OuterConfig(local_steps=2, min_local_steps=1, lr=0.5, momentum=0.5),
                      run=RunConfig(seed=0))
    sim = SimConfig("diloco", workers=2, rounds=3, speeds=[1.0, 0.5])
    p2p = run_late_arrivals(cfg, sim, "p2p")
    server = run_late_arrivals(cfg, sim, "server")
    # Worker 1 hands in at round 2 only (its task takes two rounds): 3 + 1 tasks of 2 steps.
    assert p2p.total_inner_steps == server.total_inner_steps == 2 * (3 + 1)
    assert [r.virtual_time_s for r in p2p.rounds] == [2.0, 4.0, 6.0]
    assert p2p.final_eval_loss != server.final_eval_loss
    assert all(math.isfinite(r.eval_loss) for r in p2p.rounds + server.rounds)
