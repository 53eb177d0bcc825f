"""A client-mode peer (behind NAT: nobody can dial it) in a swarm of full peers, as real processes on loopback.

It must join through the full peers, download their state, average with them (its parts go to full peers,
which reduce them; it reduces nothing) and never announce itself as a state donor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration
from swarm_procs import events, start_bootstrap, start_peer, start_together, tail, wait_all, wait_for

from p2p_diloco.swarm import SwarmConfig, fetch_progress, start_dht
from p2p_diloco.swarm.protocol import averager_prefix

pytestmark = [pytest.mark.slow, pytest.mark.long]

RUN = ["--run-id", "cm", "--local-steps", "10", "--min-local-steps", "10", "--target-group-size", "4",
       "--eval-every", "0"]


def _donors(maddr: str, run_id: str) -> tuple[set[str], set[str]]:
    """Peer ids announcing shareable state for ``run_id`` (read from the DHT), and every peer's id."""
    dht = start_dht(SwarmConfig.for_loopback(initial_peers=[maddr], client_mode=True))
    try:
        records = fetch_progress(dht, run_id)
        fingerprint = records[0].fingerprint
        found = dht.get(f"{averager_prefix(run_id, fingerprint)}.all_averagers", latest=True)
    finally:
        dht.shutdown()
    donors = set()
    if isinstance(found, ValueWithExpiration) and isinstance(found.value, dict):
        for subkey, entry in found.value.items():
            if isinstance(entry, ValueWithExpiration) and entry.value is not None:
                donors.add(PeerID(subkey).to_base58())
    return donors, {r.peer_id for r in records}


def test_client_mode_peer_joins_downloads_and_averages_with_full_peers(tmp_path: Path) -> None:
    boot, maddr = start_bootstrap(tmp_path)
    procs: dict = {}
    try:
        # The full peers run until the test stops them: rounds of about a second, and a client that had to
        # chase them (download, train, find the swarm a few epochs on) must still find them there.
        procs["a"] = start_peer(tmp_path, "a", maddr, *RUN, "--max-rounds", "400")
        procs["b"] = start_peer(tmp_path, "b", maddr, *RUN, "--max-rounds", "400")
        # The client is slowed through its first round, which the full peers finish without it: it must then
        # download their state. (Starting it later would cost another interpreter start on the clock.)
        procs["c"] = start_peer(tmp_path, "c", maddr, *RUN, "--client-mode", "true", "--max-rounds", "20",
                                faults="slow_steps@0=2.5")

        def averaged_by_client() -> list[dict]:
            return [r for r in events(tmp_path, "c", "round") if r["outcome"] == "averaged" and r["group_size"] == 3]

        try:
            wait_for(lambda: averaged_by_client() or procs["c"].poll() is not None, 120, "a round with the client")
        except AssertionError as e:  # say why: the client's rounds and its log
            rounds = [{k: r.get(k) for k in ("epoch", "new_epoch", "outcome", "group_size", "reason")}
                      for r in events(tmp_path, "c", "round")]
            log = "\n".join(line for line in tail(tmp_path, "c", 10**6).splitlines() if "progress:" not in line)
            raise AssertionError(f"{e}; the client's rounds: {rounds[-8:]}; its log: {log[-6000:]}") from None
        donors, peers = _donors(maddr, "cm")
        def logged_by_full_peers() -> bool:
            """Three rounds with the client, each in a's and b's logs too (a round's record is written when it
            ends, on each peer at its own time: stopping at the client's third left the others' unwritten)."""
            epochs = {r["new_epoch"] for r in averaged_by_client()}
            checked[:] = sorted(epochs)
            return len(epochs) >= 3 and all(epochs <= {r["new_epoch"] for r in events(tmp_path, n, "round")}
                                            for n in "ab")

        checked: list[int] = []  # the client's rounds of three when the wait ended: those are compared below
        wait_for(lambda: logged_by_full_peers() or procs["c"].poll() is not None, 120,
                 "three rounds with the client, in every peer's log")
        for proc in procs.values():
            proc.terminate()
        codes = wait_all(procs, 60)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        boot.terminate()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: tail(tmp_path, n) for n in procs}
    client_out = tail(tmp_path, "c", 10**6)
    assert "Traceback" not in client_out
    # nobody can dial a client: it must not offer its addresses as a way in
    assert "others join with" not in client_out and "client mode: others join through" in client_out

    # --eval-every 0: nobody evaluated, not even at start
    assert not any(events(tmp_path, n, "eval") for n in procs)
    assert all(r["eval_loss"] is None for n in procs for r in events(tmp_path, n, "round"))

    ids = {n: events(tmp_path, n, "start")[0]["peer_id"] for n in procs}
    # the client missed a round and downloaded the full peers' state (at start, or after that round)
    first = events(tmp_path, "c", "start")[0]["how"].startswith("joined") or any(
        r["outcome"] == "resynced" for r in events(tmp_path, "c", "round"))
    assert first, events(tmp_path, "c", "round")

    # three rounds in which all three averaged together, ending with the very same parameters
    rounds = {n: {r["new_epoch"]: r for r in events(tmp_path, n, "round") if r["outcome"] in ("averaged", "folded_late")}
              for n in procs}
    together = [rounds["c"][epoch] for epoch in checked]
    assert len(together) >= 3, events(tmp_path, "c", "round")
    for r in together:
        assert set(r["contributors"]) == set(ids.values()), r
        for full in "ab":
            assert rounds[full][r["new_epoch"]]["params_sha256"] == r["params_sha256"], (full, r["new_epoch"])

    # the full peers announce their state; the client, which nobody can dial, never does
    assert set(ids.values()) <= peers
    assert {ids["a"], ids["b"]} <= donors and ids["c"] not in donors, (donors, ids)


def test_a_swarm_of_only_clients_says_nobody_can_reduce(tmp_path: Path) -> None:
    """Two client-mode peers and a bootstrap node: nobody can lead or reduce, so no round can average. Each
    must say so from its first skipped round: in the round's row (``stall``) and a warning naming the fix."""
    boot, maddr = start_bootstrap(tmp_path)
    procs: dict = {}
    try:
        # Each must see the other before its first inner phase ends: a peer that sees nobody then goes on alone
        # (a solo round, "averaged" in a group of 1), which is right for the first peer of a swarm but not
        # what this test is about. Ten steps take about a second, less than two interpreters' start-up can
        # differ by (seen in CI: x stepped alone): each begins once it sees both records (start_together).
        for name in "xy":
            procs[name] = start_peer(tmp_path, name, maddr, *RUN, "--client-mode", "true", "--max-rounds", "1",
                                     faults=start_together(2))
        codes = wait_all(procs, 180)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        boot.terminate()
    assert codes == {"x": 0, "y": 0}, {n: tail(tmp_path, n) for n in procs}
    for name in "xy":
        rows = events(tmp_path, name, "round")
        assert [r["outcome"] for r in rows] == ["skipped"] and rows[0]["stall"] == "all_clients", (
            [{k: r.get(k) for k in ("outcome", "reason", "group_size", "stall")} for r in rows],
            tail(tmp_path, name, 4000))
        assert "nobody can reduce" in rows[0]["reason"]
        out = tail(tmp_path, name, 10**6)
        assert "every peer of this run is in client mode" in out and "Fix:" in out, out[-3000:]
