"""The flake gate (scripts/flake_gate.py) counts each test's failures over N real pytest runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GATE = Path(__file__).parents[2] / "scripts" / "flake_gate.py"

FLAKY = '''
import pathlib

import pytest

pytestmark = pytest.mark.processes  # what tests/conftest.py marks a multi-process test
COUNT = pathlib.Path(__file__).with_name("count")


def test_flaky():
    n = int(COUNT.read_text()) if COUNT.exists() else 0
    COUNT.write_text(str(n + 1))
    assert n % 2 == 1, "fails on even runs"


def test_steady():
    pass


def test_needs_a_tool():
    pytest.skip("no such tool here")
'''


def _gate():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("flake_gate", GATE)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(autouse=True)
def _bare_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate's pytest runs load no plugins here (they only cost start-up time for these sample tests)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def test_the_gate_counts_each_tests_failures_across_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "test_sample.py").write_text(FLAKY)
    (tmp_path / "test_fast.py").write_text("def test_not_slow():\n    raise AssertionError('not a multi-process test')\n")
    gate = _gate()
    assert gate.main(["2", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    # run 1 fails (count 0), run 2 passes; the test not marked processes is not run at all
    # a test is named as pytest's report names it: its module path from the run's root directory
    flaky = [line for line in out.splitlines() if line.startswith("FLAKY ")]
    assert len(flaky) == 1 and flaky[0].startswith("FLAKY 1/2 ") and flaky[0].endswith("test_sample::test_flaky"), out
    assert "fails on even runs" in out and "test_steady" not in out.split("FLAKY", 1)[1]
    assert "SKIPPED 2/2 " in out and "test_sample::test_needs_a_tool: no such tool here" in out, out
    assert "1 skipped" in out.splitlines()[0], out  # each run's line counts skips apart from passes
    assert out.strip().endswith("3 tests, 1 failed at least once, 1 skipped at least once in 2 runs"), out


def test_the_gate_refuses_a_selection_without_tests(tmp_path: Path) -> None:
    (tmp_path / "test_none.py").write_text("def test_plain():\n    pass\n")  # no process: nothing to run
    assert _gate().main(["1", str(tmp_path)]) == 2


def test_workers_run_test_files_side_by_side_as_xdist_does(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gate = _gate()
    seen: list[list[str]] = []
    monkeypatch.setattr(gate.subprocess, "run", lambda args, **_: seen.append(args) or type("R", (), {"returncode": 0}))
    gate.run_once(["tests"], tmp_path / "r.xml", workers=2)
    gate.run_once(["tests"], tmp_path / "r.xml")
    assert seen[0][-5:] == ["-n", "2", "--dist", "loadfile", "tests"] and "-n" not in seen[1]
    with pytest.raises(SystemExit):
        gate.main(["1", "--workers", "0"])


def test_quick_leaves_out_the_long_tests(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gate = _gate()
    seen: list[list[str]] = []
    monkeypatch.setattr(gate.subprocess, "run", lambda args, **_: seen.append(args) or type("R", (), {"returncode": 0}))
    gate.main(["1", str(tmp_path), "--quick"])
    gate.main(["1", str(tmp_path)])
    marks = [args[args.index("pytest") + 2] for args in seen]  # python -m pytest -m MARKS
    assert marks == ["processes and not long", "processes"], seen


def test_keep_leaves_each_runs_output_and_report_for_diagnosis(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(FLAKY)
    kept = tmp_path / "kept"
    assert _gate().main(["2", str(tmp_path / "tests"), "--keep", str(kept)]) == 1
    assert sorted(p.name for p in kept.iterdir()) == ["run1.log", "run1.xml", "run2.log", "run2.xml"]
    # the failing run's traceback is in its log, the passing run's log has none
    assert "fails on even runs" in (kept / "run1.log").read_text()
    assert "fails on even runs" not in (kept / "run2.log").read_text()
