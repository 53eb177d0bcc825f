"""run_peer and run_bootstrap as real processes on loopback: rounds, late work, joining, kill and resume."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from swarm_procs import (
    SYNCED,
    assert_loss_fell,
    events,
    start_bootstrap,
    start_peer,
    start_together,
    tail,
    wait_all,
    wait_for,
)

pytestmark = pytest.mark.slow


def _sha_by_epoch(tmp: Path, names: list[str]) -> dict[int, set[str]]:
    """Every checksum each peer reported for each epoch it reached through the swarm."""
    by_epoch: dict[int, set[str]] = defaultdict(set)
    for name in names:
        for r in events(tmp, name, "round"):
            if r["outcome"] in SYNCED:
                by_epoch[r["new_epoch"]].add(r["params_sha256"])
        for r in events(tmp, name, "start"):
            if r["how"].startswith("joined"):
                by_epoch[r["epoch"]].add(r["params_sha256"])
    return by_epoch


def _holders_by_epoch(tmp: Path, names: list[str]) -> dict[int, dict[str, set[str]]]:
    """For each epoch reached through the swarm: each checksum reported for it, and who reported it."""
    by_epoch: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name in names:
        for r in events(tmp, name, "round"):
            if r["outcome"] in SYNCED:
                by_epoch[r["new_epoch"]][r["params_sha256"]].add(name)
        for r in events(tmp, name, "start"):
            if r["how"].startswith("joined"):
                by_epoch[r["epoch"]][r["params_sha256"]].add(name)
    return by_epoch


ROUNDS_AFTER_SPLIT = 3
"""Rounds within which a round that split in two groups must be closed: everybody on one digest again."""


def test_three_peers_train_fold_late_work_and_admit_a_joiner(tmp_path: Path) -> None:
    boot, maddr = start_bootstrap(tmp_path)
    # a, b and c train until stopped, so the joiner d always finds a live swarm however slow the host is. Late work
    # of any age folds (--max-staleness 1000): a and b average a round every 1-2 s while c trains its slowed epoch
    # (about 8 s) and resyncs; at the default 4 rounds, c's work went stale when they fitted 5 rounds in (a CI run
    # waited 180 s for a fold that had been dropped; one here folded it at staleness 3).
    procs: dict = {}
    args = ("--run-id", "t1", "--max-rounds", "60", "--max-staleness", "1000")
    try:
        procs |= {
            # a, b and c from epoch 0 together (start_together): in a CI rehearsal a came up first, stepped epochs
            # 0 and 1 alone ("no other peer visible"), b and c joined at epoch 2 by download, so c's slow epoch 1
            # never came and no late work was ever folded
            "a": start_peer(tmp_path, "a", maddr, *args, faults=start_together(3)),
            "b": start_peer(tmp_path, "b", maddr, *args, faults=start_together(3)),
            # c is slowed during epoch 1 so it misses that round and must fold its work into a later one. After
            # its state download it starts late, and plans fewer steps to arrive with the others (DyLU's late
            # start, ``core.dylu.late_start_steps``): held at H it would arrive after their window closed every
            # round, chasing the swarm until its late work grew older than --max-staleness.
            "c": start_peer(tmp_path, "c", maddr, *args, "--min-local-steps", "2",
                            faults=f"{start_together(3)},slow_steps@1=0.8"),
        }
        wait_for(lambda: any(r["new_epoch"] >= 2 for r in events(tmp_path, "a", "round")), 300, "epoch 2 at a")
        # d trains until stopped too: a round it joins may split in two groups, and the checksum vote repairs
        # that in the rounds after (checked below); a d that stopped after 2 rounds could not be repaired
        procs["d"] = start_peer(tmp_path, "d", maddr, *args)
        wait_for(lambda: len(events(tmp_path, "d", "round")) >= ROUNDS_AFTER_SPLIT + 2, 300, "d's rounds")
        # Stop only once the fold is in the logs of c and of a peer that took c's late work into its round: a
        # round's record is written when the round ends, on each peer at its own time.
        wait_for(lambda: any(r["outcome"] == "folded_late" for r in events(tmp_path, "c", "round"))
                 and any(r["late_folded"] >= 1 for n in "ab" for r in events(tmp_path, n, "round")), 180,
                 "c's late work folded, in c's log and a's or b's")
        for proc in procs.values():
            proc.terminate()
        codes = wait_all(procs, 120)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        boot.terminate()
    assert codes == {"a": 0, "b": 0, "c": 0, "d": 0}, {n: tail(tmp_path, n) for n in codes}

    rounds = {n: events(tmp_path, n, "round") for n in procs}
    required = {"event", "epoch", "peer_id", "outcome", "group_size", "contributors", "weights", "staleness",
                "inner_steps", "inner_seconds", "allreduce_seconds", "wait_seconds", "bytes_sent",
                "bytes_received", "train_loss", "eval_loss", "params_sha256"}
    assert all(required <= set(r) for rs in rounds.values() for r in rs)
    assert sum(r["outcome"] == "averaged" and r["group_size"] >= 2 for r in rounds["a"]) >= 3

    # Every peer that reached an epoch through the swarm holds the very same parameters, unless a round split into
    # two groups (matchmaking is no global agreement). A split must close within ROUNDS_AFTER_SPLIT rounds: one of
    # the next epochs is held by everybody with one digest. How it closes is the product's choice: the checksum
    # vote (``core.evidence.outvoted``) sends one side to resync, or one side steps on first and the other finds
    # itself behind and loads its state. Seen in CI rehearsals, each time in the round joiner d first joined:
    # {a, c} and {b, d} (b resynced the round after); {a, b} and {c, d}, whose next round averaged the four on two
    # bases before c resynced; {a, b} and {c, d} again, whose next round c and d averaged while a and b, behind,
    # loaded their state. The splits themselves are open in issue 37's note.
    holders_by_epoch = _holders_by_epoch(tmp_path, list(procs))
    last = max(holders_by_epoch)
    for epoch, holders in sorted(holders_by_epoch.items()):
        if len(holders) == 1 or epoch + ROUNDS_AFTER_SPLIT > last:
            continue  # one digest, or too near the end to see the split close
        members = set().union(*holders.values())
        closed = [e for e in range(epoch + 1, epoch + ROUNDS_AFTER_SPLIT + 1)
                  if len(holders_by_epoch.get(e, {})) == 1 and members <= set().union(*holders_by_epoch[e].values())]
        assert closed, (epoch, {e: dict(holders_by_epoch.get(e, {}))
                                for e in range(epoch, epoch + ROUNDS_AFTER_SPLIT + 1)})

    # Loss falls on every original peer.
    assert_loss_fell(tmp_path, ["a", "b", "c"], by=1.0)

    # c missed a round, resynchronised, and its late work was folded in later with staleness recorded. The round it
    # misses is epoch 1 (slowed), or epoch 0 when a loaded host starts it after a and b formed their first group: then
    # it resyncs past epoch 1 and the slowdown never fires (seen once in a CI rehearsal: c's first round moved no
    # bytes, its second folded its late work).
    folded = [r for r in rounds["c"] if r["outcome"] == "folded_late"]
    assert folded and any(s >= 1 for s in folded[0]["staleness"]), rounds["c"]
    assert any(r["outcome"] == "resynced" and r["epoch"] < folded[0]["epoch"] for r in rounds["c"]), rounds["c"]
    assert any(r["late_folded"] >= 1 and r["outcome"] == "averaged" for n in "ab" for r in rounds[n])

    # d joined mid-run: it downloaded the swarm's state (checked by the epoch checksums above) before it averaged,
    # at start, or (a start-up download cut off by the donors' serving budget, ``core.chunks.ServeWait``, as
    # once in a loaded CI run) by resyncing at the end of its first round, never averaging from its own state.
    start = events(tmp_path, "d", "start")[0]
    if not start["how"].startswith("joined at epoch"):
        first = rounds["d"][0] if rounds["d"] else {}
        assert first.get("outcome") == "resynced" and first.get("new_epoch", 0) >= 2, (start, first, tail(tmp_path, "d"))
    else:
        assert start["epoch"] >= 2, start


@pytest.mark.long
def test_kill_during_allreduce_then_resume(tmp_path: Path) -> None:
    boot, maddr = start_bootstrap(tmp_path)
    ckpt = tmp_path / "ckpt-b"
    # a and c run 6 rounds: the one b dies in, and one more that a round with the restarted b may cost. Seen in
    # a CI rehearsal: the leader of epoch 3 counted the restarted b in, while b's search never got the group and
    # ended at its own deadline ("no group formed"); a and c waited out their all-reduce deadline (20 s, skipped,
    # nothing applied) and, at 5 rounds, stopped at epoch 3. Open in issue 37's note.
    try:
        # all three from epoch 0 (start_together): b must have checkpointed rounds to resume from (a CI run
        # without it: c, up first, applied epochs 0 and 1 alone, and b joined at epoch 2 and died in its first)
        procs = {
            "a": start_peer(tmp_path, "a", maddr, "--run-id", "t2", "--max-rounds", "6", faults=start_together(3)),
            "b": start_peer(tmp_path, "b", maddr, "--run-id", "t2", "--max-rounds", "5",
                            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                            faults=f"{start_together(3)},kill_during_allreduce@2"),
            "c": start_peer(tmp_path, "c", maddr, "--run-id", "t2", "--max-rounds", "6", faults=start_together(3)),
        }
        procs["b"].wait(timeout=240)
        assert procs["b"].returncode == -9, tail(tmp_path, "b")
        fault = events(tmp_path, "b", "fault")
        assert [(f["action"], f["epoch"]) for f in fault] == [("kill_during_allreduce", 2)]
        before = events(tmp_path, "b", "round")
        procs["b"] = start_peer(tmp_path, "b", maddr, "--run-id", "t2", "--max-rounds", "2",
                                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--resume")
        codes = wait_all(procs, 300)
    finally:
        boot.terminate()
    assert codes == {"a": 0, "b": 0, "c": 0}, {n: tail(tmp_path, n) for n in codes}

    # No survivor applied the all-reduce that b died in as if it were complete.
    for name in "ac":
        for r in events(tmp_path, name, "round"):
            b_id = events(tmp_path, "b", "start")[0]["peer_id"]
            if r["epoch"] == 2 and b_id in r["contributors"]:
                assert r["outcome"] == "skipped", r
    # The survivors kept training together with identical parameters.
    for epoch, shas in _sha_by_epoch(tmp_path, ["a", "b", "c"]).items():
        assert len(shas) == 1, f"epoch {epoch}: {len(shas)} different parameter checksums"
    # The swarm went on past the kill. Not necessarily every survivor: members see a failed all-reduce end at
    # different times (one gives up on a silent reducer after 2 * next_chunk_timeout_s, another only at
    # allreduce_timeout_s), and a survivor back after the others ran out of --max-rounds finds no donor left.
    assert max(r["new_epoch"] for n in "ac" for r in events(tmp_path, n, "round")) >= 4

    # b restarted from its newest checkpoint (written after its last completed round), then caught up.
    last_epoch_before_kill = max(r["new_epoch"] for r in before)
    restart = events(tmp_path, "b", "start")[1]
    assert restart["epoch"] >= last_epoch_before_kill
    assert "resumed at epoch" in restart["how"] or restart["how"].startswith("joined")


@pytest.mark.long
def test_peer_bootstraps_from_a_plain_hivemind_dht_node(tmp_path: Path) -> None:
    out = open(tmp_path / "dht.out", "w")
    dht = subprocess.Popen([str(Path(sys.executable).parent / "hivemind-dht"), "--host_maddrs",
                            "/ip4/127.0.0.1/tcp/0", "--identity_path", str(tmp_path / "dht.id")],
                           stdout=out, stderr=subprocess.STDOUT)
    try:
        from swarm_procs import wait_for_maddr

        maddr = wait_for_maddr(tmp_path / "dht.out", dht, ready=None)
        peer = start_peer(tmp_path, "solo", maddr, "--run-id", "t3", "--max-rounds", "1")
        code = wait_all({"solo": peer}, 180)["solo"]
    finally:
        dht.terminate()
    assert code == 0, tail(tmp_path, "solo")
    (r,) = events(tmp_path, "solo", "round")
    assert r["outcome"] == "averaged" and r["group_size"] == 1 and r["new_epoch"] == 1


@pytest.mark.long
def test_peer_of_another_model_is_refused(tmp_path: Path) -> None:
    boot, maddr = start_bootstrap(tmp_path)
    try:
        a = start_peer(tmp_path, "a", maddr, "--run-id", "t4", "--max-rounds", "20")
        wait_for(lambda: events(tmp_path, "a", "start"), 120, "a's start")
        # The refusal needs evidence: a record from a peer b trusts (an untrusted one only warns, see
        # peer.admission.refuse_other_models; any free identity could publish one).
        trusted = tmp_path / "trusted.txt"
        trusted.write_text(events(tmp_path, "a", "start")[0]["peer_id"] + "\n")
        b = start_peer(tmp_path, "b", maddr, "--run-id", "t4", "--max-rounds", "1", "--model", "small",
                       "--trusted-peers", str(trusted))
        code_b = wait_all({"b": b}, 120)["b"]
    finally:
        a.terminate()
        boot.terminate()
    assert code_b == 1
    err = tail(tmp_path, "b")
    assert "refused: the 1 peer(s) of run 't4' train a model with fingerprint" in err
    assert not events(tmp_path, "b", "round")
