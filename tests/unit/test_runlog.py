"""The ``--log-file`` reader sees only whole records, also while a peer is still appending one."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2p_diloco.peer.runlog import RunLog, read_records


def test_a_half_written_last_line_waits_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "peer.jsonl"
    assert read_records(path) == []  # no file yet: no records yet
    log = RunLog(str(path))
    log.write("start", epoch=0)
    log.write("round", epoch=0, eval_loss=float("nan"), donors=["a" * 300])
    log.close()
    whole = path.read_text()
    # what a reader in another process can see while the writer is in the middle of the second record
    path.write_text(whole[: len(whole) - 200])
    assert [r["event"] for r in read_records(path)] == ["start"]
    path.write_text(whole)
    rounds = read_records(path, "round")
    assert len(rounds) == 1 and rounds[0]["eval_loss"] is None and rounds[0]["donors"] == ["a" * 300]


@pytest.mark.parametrize("text, message", [('{"event": "start"}\nnot json\n', "peer.jsonl:2 is not JSON"),
                                           ('[1, 2]\n', "peer.jsonl:1 is not a run_peer log record"),
                                           (b"\xff\xfe\n", "cannot read")])
def test_a_complete_line_that_is_no_record_is_named(tmp_path: Path, text: str | bytes, message: str) -> None:
    path = tmp_path / "peer.jsonl"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_records(path)
