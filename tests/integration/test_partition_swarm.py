"""A network partition on the namespace testbed: one of three run_peer processes loses its link for longer
than its progress records live, then comes back.

Each peer runs in its own network namespace (benchmarks/testbed.py); the partition is the peer's bridge port
set down while every process keeps running, as when a home router drops its connection. The fault is keyed
by (peer, epoch): it fires when peer 3 enters epoch 2. Checked, as for every fault: the partition fired (peer
3's rounds in the window were skipped, the others averaged without it); every peer that reached an epoch
through the swarm holds the same parameters; every round ended within its deadline. And no split brain: the
cut-off peer keeps its work instead of training on alone, so the two connected peers never have to give up
their state for it; back online, it downloads the swarm's state and folds the work of the partition in as
late work.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from swarm_procs import FAST, check_rounds, events, tail, wait_for

from benchmarks.testbed import Testbed, missing_requirements, start_swarm, wait_peers

pytestmark = [
    pytest.mark.long,
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(missing_requirements() is not None, reason=f"testbed unavailable: {missing_requirements()}"),
]

BATCH = 4  # swarm_procs.FAST's --batch-size: a round's own weight is BATCH x inner steps
PROGRESS_TTL_S = 15  # FAST's 30, halved: records are republished every round (about a second) and every 5 s
PARTITION_S = 20.0  # longer than PROGRESS_TTL_S: the others' records expire at peer 3


def _fast_without_host() -> list[str]:
    args = list(FAST)
    at = args.index("--host-maddrs")
    del args[at : at + 2]  # the testbed gives each peer its namespace's address
    return args


def test_partitioned_peer_keeps_its_work_and_rejoins_without_split_brain(tmp_path: Path) -> None:
    # The others keep averaging while peer 3 is cut off: since groups form as soon as every due peer joined,
    # a round takes about a second and they run some 15 rounds in the 20 s cut (about 5 when every round
    # waited out its window). Its work must still be young enough to fold, so the bound is the largest allowed.
    # --max-round-weight: a claim is capped at 4 x batch x H by default, and the partition's work (every
    # skipped round's) outweighs that when peer 3 skips more than 4 rounds; this test counts every sample.
    args = [*_fast_without_host(), "--run-id", "part", "--max-rounds", "200", "--max-staleness", "1000",
            "--max-round-weight", "100000", "--progress-ttl-s", str(PROGRESS_TTL_S)]
    with Testbed(4, 1000.0, prefix=f"pdp{os.getpid()}") as bed:
        procs = start_swarm(bed, tmp_path, 3, args)
        # ... and the others averaged in a group: a first peer that started alone steps to epoch 2 by itself,
        # and the late ones join at epoch 2 by download, so peer 3 can be there before peer 2 ran a round. Any
        # round record is not enough: a peer's first one may be its start-up download, and a peer still
        # catching up at the cut resyncs after it (seen with two test files at a time: peer 1 resynced 7 s
        # into the cut), which is start-up, not the split brain this test rules out
        wait_for(lambda: any(r["new_epoch"] >= 2 for r in events(tmp_path, "peer3", "round"))
                 and all(any(r["outcome"] == "averaged" and r["group_size"] >= 2
                             for r in events(tmp_path, n, "round")) for n in ("peer1", "peer2")), 240,
                 "peer3 at epoch 2, and the others averaging in a group")
        # The cut falls inside peer 3's inner phase, never inside a round: a round's record is written after the
        # round (and its evaluation), so a round that averaged just before the cut was recorded after it (seen
        # with two test files at a time: the group of 3 averaged 0.1 s before the cut, peer 3's record of it came
        # 0.1 s after, and it counted as a round of the partition). So the cut waits for peer 3's next record,
        # and one of the newest epoch anyone recorded: peer 3 then trains that epoch's 10 steps, and the cut
        # comes within one read (50 ms) of the record.
        recorded = len(events(tmp_path, "peer3", "round"))

        def peer3_just_began_the_newest_epoch() -> bool:
            rounds = {n: events(tmp_path, n, "round") for n in ("peer1", "peer2", "peer3")}
            newest = max(r["new_epoch"] for rows in rounds.values() for r in rows)
            return len(rounds["peer3"]) > recorded and rounds["peer3"][-1]["new_epoch"] == newest

        wait_for(peer3_just_began_the_newest_epoch, 120, "peer3 to record a round of the newest epoch", every=0.05)
        bed.set_link(3, up=False)
        cut = time.time()
        cut_epoch = {n: max(r["new_epoch"] for r in events(tmp_path, n, "round")) for n in ("peer1", "peer2")}
        peer3 = events(tmp_path, "peer3", "start")[0]["peer_id"]

        def cut_off_long_enough() -> bool:
            """At least PARTITION_S, until peer 3 ended a round cut off (its search gives up after
            --matchmaking-timeout-s, 15 s in FAST), and until each of the others averaged without it: on a
            loaded machine their first round after the cut can outlast PARTITION_S (it waits out the window
            for peer 3, whose records are still alive), and healing before it ended left nothing to check."""
            return (time.time() - cut >= PARTITION_S
                    and any(r["time"] > cut for r in events(tmp_path, "peer3", "round"))
                    and all(any(r["time"] > cut and r["outcome"] == "averaged" and peer3 not in r["contributors"]
                                for r in events(tmp_path, n, "round")) for n in ("peer1", "peer2")))

        wait_for(cut_off_long_enough, PARTITION_S + 150, "the partition to last, and the others to average without peer 3")
        bed.set_link(3, up=True)
        healed = time.time()

        def rejoined() -> bool:
            rows = [r for r in events(tmp_path, "peer3", "round") if r["time"] > healed]
            return any(r["outcome"] == "folded_late" for r in rows) and rows[-1]["outcome"] == "averaged"

        wait_for(rejoined, 180, "peer3 to fold its partition work in and average again")
        for proc in procs.values():
            proc.terminate()
        codes = wait_peers(procs, 60)
    assert codes == {"peer1": 0, "peer2": 0, "peer3": 0}, {n: tail(tmp_path, n) for n in codes}

    names = ("peer1", "peer2", "peer3")
    ids = {n: events(tmp_path, n, "start")[0]["peer_id"] for n in names}
    rounds = {n: events(tmp_path, n, "round") for n in names}
    during = {n: [r for r in rows if cut < r["time"] <= healed] for n, rows in rounds.items()}

    # 1. the partition fired: peer 3 could not average, and the others went on without it
    assert during["peer3"] and all(r["outcome"] == "skipped" for r in during["peer3"]), during["peer3"]
    for name in ("peer1", "peer2"):
        alone = [r for r in during[name] if r["outcome"] == "averaged" and ids["peer3"] not in r["contributors"]]
        assert alone, (name, during[name])
        assert max(r["new_epoch"] for r in rounds[name]) > cut_epoch[name] + 1

    # no split brain: peer 3 never stepped alone while cut off, so the connected majority never had to
    # download anybody's state; peer 3 did, and folded the partition's work in late
    # (before the cut a peer up first may step alone, "no other peer visible": seen in a CI rehearsal, peer 3 at
    # epoch 0 a second before peer 1 joined by download; that is start-up, not a split)
    assert not any(r["outcome"] == "averaged" and r["group_size"] == 1 and r["time"] > cut
                   for r in rounds["peer3"]), rounds["peer3"]
    assert not any(r["outcome"] == "resynced" and r["time"] > cut for n in ("peer1", "peer2") for r in rounds[n])
    after = [r for r in rounds["peer3"] if r["time"] > healed]
    assert after[0]["outcome"] in ("resynced", "skipped"), after[0]
    folded = next(r for r in after if r["outcome"] == "folded_late")
    assert max(folded["staleness"]) >= 2, folded
    # ... with all of the partition's samples: each skipped round carried its weight into the next and each
    # resynchronisation kept its round's work, so the late work folded in weighs every step peer 3 trained
    # since its last round that applied its work (averaged or folded), which came before the cut. That round
    # may lie well before the cut: in a CI run peer 3 joined at epoch 2 by download (resynced, keeping that
    # round's 10 steps as late work) and was cut off at once, so 30 steps went in where the cut's rows held 20.
    before_fold = [r for r in rounds["peer3"] if r["time"] < folded["time"]]
    spent = [i for i, r in enumerate(before_fold) if r["outcome"] in ("averaged", "folded_late")]
    unspent = before_fold[spent[-1] + 1 :] if spent else before_fold
    assert not spent or before_fold[spent[-1]]["time"] <= cut, before_fold[spent[-1]]
    steps = sum(r["inner_steps"] for r in unspent)
    late_weight = folded["weights"][folded["contributors"].index(ids["peer3"])] - BATCH * folded["inner_steps"]
    assert late_weight == pytest.approx(BATCH * steps), (late_weight, steps, folded)

    # 2. identical parameters wherever an epoch was reached through the swarm; 3. every round ended,
    # averaged or cleanly skipped, within its deadline
    check_rounds(rounds)
