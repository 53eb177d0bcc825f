"""Volunteers behind home routers, live: real bootstrap and run_peer processes in the home-network testbed
(``benchmarks/testbed.py`` with ``homes``: every home router masquerades its LAN and drops new inbound
connections; the bootstrap node is public). Each way in of the peers' guide ("Behind NAT") must average
rounds that end in identical parameters; a swarm nobody can dial must say so, with the fix.

Needs root and iptables (CI has both); skips with the reason elsewhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from swarm_procs import FAST, start_together

from benchmarks.testbed import MADDR, Testbed, missing_requirements, start_swarm, wait_peers
from p2p_diloco.cli.run_bootstrap import READY_LINE, BootstrapConfig, read_relay_line
from p2p_diloco.demo import announced
from p2p_diloco.peer.runlog import read_records


def _prefix(tag: str) -> str:
    """Namespace names unique to this process: two suites running at once (a rehearsal beside CI) never
    collide on ``ip netns add``, as a name derived from ``tmp_path`` alone did."""
    return f"{tag}{os.getpid()}x"


pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(missing_requirements(nat=True) is not None,
                                 reason=f"home-network testbed unavailable: {missing_requirements(nat=True)}")]

# Relayed rounds used to reset whenever the bootstrap's p2p daemon answered with libp2p's default relay (128 KiB
# per connection), a race inside the daemon seen in 3 of 10 relayed swarms; the bootstrap now checks its relay
# at start and restarts its daemon until the configured one answers (swarm/relay_check.py), and the relayed
# test below asserts that check passed. A late home peer could not catch up through the relay while donors of
# sub-second rounds withdrew their state between its manifest and its first chunk: donors now count a joiner
# holding a manifest as downloading, and save their serving budget (core.chunks.ServeWait), so the relayed
# test makes one peer late on purpose. The mixed swarm split into two pairs that drifted apart in 2 of 4 runs
# while every round after the 3rd waited out its whole matchmaking window (one key for all rounds, issue 32's
# defect); since rounds meet under their epoch's key it passed 3 of 3 here, every round in one group of 4. A late
# client then chased the swarm (its download lasted a round, and the round's update it needed was withdrawn as
# the next round began); donors now keep that update through the round after a joiner asked (StateServer.
# withdraw_update): the mixed test then passed 2 of 2 here, one under two busy loops, and in the other
# the late client applied the update it missed and averaged in every round after; the third run (a CI
# rehearsal) failed as its reason says. Clients were then found to be turned away by a leader that began its round
# a moment after them (JoinTiming.scheduled_time): the mixed test ran in CI again, until the failure its skip line
# names. A resynced peer has published its vote again since (StateServing.serve_loaded); the mixed test then passed
# 8 runs in a row (2 in one session, 6 in the next) and runs in CI again. The relayed test was opt-in for two
# sessions: 7 of its first 9 runs passed. Its failures had four causes, each fixed: a reducer's norm screen that
# banned an honest peer in a fold round (core.robust.screen_weights); a slow peer that learned of each finished
# round up to 2 s late (round_wait.poll_interval); a relay check that gave up at the first refusal and left the
# default relay in place (relay_check._start_daemon); and, probably behind the chase of its first failure, a
# round the garbage collector destroyed, after which that peer never searched again (AveragerProcess.run_command).
# With the last two fixed it runs in CI again. CI then failed it once more: the bootstrap lost the daemon's relay
# race at all 32 starts (the draw leans to libp2p's default relay on a machine whose daemon runs goroutines on
# several threads at once); the relay host's daemon now runs with one goroutine thread (relay_check.one_go_thread).

# FAST timings without its loopback address (the testbed gives each peer its own), rounds of 10 steps
assert FAST[0] == "--host-maddrs"
# ... and a matchmaking window of 8 s instead of 3: a home peer that misses a round (one that started a second
# after the others, whose first group formed early without it) needs about 5 s to learn it was left behind,
# apply the round it missed and train; with a 3 s window it arrived after each next group had formed, every
# round (seen in a CI rehearsal: the port-forwarded test's late peer, 6 rounds in a row). A group of everyone
# still forms as soon as all due peers joined, so the longer window costs nothing when nobody is late.
assert FAST[2] == "--matchmaking-time-s"
PEER_ARGS = [FAST[2], "8", *FAST[4:]]
ROUNDS = 6  # start-up skew may cost the first rounds their full group; three of six must be whole
RUN = ["--run-id", "nat", "--max-rounds", str(ROUNDS), "--eval-every", "0", "--target-group-size", "4"]
# bound on one swarm's life: start-up, ROUNDS rounds of at most swarm_procs.ROUND_BUDGET_S, shutdown
LIFE_S = 60 + ROUNDS * 70


def _rounds(out: Path, name: str) -> list[dict]:
    return read_records(out / f"{name}.jsonl", "round")


def _tail(out: Path, name: str) -> str:
    path = out / f"{name}.out"
    return path.read_text()[-3000:] if path.exists() else ""


def _assert_relay_checked(out: Path) -> None:
    """The bootstrap's relay check passed and it reported its p2p daemon starts: in the line before its join
    line, within its limit (``--relay-check-starts``, default here), and in one log line per start. With
    libp2p's default relay answering every relayed round resets, and nothing else a test asserts holds."""
    text = (out / "bootstrap.out").read_text()
    line = read_relay_line(text)
    assert line is not None and line.verdict == "passed", _tail(out, "bootstrap")
    assert 1 <= line.starts <= line.limit == BootstrapConfig().relay_check_starts, (line, _tail(out, "bootstrap"))
    logged = re.findall(rf"daemon start \d+ of at most {line.limit}: (\w+)", text)
    assert logged == ["reset"] * (line.starts - 1) + ["passed"], (line, logged)


def _together(peers: int) -> dict[int, dict[str, str]]:
    """Every peer's environment for a swarm started at once that must average from epoch 0 (start_together: a
    CI rehearsal without it saw a port-forwarded peer miss epochs 0-3, and an unreachable peer up first apply
    its first round alone)."""
    return {i: {"P2P_DILOCO_FAULTS": start_together(peers)} for i in range(1, peers + 1)}


def _run(bed: Testbed, out: Path, extra: dict[int, list[str]], relay: bool,
         peer_env: dict[int, dict[str, str]] | None = None) -> tuple[dict, dict[str, list[dict]]]:
    """``peer_env`` replaces the default, which starts every peer together (``_together``)."""
    procs = start_swarm(bed, out, 3, [*PEER_ARGS, *RUN], relay=relay, peer_extra=extra,
                        peer_env=_together(3) if peer_env is None else peer_env)
    codes = wait_peers(procs, LIFE_S)
    return codes, {name: _rounds(out, name) for name in procs if name != "bootstrap"}


def _payload_sent(rounds: dict[str, list[dict]]) -> int:
    """All-reduce bytes the peers sent, all rounds together, as they count them (payload only)."""
    return sum(r["bytes_sent"] for rows in rounds.values() for r in rows)


def _assert_averaged_together(codes: dict, rounds: dict[str, list[dict]], out: Path, at_least: int = 3) -> None:
    """Every peer exited 0, and in ``at_least`` epochs all three averaged in one group to the same parameters."""
    assert codes == {n: 0 for n in rounds}, {n: _tail(out, n) for n in rounds}
    by_epoch: dict[int, dict[str, dict]] = defaultdict(dict)
    for name, rows in rounds.items():
        for r in rows:
            if r["outcome"] in ("averaged", "folded_late"):
                by_epoch[r["new_epoch"]][name] = r
    together = [e for e, rows in by_epoch.items() if len(rows) == 3 and all(r["group_size"] == 3 for r in rows.values())]
    assert len(together) >= at_least, {n: [(r["outcome"], r["group_size"], r["reason"]) for r in rows]
                                       for n, rows in rounds.items()}
    for e in together:
        assert len({r["params_sha256"] for r in by_epoch[e].values()}) == 1, by_epoch[e]


def test_client_mode_home_peers_average_with_a_public_full_peer(tmp_path: Path) -> None:
    """Guide choice 1: two home peers in client mode, one public full peer that leads and reduces."""
    with Testbed(4, 20, homes=(2, 3), prefix=_prefix("nc")) as bed:
        codes, rounds = _run(bed, tmp_path, {2: ["--client-mode", "true"], 3: ["--client-mode", "true"]},
                             relay=True)
    _assert_relay_checked(tmp_path)
    # Three of six rounds in one group of 3, as in the other NAT tests, and more below. For seven CI rehearsals
    # this test asserted only one such round: the epochs with all three together fell 6, 6, 5, 6, 4, 3, 2, as a
    # present client was turned away by the public leader that started its round a moment after it (hivemind's
    # BAD_EXPIRATION_TIME; the client did not ask again until the leader's window ended, "Every due peer joined
    # after 8.03 s", or at all). Clients now ask with the end of their search (JoinTiming.scheduled_time): 6 of
    # 6 rounds together, every group formed 0.03-0.34 s after the last peer arrived.
    _assert_averaged_together(codes, rounds, tmp_path)
    for name in ("peer2", "peer3"):
        averaged = [r for r in rounds[name] if r["outcome"] in ("averaged", "folded_late") and r["group_size"] >= 2]
        assert len(averaged) >= 2, [(r["outcome"], r["group_size"], r["reason"]) for r in rounds[name]]
    holders: dict[int, set[str]] = defaultdict(set)
    for rows in rounds.values():
        for r in rows:
            if r["outcome"] in ("averaged", "folded_late", "resynced"):
                holders[r["new_epoch"]].add(r["params_sha256"])
    assert all(len(shas) == 1 for shas in holders.values()), dict(holders)


def test_relayed_home_peers_average_with_only_the_bootstrap_public(tmp_path: Path) -> None:
    """Guide choice 3: three home peers, nobody public but the bootstrap node, which relays. One of them is
    slow through its first round and misses it, so it must also catch up through the relay: download the
    others' state (donors of short relayed rounds) and then average with them."""
    relayed = ["--use-auto-relay", "true"]
    # peers 1 and 2 outlast the slow peer's catch-up; peer 3 stops after its rounds and they after theirs, a
    # bound and not a wait: each round of the three is logged by all three
    # the slow peer may plan fewer steps after a catch-up (DyLU's late start, core.dylu.late_start_steps) to arrive
    # with the others, as the default floor (--min-local-steps 5) allows; FAST pins it at H, and held at H it
    # started 8-10 s after the swarm each round, trained its 10 steps and arrived after the 8 s window (seen in a
    # run: 4 rounds in a row left behind, each catching up by the round's update through the relay)
    # The slow peer may also chase the swarm for a few rounds after its catch-up: seen in a flake-gate run, it
    # arrived 4 s into each of rounds 3-6 (an update fetched through the relay, 3 s, then 2 steps) just as the
    # others' group formed, resynced each time, and averaged with them from round 7 on; with 6 rounds it had
    # one round in the group of three left. So it runs 10 rounds (the others 36, to outlast it): the test asks
    # for 3 whole rounds among them, as before.
    extra = {1: [*relayed, "--max-rounds", "36"], 2: [*relayed, "--max-rounds", "36"],
             3: [*relayed, "--min-local-steps", "2", "--max-rounds", "10"]}
    with Testbed(4, 20, homes=(1, 2, 3), prefix=_prefix("nr")) as bed:
        codes, rounds = _run(bed, tmp_path, extra, relay=True,
                             peer_env={3: {"P2P_DILOCO_FAULTS": "slow_steps@0=1.5"}})
        relay_received, relay_sent = bed.link_bytes(0)
    # it downloaded the others' state through the relay: at start (it came up after they stepped on) or after
    # its slow first round (a first download may fail when its donors step on meanwhile)
    # the relay first: with libp2p's default one answering every relayed round resets, and nothing below holds
    _assert_relay_checked(tmp_path)
    slow = rounds["peer3"]
    starts = read_records(tmp_path / "peer3.jsonl", "start")
    assert (starts and starts[0]["how"].startswith("joined")) or any(r["outcome"] == "resynced" for r in slow), (
        [s["how"] for s in starts], {n: [(r["epoch"], r["outcome"], r["group_size"], (r["reason"] or "")[:160]) for r in rows]
                                     for n, rows in rounds.items()})
    _assert_averaged_together(codes, rounds, tmp_path)
    # Every all-reduce byte went through the bootstrap node: it received and sent at least what the peers sent.
    payload = _payload_sent(rounds)
    assert payload > 0 and min(relay_received, relay_sent) >= payload, (payload, relay_received, relay_sent)


def test_port_forwarded_home_peers_average_without_relays(tmp_path: Path) -> None:
    """Guide choice 2: two home peers forward a port (DNAT on their routers) and announce their public
    address; relays are off, so the homes reach each other through the forwarded ports only."""
    with Testbed(4, 20, homes=(2, 3), prefix=_prefix("nf")) as bed:
        extra = {}
        for i in (2, 3):
            port = 31340 + i
            bed.forward_port(i, port)
            extra[i] = ["--host-maddrs", f"/ip4/{bed.host_ip(i)}/tcp/{port}",
                        "--announce-maddrs", f"/ip4/{bed.ip(i)}/tcp/{port}"]
        codes, rounds = _run(bed, tmp_path, extra, relay=False)
        _, boot_sent = bed.link_bytes(0)
    _assert_averaged_together(codes, rounds, tmp_path)
    # direct: the bootstrap node carried no all-reduce (a small share of it at most: DHT traffic only)
    assert boot_sent < _payload_sent(rounds) / 10, (boot_sent, _payload_sent(rounds))


def test_a_swarm_nobody_can_dial_says_so_within_a_round(tmp_path: Path) -> None:
    """Three home peers, full, no forwarded port, no relay: no round can form. Each peer must say why in the
    round's log line, its JSON row and a warning that names the fix, from its first skipped round on."""
    run = [*RUN[:3], "2", *RUN[4:]]  # two rounds suffice to see it
    with Testbed(4, 20, homes=(1, 2, 3), prefix=_prefix("nu")) as bed:
        procs = start_swarm(bed, tmp_path, 3, [*PEER_ARGS, *run], relay=False, peer_env=_together(3))
        codes = wait_peers(procs, LIFE_S)
    for name in ("peer1", "peer2", "peer3"):
        assert codes[name] == 0, _tail(tmp_path, name)
        rows = _rounds(tmp_path, name)
        assert rows and all(r["outcome"] == "skipped" for r in rows), rows
        assert rows[0]["stall"] == "unreachable", rows[0]
        out = (tmp_path / f"{name}.out").read_text()
        assert "rounds will keep skipping" in out and "--announce-maddrs" in out and "--use-auto-relay" in out, out[-3000:]


def test_doctor_reachability_line_tells_each_home_setup_apart(tmp_path: Path) -> None:
    """The doctor's reachability line, run from a home: FAIL without a way in, ok through the bootstrap's
    relay, ok with a forwarded port announced, ok in client mode."""
    with Testbed(2, 20, homes=(1,), prefix=_prefix("nd")) as bed:
        procs = start_swarm(bed, tmp_path, 0, [], relay=True)
        maddr = announced((tmp_path / "bootstrap.out").read_text(), READY_LINE, MADDR)
        bed.forward_port(1, 31351)
        base = ["--initial-peers", maddr, "--run-id", "nat", "--model", "tiny", "--startup-timeout-s", "20",
                "--nat-port-map", "false", "--host-maddrs", f"/ip4/{bed.host_ip(1)}/tcp/31351"]
        cases = {
            "none": ([], "[FAIL] reachability: only private addresses"),
            "relay": (["--use-auto-relay", "true"], "[ok  ] reachability: reachable through a relay"),
            "forward": (["--announce-maddrs", f"/ip4/{bed.ip(1)}/tcp/31351"], "[ok  ] reachability: announces public"),
            "client": (["--client-mode", "true"], "[ok  ] reachability: client mode"),
        }
        seen = {}
        for case, (flags, _) in cases.items():
            proc = bed.popen(1, [sys.executable, "-m", "p2p_diloco.cli.run_peer", "doctor", *base, *flags],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            out, _ = proc.communicate(timeout=180)
            seen[case] = next((line for line in out.splitlines() if "reachability:" in line), out[-2000:])
        procs["bootstrap"].terminate()
    _assert_relay_checked(tmp_path)
    for case, (_, expected) in cases.items():
        assert seen[case].startswith(expected), (case, seen[case])


def test_a_mixed_swarm_public_forwarded_relayed_and_client(tmp_path: Path) -> None:
    """One public, one forwarded, one relayed and one client peer average together.

    The client's missed groups were found (``JoinTiming.scheduled_time``): a present client searched 12 s in
    every other round while the leader formed the group without it. Since that fix and the republished vote of a
    resynced peer, 8 runs in a row passed; in 7 of them every round was a group of all four."""
    with Testbed(5, 20, homes=(2, 3, 4), prefix=_prefix("nm")) as bed:
        bed.forward_port(2, 31342)
        extra = {2: ["--host-maddrs", f"/ip4/{bed.host_ip(2)}/tcp/31342", "--announce-maddrs",
                     f"/ip4/{bed.ip(2)}/tcp/31342"],
                 3: ["--use-auto-relay", "true"],
                 # a client may come late (it dials out through its router and downloads through others): let it
                 # plan fewer steps after a download (DyLU's late start, core.dylu.late_start_steps) to arrive with
                 # the others, as the default floor (--min-local-steps 5) allows; FAST pins it at H
                 4: ["--client-mode", "true", "--min-local-steps", "2"]}
        procs = start_swarm(bed, tmp_path, 4, [*PEER_ARGS, *RUN], relay=True, peer_extra=extra,
                            peer_env=_together(4))
        codes = wait_peers(procs, LIFE_S)
    members = ("peer1", "peer2", "peer3", "peer4")
    rounds = {n: _rounds(tmp_path, n) for n in members}
    assert codes == {n: 0 for n in members}, {n: _tail(tmp_path, n) for n in members}
    _assert_relay_checked(tmp_path)
    by_epoch: dict[int, dict[str, dict]] = defaultdict(dict)
    for name, rows in rounds.items():
        for r in rows:
            if r["outcome"] in ("averaged", "folded_late"):
                by_epoch[r["new_epoch"]][name] = r
    together = [e for e, rows in by_epoch.items()
                if len(rows) == 4 and len({r["params_sha256"] for r in rows.values()}) == 1]
    assert len(together) >= 3, {n: [(r["outcome"], r["group_size"], r["reason"]) for r in rows]
                                for n, rows in rounds.items()}
