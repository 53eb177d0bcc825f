"""The layering contracts of pyproject.toml (``[tool.importlinter]``) hold: core below swarm below peer below
monitoring below cli, a network-free core and simulator, and no import cycles between packages."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import p2p_diloco

lint = pytest.importorskip("importlinter.cli", reason="import-linter is a dev dependency: pip install -e '.[dev]'")

PYPROJECT = Path(p2p_diloco.__file__).resolve().parents[1] / "pyproject.toml"


def test_import_contracts_are_kept(capsys: pytest.CaptureFixture[str]) -> None:
    if not PYPROJECT.exists():
        pytest.skip("p2p_diloco is not imported from a checkout (no pyproject.toml beside it)")
    # lint_imports configures logging with dictConfig, which disables every logger that exists already;
    # put them back, so that later tests in this process still see their log records.
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = {lg: lg.disabled for lg in loggers}
    try:
        code = lint.lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True)
    finally:
        for lg, was in disabled.items():
            lg.disabled = was
    out = capsys.readouterr().out
    assert code == 0, out
    assert "3 kept, 0 broken" in out
