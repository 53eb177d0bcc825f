"""``run_peer plot``: logs written by the peers' own log writer become a PNG that is read back; bad logs are
one-line usage errors. A plot of a real swarm's logs is drawn in tests/integration/test_export_swarm.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2p_diloco.cli import plot
from p2p_diloco.peer.report import RoundReport
from p2p_diloco.peer.runlog import RunLog


def _log(path: Path, outcomes: list[str]) -> None:
    log = RunLog(str(path))
    log.write("start", peer_id=path.stem, epoch=0, config={"inner": {"batch_size": 4}, "model": {"seq_len": 64}})
    log.write("eval", peer_id=path.stem, epoch=0, eval_loss=5.5)
    for i, outcome in enumerate(outcomes):
        report = RoundReport(epoch=i, outcome=outcome, group_size=2, inner_steps=10, inner_seconds=2.0,
                             bytes_sent=3_000_000, bytes_received=3_100_000, train_loss=5.0 - i / 10, new_epoch=i + 1)
        log.write("round", eval_loss=4.9 - i / 10 if i % 2 else float("nan"), **report.as_dict())
    log.close()


def test_logs_become_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _log(tmp_path / "peer1.jsonl", ["averaged", "averaged", "skipped", "folded_late"])
    _log(tmp_path / "peer2.jsonl", ["averaged", "resynced", "averaged", "averaged"])
    log = plot.read_log(tmp_path / "peer1.jsonl")
    assert log.round_tokens == [2560, 5120, 7680, 10240] and [e[2] for e in log.evals] == pytest.approx([5.5, 4.8, 4.6])
    png = tmp_path / "out" / "rounds.png"
    assert plot.main([str(tmp_path / "peer1.jsonl"), str(tmp_path / "peer2.jsonl"), "-o", str(png)]) == 0
    assert "8 rounds from 2 log(s)" in capsys.readouterr().out
    import matplotlib.image

    pixels = matplotlib.image.imread(str(png))
    assert pixels.shape[:2] == (850, 1300)
    colors = {tuple(p) for p in pixels[::5, ::5, :3].reshape(-1, 3).tolist()}
    assert pixels[..., :3].std() > 0.05 and len(colors) > 20
    # the outcome colours are drawn (red: skipped, orange: resynced)
    assert any(r > 0.8 and g < 0.25 and b < 0.25 for r, g, b in colors)


def test_bad_logs_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "start", "time": 1}\nnot json\n')
    empty = tmp_path / "empty.jsonl"
    _log(empty, [])
    for argv, message in (([str(bad)], "bad.jsonl:2 is not JSON"), ([str(empty)], "no round records")):
        with pytest.raises(SystemExit) as info:
            plot.main(argv)
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and len(err.splitlines()) == 1 and message in err, err
