"""Red team: a poisoned missed round, and a failed fallback download, leave a peer on its last verified state.

Three honest peers average together; c is slowed in epoch ``SLOW_EPOCH`` so that a and b average that round
without it. The attacker (``swarm_helpers/poisoner.py``, one identity built from the project's own averager
and transfer code) follows the honest swarm and, for each round, serves a poisoned update of it together with
the state it leads to (self-consistent: manifest, chunks and result digest all match, its checksum published),
at a self-declared donor priority of 10^6. Once a and b stepped without c and the poisoner serves its version
of that round, a and b are frozen (SIGSTOP of their whole process trees: a cut between c and every honest
donor), so c's live catch-up can only meet the poison, and its fallback download can only meet the
poisoner's state. c must refuse both (the trusted peers' published digest differs), stay on its last
verified state, alive. Then the attack stops (the poisoner's process ends, a and b resume): within 3 rounds c
holds the swarm's parameters again, and it never held or served the poisoned ones. The poisoner's directory
entry stays, silent (its averager process outlives it), so c's downloads wait out the whole manifest grace
each time: the honest donors must still serve what their manifests described by then (``chunk_transfer.PIN_S``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from swarm_procs import SYNCED, env, events, start_bootstrap, start_peer, tail, wait_all, wait_for

from p2p_diloco.core.rounds import Outcome

pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(300)]

POISONER = Path(__file__).parents[1] / "swarm_helpers" / "poisoner.py"
NAMES = "abc"
SLOW_EPOCH = 3
AFTER = 3
AVERAGED = (Outcome.AVERAGED.value, Outcome.FOLDED_LATE.value)
"""The outcomes of a round a group averaged (with or without this peer's late work)."""


def _report(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _log(tmp: Path, name: str) -> str:
    path = tmp / f"{name}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _signal_tree(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``proc`` and every process it started (its DHT and averager processes, p2p daemons)."""
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def _cut_point(tmp: Path, out: Path) -> int | None:
    """The epoch a and b reached without c, once the poisoner serves its version of that round, else None."""
    poisoned = _report(out).get("poisoned", {})
    for r in events(tmp, "a", "round"):
        epoch = r["new_epoch"]
        # a's round may also fold late work of its own (a joiner left behind once folds it into its next round)
        if (r["outcome"] in AVERAGED and r["group_size"] == 2 and r["epoch"] == SLOW_EPOCH
                and str(epoch) in poisoned
                and any(s["new_epoch"] == epoch for s in events(tmp, "b", "round"))
                and not any(s["new_epoch"] >= epoch for s in events(tmp, "c", "round"))):
            return epoch
    return None


def test_a_poisoned_missed_round_with_a_failed_fallback_leaves_the_peer_on_its_verified_state(
        tmp_path: Path) -> None:
    boot, maddr = start_bootstrap(tmp_path)
    # records outlive the cut: c stays anchored on a and b while they are frozen
    args = ("--run-id", "poison", "--max-rounds", "200", "--progress-ttl-s", "120")
    procs = {n: start_peer(tmp_path, n, maddr, *args, faults=f"slow_steps@{SLOW_EPOCH}=2.5" if n == "c" else "")
             for n in NAMES}
    out = tmp_path / "poisoner.json"
    poisoner = subprocess.Popen([sys.executable, str(POISONER), maddr, "poison", str(tmp_path / "poisoner"),
                                 str(out)], stdout=open(tmp_path / "poisoner.out", "w"), stderr=subprocess.STDOUT,
                                env=env())
    frozen = False
    try:
        wait_for(lambda: _cut_point(tmp_path, out) is not None
                 or any(p.poll() is not None for p in [*procs.values(), poisoner]), 150,
                 "a and b averaging without c, and the poisoner serving that round")
        cut = _cut_point(tmp_path, out)
        assert cut is not None, {n: tail(tmp_path, n) for n in [*NAMES, "poisoner"]}
        for name in "ab":
            _signal_tree(procs[name], signal.SIGSTOP)
        frozen = True
        wait_for(lambda: "Could not download the swarm's state" in _log(tmp_path, "c")
                 or procs["c"].poll() is not None, 120, "c's failed catch-up and fallback download")
        attack = _report(out)
        poisoner.terminate()
        poisoner.wait(timeout=30)
        stopped = time.time()
        for name in "ab":
            _signal_tree(procs[name], signal.SIGCONT)
        frozen = False

        def after(name: str) -> list[dict]:
            return [r for r in events(tmp_path, name, "round") if r["time"] > stopped]

        def matched() -> list[dict]:
            honest = {(r["new_epoch"], r["params_sha256"]) for n in "ab" for r in after(n) if r["outcome"] in SYNCED}
            return [r for r in after("c")[:AFTER] if (r["new_epoch"], r["params_sha256"]) in honest]

        wait_for(lambda: matched() or len(after("c")) > AFTER or any(p.poll() is not None for p in procs.values()),
                 150, f"c holding the swarm's parameters within {AFTER} rounds")
        rejoined = matched()
        for proc in procs.values():
            proc.terminate()
        codes = wait_all(procs, 60)
    finally:
        for proc in procs.values():
            if frozen:
                _signal_tree(proc, signal.SIGCONT)
            if proc.poll() is None:
                proc.terminate()
        if poisoner.poll() is None:
            poisoner.terminate()
            poisoner.wait(timeout=30)
        boot.terminate()
        boot.wait(timeout=30)
    assert codes == dict.fromkeys(NAMES, 0), {n: tail(tmp_path, n) for n in codes}
    log = _log(tmp_path, "c")
    # The attack ran: the poisoner served its version of the round c missed, and c's catch-up met it and
    # refused it, then its download found no acceptable state.
    assert str(cut) in attack["poisoned"], attack
    refused = log.index(f"The update of epoch {cut - 1} from {attack['peer_id']} does not lead to the swarm's state")
    assert "our state is unchanged" in log[refused:].splitlines()[0], log[refused:][:500]
    assert "Could not download the swarm's state" in log[refused:], tail(tmp_path, "c")
    # c never held the poisoned parameters, nor synchronised to anything the poisoner served.
    poisoned = set(attack["poisoned"].values())
    assert not any(r["params_sha256"] in poisoned for r in events(tmp_path, "c", "round"))
    assert f"from {attack['peer_id']}" not in "".join(
        line for line in log.splitlines() if "Synchronised to epoch" in line or "Applied the round" in line)
    # ... and it is the swarm's again within AFTER rounds of the attack's end.
    assert rejoined, ({n: [(r["new_epoch"], r["outcome"], r["params_sha256"][:12]) for r in events(tmp_path, n, "round")]
                       for n in NAMES}, tail(tmp_path, "c"))
