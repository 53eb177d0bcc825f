"""Red team: a relay of the honest swarm's own bytes earns no trust, so its later claim of a future epoch
captures nobody.

Three honest peers list each other in ``--trusted-peers``; c is slowed for one epoch so that it misses that
round and catches up live, applying the round's update (``swarm.catchup``). The attacker
(``swarm_helpers/relay.py``, one identity built from the project's own averager) follows the honest swarm as
a joiner does and serves its state and round updates with a self-declared donor priority of 10^6, so it is
listed first and delivers chunks. Once c has caught up, the relay serves the honest state plus noise as epoch
+1000, with its checksum and a signed progress record claiming it. Before the fix, c credited the first-listed
donor of the update, trusted it, believed the claim, loaded the forged state, and a and b, trusting c,
followed (all three captured, measured). Now the update was accepted on the trusted peers' published digest,
so nobody is credited: every honest peer keeps its epoch below 1000 and averages on with the others.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from swarm_procs import env, events, start_bootstrap, start_peer, start_together, tail, wait_all, wait_for

from p2p_diloco.swarm.dht import ensure_identity

pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(600)]

RELAY = Path(__file__).parents[1] / "swarm_helpers" / "relay.py"
NAMES = "abc"
SLOW = ",".join(f"slow_steps@{3 + 2 * i}={0.1 * (i + 1):.1f}" for i in range(14))
"""c falls behind now and then, each time a little more (0.1 to 1.4 s per step, every other epoch from 3): a live
catch-up needs c exactly one round behind, and how much slower than a and b that takes depends on the machine's
speed and load (with 1 s per step at every third epoch, an idle machine's a and b ran 3 rounds ahead each time
and c always downloaded the whole state). One of the steps of the ramp lands on one round."""
AFTER = 3
# All three start together (swarm_procs.start_together): in a CI rehearsal a came up first, applied its first round
# alone, and b and c downloaded epoch 1 at start, c mostly from the relay (listed first by its priority), which it
# then credited as a newcomer that trusts nobody does (core.evidence; until its first round). That is the design,
# not the attack this test is about, and the credit check below would fail on it.
AFTER_TIMEOUT_S = 240
"""How long the three may take to average AFTER rounds together once the relay claims. c's slowdowns go on to
epoch 29 whatever happens, and while they last c may miss every round and download the state each time: in a
local run c resynced from epoch 12 to 39 (55 s) before it averaged with a and b again; in a CI run 120 s after
a claim made 37 s into the run were not enough."""


def _report(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _log(tmp: Path, name: str) -> str:
    path = tmp / f"{name}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _relayed_catch_up(tmp: Path, relay: str) -> bool:
    """c applied a missed round's update and the relay delivered verified chunks of it (the chunk count its
    averager logs for the fetch right before)."""
    chunks: dict[str, int] = {}
    for line in _log(tmp, "c").splitlines():
        if "State chunks per donor:" in line:
            chunks = {m[0]: int(m[1]) for m in re.findall(r"(\w+) (\d+)", line.split("donor:", 1)[1])}
        elif "Fetched the update of epoch" in line and chunks.get(relay, 0) > 0:
            return True
    return False


def _together(tmp: Path, name: str, after: float = 0.0) -> list[dict]:
    return [r for r in events(tmp, name, "round")
            if r["outcome"] == "averaged" and r["group_size"] == len(NAMES) and r["time"] > after]


@pytest.mark.parametrize("organisers", [pytest.param(True, id="trusted-peers"), pytest.param(False, id="vouched-only")])
def test_a_relay_that_served_a_catch_up_cannot_then_capture_the_swarm(tmp_path: Path, organisers: bool) -> None:
    """``organisers``: the honest peers list each other in ``--trusted-peers``; else they trust each other only
    from the rounds they averaged together (vouched), before the relay comes."""
    ids = {n: ensure_identity(str(tmp_path / f"{n}.key")) for n in NAMES}
    trusted = tmp_path / "trusted.txt"
    trusted.write_text("".join(f"{i}\n" for i in ids.values()))
    boot, maddr = start_bootstrap(tmp_path)
    # rounds of FAST's 10 local steps: a donor serves a round's update for one inner phase, and the relay must
    # fetch it within that to serve it on
    args = ("--run-id", "cap", "--max-rounds", "200", *(("--trusted-peers", str(trusted)) if organisers else ()))
    procs = {n: start_peer(tmp_path, n, maddr, *args, "--identity-path", str(tmp_path / f"{n}.key"),
                           faults=f"{start_together(3)},{SLOW}" if n == "c" else start_together(3)) for n in NAMES}
    out = tmp_path / "relay.json"
    relay = subprocess.Popen([sys.executable, str(RELAY), maddr, "cap", str(tmp_path / "relay"), str(out)],
                             stdout=open(tmp_path / "relay.out", "w"), stderr=subprocess.STDOUT, env=env())
    try:
        wait_for(lambda: _report(out).get("peer_id") or relay.poll() is not None, 60, "the relay's start")
        relay_id = _report(out)["peer_id"]
        wait_for(lambda: _relayed_catch_up(tmp_path, relay_id)
                 or any(p.poll() is not None for p in [*procs.values(), relay]), 240,
                 "c's live catch-up with chunks from the relay")
        (tmp_path / "relay" / "capture").touch()
        wait_for(lambda: _report(out).get("claimed") or relay.poll() is not None, 60, "the relay's claim")
        began = max(r["time"] for n in NAMES for r in events(tmp_path, n, "round"))
        wait_for(lambda: all(len(_together(tmp_path, n, began)) >= AFTER for n in NAMES)
                 or any(p.poll() is not None for p in procs.values()), AFTER_TIMEOUT_S,
                 f"{AFTER} rounds of all three after the claim")
        attack = _report(out)
        for proc in procs.values():
            proc.terminate()
        codes = wait_all(procs, 60)
    finally:
        for proc in [*procs.values(), relay]:
            if proc.poll() is None:
                proc.terminate()
        relay.wait(timeout=30)
        boot.terminate()
        boot.wait(timeout=30)
    assert codes == dict.fromkeys(NAMES, 0), {n: tail(tmp_path, n) for n in codes}
    # The attack ran: the relay followed the swarm, handed out manifests, and claimed a future epoch.
    assert attack["followed"] >= 1 and attack["served"] >= 1 and attack["claimed"] >= 1000, attack
    logs = {n: _log(tmp_path, n) for n in NAMES}
    assert _relayed_catch_up(tmp_path, relay_id) and "Applied the round of epoch" in logs["c"]
    for name in NAMES:
        assert all(r["new_epoch"] < 1000 for r in events(tmp_path, name, "round")), name
        assert not re.search(r"Synchronised to epoch \d{4,}", logs[name]), tail(tmp_path, name)
        # the relay is never credited: a round's update vouches for nobody (core.sync), and a peer that loads a
        # whole state before anyone is trusted credits the donor that delivered most (core.evidence's newcomer rule)
        credited = re.findall(r"Trusting (\w+) until our first round", logs[name])
        assert relay_id not in credited, (name, credited)
        assert len(_together(tmp_path, name, began)) >= AFTER, name
