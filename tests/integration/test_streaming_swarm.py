"""Streaming DiLoCo in a real swarm: run_peer processes with --fragments 2 on loopback, each fragment round a
round of its own (its records, its all-reduce, its checksum), and a joiner that arrives between two fragment
rounds and catches up fragment by fragment."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from swarm_procs import SYNCED, events, start_bootstrap, start_peer, start_together, tail, wait_all, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]

FRAGMENTS = ("--fragments", "2")
"""tiny has 4 layers: 0 and 2 in fragment 0, 1 and 3 in fragment 1 (the embeddings and final norm go to the
lighter one). With FAST's --local-steps 10, fragment 1 syncs at steps 5, 15, 25...; fragment 0 at 10, 20, 30..."""


def _identical_per_fragment(rounds: dict[str, list[dict]]) -> dict[tuple[int, int], set[str]]:
    """(fragment, new epoch) -> the fragment's anchors' digests every peer reported reaching it through the swarm;
    each must hold one digest."""
    seen: dict[tuple[int, int], set[str]] = defaultdict(set)
    for rows in rounds.values():
        for r in rows:
            if r["outcome"] in SYNCED:
                seen[(r["fragment"], r["new_epoch"])].add(r["params_sha256"])
    assert all(len(shas) == 1 for shas in seen.values()), seen
    return seen


def _at_least_4_rounds_of_all_three(rounds: dict[str, list[dict]]) -> None:
    """a, b and c averaged together, in a group of three, in at least 4 fragment rounds."""
    together = defaultdict(set)
    for name in "abc":
        for r in rounds[name]:
            if r["outcome"] == "averaged" and r["group_size"] == 3:
                together[(r["fragment"], r["new_epoch"])].add(name)
    assert sum(members == set("abc") for members in together.values()) >= 4, together


@pytest.mark.timeout(480)
def test_three_peers_average_fragments_in_turn_and_a_joiner_catches_up_per_fragment(tmp_path: Path) -> None:
    boot, maddr = start_bootstrap(tmp_path)
    procs: dict = {}
    try:
        # a, b, c from fragment epoch 0 together (start_together: the first peer up must not apply rounds alone)
        args = ("--run-id", "stream", *FRAGMENTS)
        procs = {name: start_peer(tmp_path, name, maddr, *args, "--max-rounds", "200", faults=start_together(3))
                 for name in "abc"}

        def full_rounds(name: str) -> list[dict]:
            return [r for r in events(tmp_path, name, "round") if r["outcome"] == "averaged" and r["group_size"] == 3]

        # at least 4 fragment rounds of all three, each fragment at least twice
        wait_for(lambda: len({(r["fragment"], r["new_epoch"]) for r in full_rounds("a")}) >= 4
                 and {r["fragment"] for r in full_rounds("a")} == {0, 1}, 240, "4 fragment rounds of all three")
        # the joiner arrives with the swarm between two fragment rounds (rounds of both fragments done)
        procs["d"] = start_peer(tmp_path, "d", maddr, *args, "--max-rounds", "4")
        wait_for(lambda: procs["d"].poll() is not None, 240, "the joiner's 4 fragment rounds")
        for name in "abc":
            procs[name].terminate()
        codes = wait_all(procs, 60)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        boot.terminate()
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, {n: tail(tmp_path, n) for n in procs}

    rounds = {n: events(tmp_path, n, "round") for n in procs}
    # every fragment round's report names its fragment, and rounds alternate between the two
    for name in "abc":
        fragments = [r["fragment"] for r in rounds[name]]
        assert set(fragments) == {0, 1}, (name, fragments)
        assert all(x != y for x, y in zip(fragments, fragments[1:], strict=False)), (name, fragments)
    # identical parameters per fragment wherever a fragment epoch was reached through the swarm
    seen = _identical_per_fragment(rounds)
    _at_least_4_rounds_of_all_three(rounds)

    # the joiner downloaded each fragment's state (a fragment at a time), then averaged with the others and
    # reached the very digests they reached
    start = events(tmp_path, "d", "start")[0]
    assert start["how"].startswith("joined"), start
    joined = [r for r in rounds["d"] if r["outcome"] in SYNCED and r["group_size"] >= 2]
    assert joined, rounds["d"]
    for r in joined:
        others = {row["params_sha256"] for n in "abc" for row in rounds[n]
                  if row["outcome"] in SYNCED and (row["fragment"], row["new_epoch"]) == (r["fragment"], r["new_epoch"])}
        assert others == {r["params_sha256"]}, (r, others, seen)


@pytest.mark.timeout(420)
def test_with_a_fragment_delay_the_allreduce_overlaps_training_and_every_fragment_stays_identical(
        tmp_path: Path) -> None:
    """--fragment-delay 2: each fragment's round is opened at its sync step, its all-reduce runs on a thread of
    its own while the next 2 steps train, and it lands at the merge step (peer.streaming_session)."""
    boot, maddr = start_bootstrap(tmp_path)
    procs: dict = {}
    try:
        args = ("--run-id", "overlap", *FRAGMENTS, "--fragment-delay", "2", "--fragment-alpha", "0.5")
        procs = {name: start_peer(tmp_path, name, maddr, *args, "--max-rounds", "8", faults=start_together(3))
                 for name in "abc"}
        codes = wait_all(procs, 360)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        boot.terminate()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: tail(tmp_path, n) for n in procs}
    rounds = {n: events(tmp_path, n, "round") for n in procs}
    for name in "abc":
        fragments = [r["fragment"] for r in rounds[name]]
        assert len(fragments) == 8 and set(fragments) == {0, 1}, (name, fragments)
        assert all(x != y for x, y in zip(fragments, fragments[1:], strict=False)), (name, fragments)
        # a phase ends at a merge step: the first is fragment 1's, 5 steps to its sync plus the 2 overlapped
        assert rounds[name][0]["inner_steps"] == 7 and all(r["inner_steps"] == 5 for r in rounds[name][1:]), (
            name, [r["inner_steps"] for r in rounds[name]])
    # identical parameters per fragment wherever a fragment epoch was reached through the swarm, in at least 4
    # fragment rounds of all three
    _identical_per_fragment(rounds)
    _at_least_4_rounds_of_all_three(rounds)
