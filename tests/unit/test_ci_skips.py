"""Under CI a skipped test fails (tests/ci_skips.py); elsewhere it stays skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parents[1]
SAMPLE = '''
import pytest


def test_needs_a_tool():
    pytest.skip("'iptables' is not installed")


@pytest.mark.xfail(reason="known")
def test_expected_to_fail():
    raise AssertionError


def test_plain():
    pass
'''


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(TESTS),
                                                                 "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ci_skips", "-p", "no:cacheprovider",
                           "-rA", str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_skip_fails_under_ci_and_names_what_is_missing(tmp_path: Path, ci: str) -> None:
    proc = _run(tmp_path, ci)
    assert proc.returncode == 1, proc.stdout
    assert "1 failed, 1 passed, 1 xfailed" in proc.stdout, proc.stdout
    assert "skipped under CI" in proc.stdout and "'iptables' is not installed" in proc.stdout


def test_outside_ci_a_skip_stays_a_skip(tmp_path: Path) -> None:
    proc = _run(tmp_path, None)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 1 skipped, 1 xfailed" in proc.stdout, proc.stdout
