"""A node of 2 gloo ranks (torchrun) is one peer of a real swarm: it averages with a single-process peer with
identical parameters on all three processes; killing one rank ends the node cleanly; --resume rejoins."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from swarm_procs import FAST, SYNCED, env, events, tail, wait_all, wait_for, wait_for_maddr

NODE = ["--device", "cpu", "--node-timeout-s", "100", "--local-steps", "5", "--min-local-steps", "5",
        "--eval-every", "0"]
pytestmark = [pytest.mark.slow, pytest.mark.long]

RANK1 = re.compile(r"node rank 1: epoch (\d+) -> (\d+): (\w+), params sha256 ([0-9a-f]{64})")


def _start_node(tmp: Path, maddr: str, *extra: str) -> subprocess.Popen:
    out = open(tmp / "node.out", "a")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "p2p_diloco.cli.run_peer", *FAST, *NODE, "--initial-peers", maddr,
            "--log-file", str(tmp / "node.jsonl"), "--checkpoint-dir", str(tmp / "ck"), "--checkpoint-every", "1", *extra]
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env())


def _together(tmp: Path, since: int = 0) -> dict[int, str]:
    """Epochs the node reached in a group with the single peer, by the digest rank 0 logged, where the single
    peer and rank 1 reached the same epoch with the same digest."""
    solo = {r["new_epoch"]: r["params_sha256"] for r in events(tmp, "solo", "round") if r["outcome"] in SYNCED}
    rank1 = {int(m[1]): m[3] for m in RANK1.findall((tmp / "node.out").read_text()) if m[2] in SYNCED}
    out = {}
    for r in events(tmp, "node", "round")[since:]:
        if r["outcome"] in SYNCED and r["group_size"] == 2:
            e = r["new_epoch"]
            assert solo.get(e, r["params_sha256"]) == r["params_sha256"], (e, solo.get(e), r)
            assert rank1.get(e, r["params_sha256"]) == r["params_sha256"], (e, rank1.get(e), r)
            if e in solo and e in rank1:
                out[e] = r["params_sha256"]
    return out


def test_node_of_two_ranks_averages_with_a_peer_dies_cleanly_and_resumes(tmp_path: Path) -> None:
    # The single peer waits before its epoch 1 until it sees the node's record (start_together@1=2), rather than
    # racing ahead alone on the CPU the node needs to start; the node then downloads its state and they average.
    # A fixed slowdown (3 s per step of epoch 1, 15 s) was outrun: torchrun's two ranks took 34 s to come up
    # with two test files at a time, the single peer had stepped on alone to epoch 30 and changed its state
    # every 0.5 s, the node's download failed, and the node ignored its untrusted epoch claim for 60 s.
    solo = subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli.run_peer", *FAST, "--local-steps", "5",
                             "--min-local-steps", "5", "--eval-every", "0", "--log-file", str(tmp_path / "solo.jsonl")],
                            stdout=open(tmp_path / "solo.out", "w"), stderr=subprocess.STDOUT,
                            env=env(P2P_DILOCO_FAULTS="start_together@1=2"))
    maddr = wait_for_maddr(tmp_path / "solo.out", solo, ready=None)
    node = _start_node(tmp_path, maddr, "--max-rounds", "50")
    try:
        wait_for(lambda: len(_together(tmp_path)) >= 3, 90,
                 lambda: "3 rounds of the node with the single peer\n" + tail(tmp_path, "node") + tail(tmp_path, "solo"))
        # rank 0 downloaded the swarm's state once and broadcast it: rank 1 started from it too
        assert events(tmp_path, "node", "start")[0]["how"].startswith("joined at epoch"), tail(tmp_path, "node")

        # One rank dies: torchrun stops the other; the peer leaves the swarm; no process is left.
        workers = psutil.Process(node.pid).children()
        tree = [p for w in workers for p in (w, *w.children(recursive=True))]
        rank1 = next(w for w in workers if w.environ().get("RANK") == "1")
        rank1.send_signal(signal.SIGKILL)
        assert node.wait(timeout=60) != 0
        _, alive = psutil.wait_procs(tree, timeout=15)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
        text = (tmp_path / "node.out").read_text()
        assert "node rank 0: stopping" in text or "run_peer: error: node rank 0:" in text, text[-3000:]
        assert (tmp_path / "ck").is_dir() and any((tmp_path / "ck").iterdir())

        # --resume: rank 0 loads the checkpoint, the node downloads the swarm's state if behind, and averages.
        before = len(events(tmp_path, "node", "round"))
        seen = set(_together(tmp_path))
        node = _start_node(tmp_path, maddr, "--max-rounds", "2", "--resume")
        assert wait_all({"node": node}, 120)["node"] == 0, tail(tmp_path, "node")
        starts = events(tmp_path, "node", "start")
        assert len(starts) == 2 and re.match(r"(resumed|joined) at epoch", starts[1]["how"]), starts[1]["how"]
        again = set(_together(tmp_path, since=before)) - seen
        assert again, "after --resume the node never averaged with the single peer\n" + tail(tmp_path, "node")
    finally:
        for proc in (node, solo):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        wait_all({"node": node, "solo": solo}, 30)
