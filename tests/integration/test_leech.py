"""Red team: one leech identity downloading every donor's state without end does not slow the swarm's rounds.

Three honest peers train; once each completed ``ROUNDS`` rounds, the leech (``swarm_helpers/leech.py``, one
free identity, 4 request loops per donor within the per-peer stream cap, a random chunk of each donor's
state every half second at most) starts, and they train ``ROUNDS`` more. Before the fix a donor waited for
any download in flight, up to ``--state-download-timeout-s`` (30 s here), before each outer step, and a chunk
served in the last 2 s counted as one: the same attack took rounds of 0.7 s to 33 s. Now the wait is bounded
by a budget of 15% of the time worked, saved up to a burst (``core.chunks.ServeWait``): the leech spends what
the donors saved before it came (a few seconds here), then the honest peers run their rounds under it
(``ROUNDS`` of them within a bound the old code's 30 s waits per round exceed), and the leech's downloads are
cut off instead (logged). Their slowdown is printed, not asserted: it is a timing.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from swarm_procs import env, events, start_bootstrap, start_peer, tail, wait_all, wait_for

from p2p_diloco.core.chunks import SERVE_WAIT_SHARE

pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(540)]

LEECH = Path(__file__).parents[1] / "swarm_helpers" / "leech.py"
NAMES = "abc"
ROUNDS = 6


def _report(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _averaged(tmp: Path, name: str, after: float = 0.0) -> list[dict]:
    return [r for r in events(tmp, name, "round") if r["outcome"] == "averaged" and r["time"] > after]


def _median_gap(rows: list[dict]) -> float:
    times = [r["time"] for r in rows]
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def test_a_leech_cannot_hold_the_donors_rounds_open(tmp_path: Path) -> None:
    boot, maddr = start_bootstrap(tmp_path)
    args = ("--run-id", "leech", "--local-steps", "4", "--min-local-steps", "4", "--max-rounds", "200")
    started = time.time()
    procs = {name: start_peer(tmp_path, name, maddr, *args) for name in NAMES}
    out = tmp_path / "leech.json"
    leech = None
    try:
        wait_for(lambda: all(len(_averaged(tmp_path, n)) > ROUNDS for n in NAMES)
                 or any(p.poll() is not None for p in procs.values()), 150, f"{ROUNDS} rounds without the leech")
        leech = subprocess.Popen([sys.executable, str(LEECH), maddr, "leech", str(tmp_path / "leech"), str(out)],
                                 stdout=open(tmp_path / "leech.out", "w"), stderr=subprocess.STDOUT, env=env())
        wait_for(lambda: _report(out).get("first_chunk") or leech.poll() is not None, 60, "the leech's first chunk")
        began = _report(out).get("first_chunk") or 0.0
        # The bound: the rounds at the pace measured right before the leech, 1.5x, plus the most the donors
        # can have saved up while they trained (their share of the time since start), at least 120 s and at
        # most 200 s, below what the old code's 30 s waits per round take. It follows the machine's pace: one
        # CI run on a slower host timed out at a fixed 120 s.
        pace = max(_median_gap(_averaged(tmp_path, n)[-ROUNDS - 1:]) for n in NAMES)
        saved = SERVE_WAIT_SHARE * (time.time() - started)
        bound = min(200.0, max(120.0, 1.5 * pace * (ROUNDS + 1) + saved))
        try:
            wait_for(lambda: all(len(_averaged(tmp_path, n, began)) > ROUNDS for n in NAMES)
                     or any(p.poll() is not None for p in procs.values()), bound, f"{ROUNDS} rounds under the leech")
        except AssertionError as e:
            under = {n: [(r["epoch"], r["outcome"]) for r in events(tmp_path, n, "round") if r["time"] > began]
                     for n in NAMES}
            raise AssertionError(f"{e} (pace before {pace:.1f} s per round; rounds since: {under}; "
                                 f"leech: {_report(out)})") from None
        attack = _report(out)
        for proc in procs.values():
            proc.terminate()
        codes = wait_all(procs, 60)
    finally:
        for proc in [*procs.values(), *([leech] if leech else [])]:
            if proc.poll() is None:
                proc.terminate()
        if leech is not None:
            leech.wait(timeout=30)
        boot.terminate()
        boot.wait(timeout=30)
    assert codes == dict.fromkeys(NAMES, 0), {n: tail(tmp_path, n) for n in codes}
    # The leech was at work during the rounds measured: every honest peer a donor, chunks flowing throughout.
    assert len(attack["donors"]) == len(NAMES) and attack["chunks"] > 2 * ROUNDS, attack
    logs = {n: (tmp_path / f"{n}.out").read_text() for n in NAMES}
    assert all("cutting it off to change our state" in log for log in logs.values()), {n: tail(tmp_path, n) for n in NAMES}
    # How much slower the rounds were is a timing, printed for the record, not asserted (timings vary with the
    # machine's load; the wait above already fails the old code: its 30 s waits per round outlast it).
    for name in NAMES:
        # the rounds right before the leech (the first rounds are slower, while the windows are learned)
        before = [r for r in _averaged(tmp_path, name) if r["time"] < began][-ROUNDS - 1:]
        under = _averaged(tmp_path, name, began)
        print(f"{name}: median time between rounds {_median_gap(before):.2f} s before, "
              f"{_median_gap(under):.2f} s under the leech ({_median_gap(under) / _median_gap(before):.2f}x)")
