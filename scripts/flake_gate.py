"""The flake gate: run the multi-process tests N times and report each test's failures.

Usage (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python scripts/flake_gate.py 5                    # every multi-process test, 5 times
    .venv/bin/python scripts/flake_gate.py 5 --quick            # those of `scripts/test.sh --quick` (not `long`)
    .venv/bin/python scripts/flake_gate.py 5 tests/integration/test_red_team.py   # a selection, 5 times
    .venv/bin/python scripts/flake_gate.py 5 --workers 2        # two test files at a time (pytest-xdist)
    .venv/bin/python scripts/flake_gate.py 5 --keep gate-out    # keep each run's pytest output and report

A multi-process test is one tests/conftest.py marks ``processes``: every test in tests/integration (the fast
tier's included) and every ``slow`` one. Each run is one ``pytest -m processes`` over the selection, one test at a time as CI runs them (``--workers N``: N test
files at a time, ``pytest -n N --dist loadfile``, to see whether the tests hold under that load), writing a JUnit
XML report; the gate then prints one line per test that failed at least once (failures/runs, and the first
line of each distinct failure message), one per test that was skipped (skips/runs and the reason: a skip is not
a pass), and exits 1 if any test failed. A change to a multi-process test, or to the
round timing it depends on, should pass it with N = 5 before it lands.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree  # our own pytest's report, written in this run
from collections import defaultdict
from pathlib import Path

PROCESSES = "processes"
QUICK = "processes and not long"
"""The marker expressions of the gate's two selections: every multi-process test, or those of the quick tier."""


def run_once(selection: list[str], report: Path, workers: int = 1, marks: str = PROCESSES,
             output: Path | None = None) -> int:
    """One pytest run of the selection; its output goes to ``output`` (the failures' tracebacks) or nowhere."""
    parallel = ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []
    args = [sys.executable, "-m", "pytest", "-m", marks, "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
            "--durations=0", *parallel, *selection]
    if output is None:
        return subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode
    with output.open("w") as sink:
        return subprocess.run(args, stdout=sink, stderr=subprocess.STDOUT, check=False).returncode


SKIPPED = "skipped: "
"""Prefix of a skipped test's entry in :func:`outcomes`: a skip is counted apart, never as a pass."""


def outcomes(report: Path) -> dict[str, str | None]:
    """test id -> None if it passed, ``SKIPPED`` + its reason if it was skipped, else the first line of its
    failure."""
    out: dict[str, str | None] = {}
    if not report.exists():
        return out
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failed = case.find("failure")
        if failed is None:
            failed = case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            out[name] = (failed.get("message") or "failed").splitlines()[0][:200]
        elif skipped is not None:
            out[name] = SKIPPED + (skipped.get("message") or "").splitlines()[0][:200] if skipped.get("message") \
                else SKIPPED
        else:
            out[name] = None
    return out


def _failed(outcome: str | None) -> bool:
    return outcome is not None and not outcome.startswith(SKIPPED)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=int, help="how many times to run the selection (5 before a change lands)")
    parser.add_argument("selection", nargs="*", default=["tests"], help="test paths (default: the whole suite's "
                        "multi-process tests)")
    parser.add_argument("--workers", type=int, default=1, help="test files run at a time (default 1, as CI)")
    parser.add_argument("--quick", action="store_true", help="leave out the `long` tests, as "
                        "`scripts/test.sh --quick` does")
    parser.add_argument("--keep", type=Path, default=None, help="a folder to keep each run's pytest output "
                        "(runN.log: tracebacks, durations) and JUnit report (runN.xml) in; default: not kept")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("runs must be at least 1")
    if args.workers < 1:
        parser.error("workers must be at least 1")
    runs: dict[str, int] = defaultdict(int)
    failures: dict[str, list[str]] = defaultdict(list)
    skips: dict[str, list[str]] = defaultdict(list)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep if args.keep is not None else Path(tmp)
        for i in range(args.runs):
            began = time.monotonic()
            report = where / f"run{i + 1}.xml"
            log = where / f"run{i + 1}.log" if args.keep is not None else None
            code = run_once(args.selection, report, args.workers, QUICK if args.quick else PROCESSES, log)
            seen = outcomes(report)
            for name, outcome in seen.items():
                runs[name] += 1
                if _failed(outcome):
                    failures[name].append(outcome)  # type: ignore[arg-type]
                elif outcome is not None:
                    skips[name].append(outcome.removeprefix(SKIPPED))
            print(f"run {i + 1}/{args.runs}: exit {code}, {len(seen)} tests, "
                  f"{sum(_failed(f) for f in seen.values())} failed, "
                  f"{sum(f is not None and not _failed(f) for f in seen.values())} skipped, "
                  f"{time.monotonic() - began:.0f} s", flush=True)
            if not seen:
                print("no test report was written: check that the selection collects tests", file=sys.stderr)
                return 2
    for name in sorted(runs):
        if failures[name]:
            print(f"FLAKY {len(failures[name])}/{runs[name]} {name}")
            for message in sorted(set(failures[name])):
                print(f"    {message}")
    for name in sorted(skips):
        print(f"SKIPPED {len(skips[name])}/{runs[name]} {name}: {sorted(set(skips[name]))[0]}")
    print(f"{len(runs)} tests, {sum(bool(f) for f in failures.values())} failed at least once, "
          f"{sum(bool(s) for s in skips.values())} skipped at least once in {args.runs} runs")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
