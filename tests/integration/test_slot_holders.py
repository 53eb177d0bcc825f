"""Red team: identities that ask for state chunks and never read the answers no longer keep a joiner out.

Two honest peers train (``run_peer``, the tiny model: a state of 8 chunks, 6 of them 1 MiB, parameters and
momentum); once each averaged a few rounds, the slot holder (``swarm_helpers/slot_holder.py``: 4 free
identities, each holding 4 unread answers of full-size chunks on every donor, the per-peer cap; 16 streams are
a donor's 16 slots) starts, and then a third peer joins. It must load the swarm's state within 2 rounds of its
start: at its start (``joined at epoch``), or by a synced round among its first two.

With the fix reverted (``bounded_rpc`` as before: each unread message kept its slot up to 120 s) the joiner
got "sent nothing ... busy" for both manifests, trained from its own state at epoch 0, and skipped its first
two rounds: the test fails at its assertion. With it, a request that finds every slot taken takes the slot
of the answer whose message waited longest to leave, once that waited ``bounded_rpc.STALL_S`` (or waits in
line for one): each donor cut 2 held answers and the joiner joined at its start. The joiner's times and the
holder's cost are printed, not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from swarm_procs import (
    SYNCED,
    env,
    events,
    start_bootstrap,
    start_peer,
    start_together,
    tail,
    wait_all,
    wait_for,
)

from p2p_diloco.swarm.access import MAX_CHUNK_STREAMS_PER_PEER

pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(480)]

HOLDER = Path(__file__).parents[1] / "swarm_helpers" / "slot_holder.py"
DONORS = "ab"
IDENTITIES = 4
HOLD_S = 20.0
"""How long the holder keeps each unread answer before it lets go and asks again (below the old 120 s per
message, so before the fix its slots were never free for more than a round trip)."""
WARM_ROUNDS = 3
STEPS = ("--local-steps", "100", "--min-local-steps", "100")
"""Rounds of a few seconds (FAST's 10 steps take about one on loopback): "within 2 rounds" then means something."""


def _report(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _averaged(tmp: Path, name: str) -> list[dict]:
    return [r for r in events(tmp, name, "round") if r["outcome"] == "averaged"]


def test_a_joiner_loads_the_state_while_four_identities_hold_every_donors_chunk_slots(tmp_path: Path) -> None:
    boot, maddr = start_bootstrap(tmp_path)
    args = ("--run-id", "slots", "--max-rounds", "400", *STEPS)
    procs = {n: start_peer(tmp_path, n, maddr, *args, faults=start_together(len(DONORS))) for n in DONORS}
    out = tmp_path / "holder.json"
    holder = None
    try:
        wait_for(lambda: all(len(_averaged(tmp_path, n)) >= WARM_ROUNDS for n in DONORS)
                 or any(p.poll() is not None for p in procs.values()), 180,
                 lambda: f"{WARM_ROUNDS} rounds of the donors: {[tail(tmp_path, n) for n in DONORS]}")
        maddrs = [events(tmp_path, n, "start")[0]["maddrs"][0] for n in DONORS]
        streams = IDENTITIES * MAX_CHUNK_STREAMS_PER_PEER * len(DONORS)
        holder = subprocess.Popen(
            [sys.executable, str(HOLDER), maddr, "slots", str(out), str(IDENTITIES), str(MAX_CHUNK_STREAMS_PER_PEER),
             str(HOLD_S), *maddrs], stdout=open(tmp_path / "holder.out", "w"), stderr=subprocess.STDOUT, env=env())
        wait_for(lambda: _report(out).get("holding", 0) >= streams or holder.poll() is not None, 90,
                 lambda: f"the holder's {streams} streams: {_report(out)} {tail(tmp_path, 'holder')}")
        assert holder.poll() is None, tail(tmp_path, "holder")
        joined_at = time.time()  # every slot of both donors held: the joiner comes now
        swarm_at_join = max(r["new_epoch"] for n in DONORS for r in events(tmp_path, n, "round"))
        procs["c"] = start_peer(tmp_path, "c", maddr, *args)
        wait_for(lambda: len(events(tmp_path, "c", "round")) >= 2 or procs["c"].poll() is not None, 240,
                 lambda: f"the joiner's first 2 rounds: {tail(tmp_path, 'c')}")
        attack = _report(out)
        for proc in procs.values():
            proc.terminate()
        codes = wait_all(procs, 60)
    finally:
        for proc in [*procs.values(), *([holder] if holder else [])]:
            if proc.poll() is None:
                proc.terminate()
        if holder is not None:
            holder.wait(timeout=60)
        boot.terminate()
        boot.wait(timeout=30)
    assert codes == dict.fromkeys([*DONORS, "c"], 0), {n: tail(tmp_path, n) for n in codes}
    start = events(tmp_path, "c", "start")[0]
    first = events(tmp_path, "c", "round")[:2]
    donor_epoch = max(r["new_epoch"] for n in DONORS for r in events(tmp_path, n, "round") if r["time"] <= start["time"])
    loaded = start["how"].startswith("joined") or any(
        r["outcome"] in SYNCED and r["new_epoch"] > donor_epoch for r in first)
    logs = (tmp_path / "c.out").read_text(errors="replace")
    assert loaded, (f"the joiner did not load the state within 2 rounds under the holder ({start['how']}; first "
                    f"rounds {[(r['epoch'], r['outcome']) for r in first]}; holder {attack}):\n{logs[-4000:]}")
    # the holder was at work throughout: every slot of both donors held when the joiner started
    assert attack["opened"] >= IDENTITIES * MAX_CHUNK_STREAMS_PER_PEER * len(DONORS), attack
    since = time.time() - (attack["began"] or time.time())
    pace = [b["time"] - a["time"] for n in DONORS for a, b in zip(_averaged(tmp_path, n), _averaged(tmp_path, n)[1:],
                                                                  strict=False)]
    print(f"joiner: {start['how']} {start['time'] - joined_at:.1f} s after it was started, while the swarm went "
          f"from epoch {swarm_at_join} to {donor_epoch}; first rounds {[(r['epoch'], r['outcome']) for r in first]}; "
          f"donors' median round {sorted(pace)[len(pace) // 2]:.1f} s")
    print(f"holder: {IDENTITIES} identities, {attack['opened']} streams opened in {since:.0f} s "
          f"({attack['opened'] / max(since, 1):.2f}/s), {attack['read']} bytes read (manifests; no answer read)")
