"""A hostile DHT writer next to a real two-peer swarm: its records are rejected on receipt, counted by kind,
the ones it signed get it banned, and the honest peers train on as if it were not there.

The vandal (``swarm_helpers/dht_vandal.py``) is a plain hivemind node with its own identity key that, while
two ``run_peer`` processes train, keeps sending malformed and oversized records signed with its key,
forgeries under the honest peers' ids (unsigned, wrongly signed, or claiming their id with its key) that
claim epoch 10**6, and junk under the checksum keys.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from swarm_procs import env, events, start_bootstrap, start_peer, tail, wait_all, wait_for

from p2p_diloco.swarm.signing import REJECTED_RECORD_KINDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROUNDS = 4
VANDAL = Path(__file__).parent / "swarm_helpers" / "dht_vandal.py"
# Records the guard must drop on receipt at every guarded node (the checksum junk is dropped on reading).
PROGRESS_KINDS = ("malformed", "oversized", "forged_plain", "forged_unsigned", "bad_signature", "wrong_owner")


def _report(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def test_vandal_records_are_rejected_counted_and_banned_while_peers_train(tmp_path: Path) -> None:
    boot, maddr = start_bootstrap(tmp_path, "--monitor-run-ids", "hd")
    out = tmp_path / "vandal.json"
    vandal_log = open(tmp_path / "vandal.out", "w")
    vandal = subprocess.Popen(
        [sys.executable, str(VANDAL), maddr, "hd", str(tmp_path / "vandal.id"), str(out)],
        stdout=vandal_log,
        stderr=subprocess.STDOUT,
        env=env(),
    )
    procs: dict[str, subprocess.Popen] = {}
    try:
        wait_for(lambda: "peer_id" in _report(out) or vandal.poll() is not None, 60, "the vandal's DHT node")
        assert vandal.poll() is None, (tmp_path / "vandal.out").read_text()[-3000:]
        args = ("--run-id", "hd", "--local-steps", "6", "--min-local-steps", "6")
        # The first peer of a run steps alone until it sees another, as many rounds as the second one takes to
        # start (two, on a loaded machine). So a trains on until b, which joins it, has run its rounds.
        procs["a"] = start_peer(tmp_path, "a", maddr, *args, "--max-rounds", "60")
        wait_for(lambda: events(tmp_path, "a", "start"), 120, "a's start")
        procs["b"] = start_peer(tmp_path, "b", maddr, *args, "--max-rounds", str(ROUNDS))
        codes = wait_all({"b": procs["b"]}, 180)
        procs["a"].terminate()
        codes |= wait_all({"a": procs["a"]}, 60)
        # Forgeries need the honest subkeys, read from the DHT: the vandal must have had them while they ran.
        vandal.terminate()
        vandal.wait(timeout=30)
    finally:
        for proc in [*procs.values(), vandal]:
            if proc.poll() is None:
                proc.kill()
        boot.terminate()
        boot.wait(timeout=30)
    assert codes == {"a": 0, "b": 0}, {n: tail(tmp_path, n) for n in codes}

    ids = {n: events(tmp_path, n, "start")[0]["peer_id"] for n in "ab"}
    attack = _report(out)
    vandal_id = attack["peer_id"]
    assert set(attack["honest"]) == set(ids.values()), attack  # it saw both honest peers and forged for them
    assert all(attack["sent"].get(kind, 0) > 0 for kind in PROGRESS_KINDS), attack
    # No guarded node (the two peers and the bootstrap) accepted any hostile progress record.
    assert all(attack["accepted"].get(kind, 0) == 0 for kind in PROGRESS_KINDS), attack

    rounds = {n: events(tmp_path, n, "round") for n in "ab"}
    assert len(rounds["b"]) == ROUNDS, rounds["b"]
    # While b ran, the honest peers averaged together every round once both were up (b's first round may be
    # the download of a's state), and never believed the forged epoch. After b left, a only skips.
    last = rounds["b"][-1]["new_epoch"]  # a's rounds from this epoch on came after b had left
    together_phase = {"a": [r for r in rounds["a"] if r["epoch"] < last], "b": rounds["b"]}
    for name, rows in together_phase.items():
        assert all(r["outcome"] in ("averaged", "resynced") for r in rows), (name, rows)
        assert all(r["new_epoch"] <= len(rounds["a"]) + ROUNDS for r in rounds[name]), (name, rounds[name])
        assert all(set(r["contributors"]) <= set(ids.values()) for r in rounds[name]), (name, rounds[name])
        together = [r for r in rows if r["group_size"] == 2]
        assert len(together) >= ROUNDS - 1 and rows[-1]["group_size"] == 2, (name, rows)
    assert all(r["outcome"] == "skipped" for r in rounds["a"] if r["epoch"] >= last), rounds["a"]
    by_epoch: dict[int, set[str]] = defaultdict(set)
    for rows in rounds.values():
        for r in rows:
            by_epoch[r["new_epoch"]].add(r["params_sha256"])
    assert all(len(shas) == 1 for shas in by_epoch.values()), by_epoch

    # Every kind of rejection was counted; the vandal, and only the vandal, was banned for what it signed.
    for name, rows in rounds.items():
        counted = sum((Counter(r["rejected_records"]) for r in rows), Counter())
        assert set(counted) <= set(REJECTED_RECORD_KINDS), counted
        assert all(counted[kind] > 0 for kind in REJECTED_RECORD_KINDS), (name, counted)
        bans = [b for r in rows for b in r["record_bans"]]
        assert [b.split(": ", 1)[0] for b in bans] == [vandal_id], (name, bans)
        # ... in the averager's process too, where matchmaking and the all-reduce are served
        log = (tmp_path / f"{name}.out").read_text()
        assert f"swarm.access: Banning {vandal_id}" in log, tail(tmp_path, name)
        assert not any(b.startswith(tuple(ids.values())) for r in rows for b in r["rejected"]), (name, rows)
