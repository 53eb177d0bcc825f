"""The simulator runs every mode end to end at a tiny size, deterministically."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from p2p_diloco.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, TrainConfig
from p2p_diloco.simulate import MODES, SimConfig, run

REQUIRED = {"mode", "workers", "local_steps", "speeds", "compression", "final_eval_loss", "total_inner_steps",
            "total_bytes_sent_per_worker", "rounds"}


def _cfg(compression: str = "none", seed: int = 0) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig("tiny", seq_len=32),
        data=DataConfig(eval_batches=1),
        inner=InnerConfig(batch_size=2, lr=2e-3, warmup_steps=1),
        outer=OuterConfig(local_steps=3, min_local_steps=1, compression=compression),
        run=RunConfig(seed=seed),
    )


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_runs_and_learns(mode: str) -> None:
    res = run(_cfg(), SimConfig(mode, workers=2, rounds=2, speeds=[1.0, 0.5])).as_dict()
    assert REQUIRED <= set(res)
    assert res["total_inner_steps"] == 2 * 3 * 2
    assert math.isfinite(res["final_eval_loss"]) and res["final_eval_loss"] < res["initial_eval_loss"]
    assert res["rounds"] and {"round", "eval_loss", "virtual_time_s", "bytes_sent_per_worker"} <= set(res["rounds"][0])
    times = [r["virtual_time_s"] for r in res["rounds"]]
    assert times == sorted(times) and times[-1] > 0
    assert res["total_bytes_sent_per_worker"] > 0


def test_deterministic_for_a_seed_and_seed_matters() -> None:
    a = run(_cfg(seed=1), SimConfig("diloco", workers=2, rounds=1)).final_eval_loss
    b = run(_cfg(seed=1), SimConfig("diloco", workers=2, rounds=1)).final_eval_loss
    c = run(_cfg(seed=2), SimConfig("diloco", workers=2, rounds=1)).final_eval_loss
    assert a == b
    assert a != c


def test_sync_diloco_waits_for_the_slowest_and_dn_does_not() -> None:
    sync = run(_cfg(), SimConfig("diloco", workers=2, rounds=2, speeds=[1.0, 0.5]))
    # Each round waits H / 0.5 = 6 virtual seconds.
    assert [r.virtual_time_s for r in sync.rounds] == [6.0, 12.0]
    dn = run(_cfg(), SimConfig("async-dn", workers=2, rounds=2, speeds=[1.0, 0.5]))
    assert dn.virtual_time_s < sync.virtual_time_s


def test_compression_cuts_bytes() -> None:
    full = run(_cfg("none"), SimConfig("diloco", workers=2, rounds=1)).total_bytes_sent_per_worker
    four = run(_cfg("4bit"), SimConfig("diloco", workers=2, rounds=1)).total_bytes_sent_per_worker
    assert 0.12 < four / full < 0.14


def test_sparse_codec_runs_through_the_same_core_and_counts_both_directions() -> None:
    cfg = _cfg("topk")
    cfg.outer.error_feedback, cfg.outer.error_feedback_decay = True, 0.95
    sparse = run(cfg, SimConfig("diloco", workers=2, rounds=2, credit_undelivered=False))
    full = run(_cfg("none"), SimConfig("diloco", workers=2, rounds=2))
    assert math.isfinite(sparse.final_eval_loss) and sparse.final_eval_loss < sparse.initial_eval_loss
    # both directions: each member's top-k parts (1/140 of fp32) and the replies, the aggregate's own top-k
    # (as large as a part); fp32 is 1/1 both ways. Short tensors (biases, norms) keep all their values.
    ratio = sparse.total_bytes_sent_per_worker / full.total_bytes_sent_per_worker
    assert 1 / 160 < ratio < 1 / 100, ratio
    credited = run(cfg, SimConfig("diloco", workers=2, rounds=2))  # on by default, as in the swarm
    assert credited.total_bytes_sent_per_worker == sparse.total_bytes_sent_per_worker
    assert credited.final_eval_loss != sparse.final_eval_loss  # the credited entries are sent in round 2


def test_eager_rounds_run_the_sparse_codec_with_error_feedback() -> None:
    """Eager overlap with top-k and error feedback (issue 35: "eager overlap still works"): each round sends the
    same bytes as a synchronous one, and the overlapped all-reduce still trains the model."""
    cfg = _cfg("topk")
    cfg.outer.error_feedback, cfg.outer.error_feedback_decay = True, 0.95
    eager = run(cfg, SimConfig("eager", workers=2, rounds=3))
    diloco = run(cfg, SimConfig("diloco", workers=2, rounds=3))
    assert math.isfinite(eager.final_eval_loss) and eager.final_eval_loss < eager.initial_eval_loss
    assert eager.total_bytes_sent_per_worker == diloco.total_bytes_sent_per_worker
    assert eager.final_eval_loss != diloco.final_eval_loss  # the overlap applies each round one round later


def test_a_banned_sender_forgets_its_residual() -> None:
    from p2p_diloco.simulate.engine import build_workers, group_reduction
    from p2p_diloco.simulate.modes import _allreduce

    cfg = _cfg("topk")
    cfg.outer.error_feedback = True
    sim = SimConfig("diloco", workers=3, rounds=1)
    workers = build_workers(cfg, sim, lr=1.0, momentum=0.0)
    reduction = group_reduction(sim, workers[0].state)
    sent = []
    for w in workers:
        for p in w.params:
            p.data.add_(0.01 * (1000.0 if w.index == 2 else 1.0))  # worker 2 moved 1000x as far: an outlier
        decoded, _ = w.state.encode(w.state.pseudo_gradient(w.params))
        sent.append(decoded)
    assert all(len(w.state.feedback) > 0 for w in workers)
    result = run(_cfg(), SimConfig("diloco", workers=2, rounds=1))  # a result object to record bans in
    _allreduce(reduction, sent, [1.0, 1.0, 1.0], result, 1, workers)
    assert {sender for _, sender, _ in reduction.new_bans} == {2}
    assert len(workers[2].state.feedback) == 0 and len(workers[0].state.feedback) > 0
    # nor is it credited with what the reply dropped; the others are, exactly their undelivered values
    from p2p_diloco.simulate.modes import _credit_undelivered

    mean = [sum(t) / 2 for t in zip(sent[0], sent[1], strict=True)]
    replied = [workers[0].state.codec.reply_codec.roundtrip(t) for t in mean]
    before = [t.clone() for t in (workers[0].state.feedback.residual(i) for i in range(len(mean)))]
    sim.credit_undelivered = True
    _credit_undelivered(sim, workers, sent, replied, {2})
    assert len(workers[2].state.feedback) == 0
    for i, (b, s, r) in enumerate(zip(before, sent[0], replied, strict=True)):
        assert torch.equal(workers[0].state.feedback.residual(i), torch.where(r == 0, b + s, b))


@pytest.mark.slow  # the CLI in a process of its own (35 s in CI: two interpreter starts that import the model stack); the engine is tested in-process above
@pytest.mark.long
def test_cli_writes_json(tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "p2p_diloco.simulate", "--mode", "fedavg", "--workers", "2", "--rounds", "1",
         "--local-steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert REQUIRED <= set(data) and data["mode"] == "fedavg" and data["workers"] == 2
    assert "fedavg: eval loss" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "p2p_diloco.simulate", "--mode", "sideways"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "mode" in bad.stderr and "Traceback" not in bad.stderr
