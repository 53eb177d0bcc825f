"""The suite's own guard: a run leaves no process it started behind (``conftest.pytest_sessionfinish``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

CONFTEST_DIR = Path(__file__).resolve().parents[1]

LEAKY = '''
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def peer():
    # as a module fixture whose set-up failed after it started a process: no test, so no per-test reaping
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(sys.argv[-1]).with_name("pid").write_text(str(proc.pid))
    raise RuntimeError("set-up failed after starting a process")


def test_never_runs(peer):
    pass
'''


def test_a_process_left_by_a_failed_module_fixture_is_reaped_when_the_run_ends(tmp_path: Path) -> None:
    test_file = tmp_path / "test_leaky.py"
    test_file.write_text(LEAKY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CONFTEST_DIR), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "-o", "addopts=", str(test_file)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "1 error" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            break
        time.sleep(0.1)
    else:
        psutil.Process(pid).kill()
        raise AssertionError(f"process {pid} started by the run outlived it")
