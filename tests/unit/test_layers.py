"""The layering contracts of pyproject.toml (``[tool.importlinter]``) hold: core below swarm below peer below
monitoring below cli, a network-free core and simulator, hivemind only in swarm/, and no import cycles between
packages or between the modules of any package (TYPE_CHECKING imports included)."""

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
    assert "4 kept, 0 broken" in out


def _cycles(graph: object, package: str) -> list[list[str]]:
    """Strongly connected components of more than one module among ``package``'s modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):  # type: ignore[attr-defined]
            if not other.startswith(package):
                continue
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):  # type: ignore[attr-defined]
        if module.startswith(package) and module not in index:
            visit(module)
    return found


def test_no_import_cycle_between_any_two_modules_even_for_type_checking() -> None:
    """The contracts leave TYPE_CHECKING imports out; a cycle through one still ties two modules together
    (neither can be read, moved or split without the other), so none is allowed here either."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter")
    graph = grimp.build_graph("p2p_diloco", exclude_type_checking_imports=False)
    assert _cycles(graph, "p2p_diloco") == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    class Graph:
        modules = {"p.a", "p.b", "p.c", "q.x"}
        edges = {"p.a": {"p.b"}, "p.b": {"p.a", "q.x"}, "p.c": {"p.a"}, "q.x": set()}

        def find_modules_directly_imported_by(self, module: str) -> set[str]:
            return self.edges[module]

    assert _cycles(Graph(), "p") == [["p.a", "p.b"]]
