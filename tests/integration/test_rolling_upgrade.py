"""A rolling upgrade: half the swarm on the previous protocol version, the other half on this release's.

Four peers share one bootstrap node and one run id: a and b run as peers of protocol version 1 (the release
before the version existed: bare names; ``swarm_helpers/old_release.py`` loads the protocol module with that
version before anything else), c and d as this release. Before the protocol was versioned, a record of one
release was malformed to the other and banned its signer, and the swarm split with bans for the rest of the
run. Now the two versions meet under different names: nobody is banned, in any log, and each side averages
among its own (groups of 2, never 3 or 4), each peer at least ``ROUNDS`` rounds; each side says once that it
saw the other version.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from swarm_procs import FAST, env, events, start_bootstrap, start_peer, tail, wait_all, wait_for

from p2p_diloco.swarm.protocol import PROTOCOL_VERSION

pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(240)]

OLD_RELEASE = Path(__file__).parents[1] / "swarm_helpers" / "old_release.py"
OLD, NEW = "ab", "cd"
ROUNDS = 2


def _start_old(tmp: Path, name: str, bootstrap: str, *extra: str) -> subprocess.Popen:
    """``start_peer``, as a peer of protocol version 1."""
    args = [sys.executable, str(OLD_RELEASE), "1", *FAST, "--initial-peers", bootstrap,
            "--log-file", str(tmp / f"{name}.jsonl"), *extra]
    return subprocess.Popen(args, stdout=open(tmp / f"{name}.out", "a"), stderr=subprocess.STDOUT, env=env())


def _averaged(tmp: Path, name: str) -> list[dict]:
    return [r for r in events(tmp, name, "round") if r["outcome"] == "averaged"]


def test_half_the_swarm_on_the_previous_version_bans_nobody_and_each_side_averages_among_its_own(
        tmp_path: Path) -> None:
    assert PROTOCOL_VERSION != 1
    boot, maddr = start_bootstrap(tmp_path)
    args = ("--run-id", "upgrade", "--max-rounds", "200", "--local-steps", "4", "--min-local-steps", "4")
    procs = {n: _start_old(tmp_path, n, maddr, *args) for n in OLD}
    try:
        # This release's peers look for other versions once, at their start: they start once the previous
        # release's peers have published records (a round of theirs is logged), or (seen in a CI rehearsal) both
        # sides started together and neither found the other in time, and nobody said so.
        wait_for(lambda: all(events(tmp_path, n, "round") for n in OLD)
                 or any(p.poll() is not None for p in procs.values()), 90, "the previous release's first rounds")
        procs.update({n: start_peer(tmp_path, n, maddr, *args) for n in NEW})
        wait_for(lambda: all(len(_averaged(tmp_path, n)) >= ROUNDS for n in procs)
                 or any(p.poll() is not None for p in procs.values()), 150, f"{ROUNDS} rounds on each side")
        for proc in procs.values():
            proc.terminate()
        codes = wait_all(procs, 60)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        boot.terminate()
        boot.wait(timeout=30)
    assert codes == dict.fromkeys(procs, 0), {n: tail(tmp_path, n) for n in codes}
    logs = {n: (tmp_path / f"{n}.out").read_text(errors="replace") for n in [*procs, "bootstrap"]}
    for name, log in logs.items():
        assert "Banning" not in log, (name, log[-3000:])
    for name in procs:
        rounds = events(tmp_path, name, "round")
        assert not any(r["record_bans"] for r in rounds), (name, [r["record_bans"] for r in rounds])
        averaged = _averaged(tmp_path, name)
        assert len(averaged) >= ROUNDS and all(r["group_size"] <= 2 for r in rounds), (name, tail(tmp_path, name))
    # Each side averaged with its own: the two sides' parameters of an epoch both reached differ, within a side
    # they are the same (peers of one side share every epoch they averaged).
    for side in (OLD, NEW):
        digests = {r["new_epoch"]: r["params_sha256"] for r in _averaged(tmp_path, side[0])}
        assert any(digests.get(r["new_epoch"]) == r["params_sha256"] for r in _averaged(tmp_path, side[1])), side
    # A side told its operator that peers of another version share the run (each peer looks once, at its start:
    # the side that started first may have found nobody yet).
    assert any("under protocol version" in logs[n] for n in procs), {n: tail(tmp_path, n) for n in procs}
