"""The swarm streaming benchmark's settings (benchmarks/streaming_swarm.py): each case's flags and its name."""

from __future__ import annotations

import pytest

from benchmarks.streaming_swarm import label, main, parse_setting


def test_settings_name_fragments_delay_and_eager_and_nothing_else() -> None:
    assert parse_setting("diloco") == (1, 0, False, "fp32")
    assert parse_setting("eager") == (1, 0, True, "fp32")
    assert parse_setting("F4") == (4, 0, False, "fp32")
    assert parse_setting("F4t100") == (4, 100, False, "fp32")
    assert parse_setting("F4t5+topk-sign") == (4, 5, False, "topk-sign")
    assert parse_setting("diloco+topk-sign") == (1, 0, False, "topk-sign")
    for bad in ("F", "f4", "F4t", "eagerly", "F4t1x", "", "F4+4bit", "F4+"):
        with pytest.raises(ValueError, match="use diloco, eager"):
            parse_setting(bad)
    assert [label({"setting": s}) for s in ("diloco", "eager", "F2", "F4t100", "F4t5+topk-sign")] == [
        "DiLoCo", "eager", "F=2, τ=0", "F=4, τ=100", "F=4, τ=5, topk-sign"]
    assert label({"fragments": 2}) == "F=2, τ=0"  # a run stored before settings had names


def test_a_bad_setting_or_name_is_a_usage_error_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--settings", "F4x"])
    assert exit_info.value.code == 2 and "F4x" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--name", "../etc"])
    assert exit_info.value.code == 2
