"""A peer raises its open-files limit before its children start, and the preflight warns about a low one.

Run in child processes started with the limits under test (``preexec_fn``), so this test run's own limit is
never changed."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from p2p_diloco.cli.open_files import LOW_OPEN_FILES

PROBE = """
import json, resource
from p2p_diloco.cli.open_files import check_open_files, raise_open_files_limit
before_after = raise_open_files_limit()
check = check_open_files()
print(json.dumps({"raised": before_after, "now": resource.getrlimit(resource.RLIMIT_NOFILE),
                  "check": [check.name, check.status, check.detail]}))
"""


def _probe(soft: int, hard: int) -> dict:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, preexec_fn=limit,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _hard() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


@pytest.mark.skipif(_hard() != resource.RLIM_INFINITY and _hard() < 2 * LOW_OPEN_FILES,
                    reason="this machine's hard open-files limit is too low to start a child below it and raise it")
def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    hard = min(_hard(), 1 << 20) if _hard() != resource.RLIM_INFINITY else 1 << 20
    got = _probe(1024, hard)
    assert got["raised"] == [1024, hard] and got["now"] == [hard, hard], got
    assert got["check"][:2] == ["open files", "ok"], got


def test_a_low_hard_limit_is_kept_and_the_preflight_warns() -> None:
    got = _probe(512, 1024)
    assert got["raised"] == [512, 1024] and got["now"] == [1024, 1024], got
    name, status, detail = got["check"]
    assert (name, status) == ("open files", "warn") and "1,024" in detail, got
