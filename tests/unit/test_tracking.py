"""Experiment tracking: rounds reach W&B (offline mode) and TensorBoard, read back from the files they write."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hf_assets import wandb_history

from p2p_diloco.config import TrackingConfig
from p2p_diloco.inner_stats import InnerStats
from p2p_diloco.monitoring.tracking import ExperimentTracker, TrackingError
from p2p_diloco.peer.report import Outcome, RoundReport

ROUNDS = [
    RoundReport(epoch=0, outcome=Outcome.AVERAGED, group_size=2, inner_steps=10, inner_seconds=3.0, allreduce_seconds=1.0,
                bytes_sent=1000, bytes_received=1200, train_loss=4.5, new_epoch=1, staleness=[0, 0]),
    RoundReport(epoch=1, outcome=Outcome.SKIPPED, group_size=0, inner_steps=10, inner_seconds=3.0, train_loss=4.25,
                new_epoch=1),
    RoundReport(epoch=1, outcome=Outcome.FOLDED_LATE, group_size=3, inner_steps=8, inner_seconds=2.0, bytes_sent=900,
                bytes_received=950, train_loss=4.0, new_epoch=2, staleness=[0, 2, 0], late_folded=1),
]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _drive(tracker: ExperimentTracker, clock: Clock) -> None:
    tracker.set_peer_id("QmTestPeer12345678")
    tracker.eval(5.0, 0)
    tracker.status("training", 0)
    for i, report in enumerate(ROUNDS):
        clock.now += 4.0  # every round takes 4 s of wall-clock time
        tracker.round(report, InnerStats(report.inner_steps, 40, 2560, report.inner_seconds, report.train_loss,
                                         report.train_loss))
        if i != 1:
            tracker.eval(4.0 - i / 10, report.new_epoch)
    tracker.close()


def test_rounds_reach_tensorboard_and_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrackingConfig(wandb_project="p2p-test", tensorboard_dir=str(tmp_path / "tb"))
    clock = Clock()
    tracker = ExperimentTracker.from_config(cfg, "run-x", {"outer": {"lr": 0.7}})
    assert tracker is not None
    tracker.clock = clock
    _drive(tracker, clock)
    import wandb

    wandb.teardown()  # stop W&B's service process now, not in an atexit hook after the reaper killed it

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (peer_dir,) = (tmp_path / "tb").iterdir()
    assert peer_dir.name == "QmTestPeer12345678"
    events = EventAccumulator(str(peer_dir))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["train/loss"] == [(1, 4.5), (2, 4.25), (3, 4.0)]
    assert scalars["outcome/averaged"] == [(1, 1.0), (2, 0.0), (3, 0.0)]
    assert scalars["outcome/folded_late"] == [(1, 0.0), (2, 0.0), (3, 1.0)]
    assert scalars["round/group_size"] == [(1, 2.0), (2, 0.0), (3, 3.0)]
    assert scalars["round/max_staleness"] == [(1, 0.0), (2, 0.0), (3, 2.0)]
    assert scalars["net/bytes_sent"] == [(1, 1000.0), (2, 0.0), (3, 900.0)]
    assert [v for _, v in scalars["perf/utilization"]] == pytest.approx([0.75, 0.75, 0.5])
    assert [(s, round(v, 4)) for s, v in scalars["eval/loss"]] == [(0, 5.0), (1, 4.0), (3, 3.8)]

    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows, config = wandb_history(run_file)
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step.setdefault(row["_step"], {}).update(row)
    assert [by_step[s]["train/loss"] for s in (1, 2, 3)] == [4.5, 4.25, 4.0]
    assert [by_step[s]["outcome/skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert by_step[3]["net/bytes_received"] == 950 and by_step[3]["eval/loss"] == pytest.approx(3.8)
    assert config["_run_group"] == "run-x" and config["outer"] == {"lr": 0.7}
    assert config["peer_id"] == "QmTestPeer12345678" and config["_run_name"] == "run-x-12345678"


def test_tracking_config_and_missing_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ExperimentTracker.from_config(TrackingConfig(), "r", {}) is None
    with pytest.raises(ValueError, match="wandb_project"):
        TrackingConfig(wandb_entity="team")
    with pytest.raises(ValueError, match="tensorboard_dir: must not be empty"):
        TrackingConfig(tensorboard_dir=" ")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import raises ImportError
    with pytest.raises(TrackingError, match=r"pip install 'p2p-diloco\[tracking\]'"):
        ExperimentTracker.from_config(TrackingConfig(wandb_project="p"), "r", {})
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TrackingError, match="--tensorboard-dir"):
        ExperimentTracker.from_config(TrackingConfig(tensorboard_dir=str(blocker / "tb")), "r", {})
