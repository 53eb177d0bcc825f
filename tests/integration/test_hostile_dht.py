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

pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(240)]

ROUNDS = 4
VANDAL = Path(__file__).parents[1] / "swarm_helpers" / "dht_vandal.py"
# Records the guard must drop on receipt at every guarded node (the checksum junk is dropped on reading).
PROGRESS_KINDS = ("malformed", "oversized", "forged_plain", "forged_unsigned", "bad_signature", "wrong_owner")


def _together(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["outcome"] == "averaged" and r["group_size"] == 2]


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
        args = ("--run-id", "hd", "--local-steps", "6", "--min-local-steps", "6", "--max-rounds", "60")
        procs = {name: start_peer(tmp_path, name, maddr, *args) for name in "ab"}
        # The first peer up steps alone until it sees the other (as many rounds as that one takes to start),
        # so the run is not a number of rounds but ROUNDS rounds of the two together.
        wait_for(lambda: all(len(_together(events(tmp_path, n, "round"))) >= ROUNDS for n in "ab")
                 or any(p.poll() is not None for p in procs.values()), 180, f"{ROUNDS} rounds together")
        for proc in procs.values():
            proc.terminate()
        codes = wait_all(procs, 60)
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
    # Until their last round together, the honest peers averaged every round (alone at first, or by
    # downloading the other's state to join) and never believed the forged epoch; once both were up they
    # averaged together.
    for name, rows in rounds.items():
        together = _together(rows)
        assert len(together) >= ROUNDS, (name, rows)
        first, last = rows.index(together[0]), rows.index(together[-1])
        # (folded_late: a peer that joined by the other's state folds the work of its first phase in later)
        assert all(r["outcome"] in ("averaged", "resynced", "folded_late") for r in rows[: last + 1]), (name, rows)
        assert all(r["group_size"] == 2 for r in rows[first : last + 1]), (name, rows)
        assert all(r["new_epoch"] <= len(rounds["a"]) + len(rounds["b"]) for r in rows), (name, rows)
        assert all(set(r["contributors"]) <= set(ids.values()) for r in rows), (name, rows)
    by_epoch: dict[int, set[str]] = defaultdict(set)
    for rows in rounds.values():
        for r in rows:
            if r["outcome"] != "skipped":  # a round the other's stop cut short is skipped
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
