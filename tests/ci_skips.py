"""Under CI a skipped test fails: ``.ci/run`` installs every tool a test may need (root is given, iptables,
Prometheus), so a skip there means a missing tool or a broken install, which would otherwise hide the
scenario the test guards. Outside CI a skip stays a skip, with its reason.

Loaded by ``tests/conftest.py``; a plugin module of its own so that its test can load it into a bare pytest run."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

CI_VALUES = ("true", "1", "yes")
"""Values of ``CI`` that mean a CI run (``.ci/run`` sets ``CI=true``)."""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in CI_VALUES


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or not in_ci() or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI, where .ci/run installs every tool the tests need: {reason}\n"
                       "install what it names (or run without CI=true to skip it)")
