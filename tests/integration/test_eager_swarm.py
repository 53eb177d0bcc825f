"""Eager overlap between real run_peer processes: peers differ exactly by the eager rule's own term.

With plain SGD as the outer optimizer (momentum 0) the eager rule telescopes: after rounds that all applied a
complete average, ``Q_m = θ_m + lr * s * Δ_m(last)`` (anchors plus the stored own term, s the own share) moves
by the same ``-lr * Σ Δ(t-1)`` on every peer, because the averages are bitwise identical. So the difference
``Q_a - Q_b`` is the same before and after such rounds, while the parameters themselves differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from swarm_procs import events, start_bootstrap, start_peer, start_together, tail, wait_all

pytestmark = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(420)]

OUTER_LR = 0.7
ROUNDS = 4
EAGER = ["--run-id", "eager1", "--overlap", "eager", "--outer-momentum", "0", "--outer-lr", str(OUTER_LR),
         "--max-rounds", str(ROUNDS), "--local-steps", "40", "--min-local-steps", "40", "--eval-every", "0",
         "--keep-checkpoints", "10"]


def _state(ckpt: Path, epoch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    path = ckpt / f"ckpt-{epoch:08d}" / "state.safetensors"
    if not path.exists():
        return None
    tensors = load_file(str(path))
    count = sum(k.startswith("param.") for k in tensors)
    own = [tensors[f"eager.prev_own.{i}"] for i in range(count)] if "eager.prev_own.0" in tensors else None
    return [tensors[f"param.{i}"] for i in range(count)], own


def _q(theta: list[torch.Tensor], own: list[torch.Tensor], share: float) -> torch.Tensor:
    return torch.cat([(t + OUTER_LR * share * o).reshape(-1) for t, o in zip(theta, own, strict=True)])


def test_eager_peers_differ_exactly_by_the_own_term(tmp_path: Path) -> None:
    boot, maddr = start_bootstrap(tmp_path)
    try:
        # a and b from epoch 0 together (start_together): in a run with two tests at a time b came up 2 s
        # before a, applied epoch 0 alone ("no other peer visible"), a downloaded epoch 2, and their launches
        # never met again (every round own_only)
        procs = {name: start_peer(tmp_path, name, maddr, *EAGER, "--checkpoint-dir", str(tmp_path / f"ck-{name}"),
                                  "--checkpoint-every", "1", faults=start_together(2))
                 for name in "ab"}
        codes = wait_all(procs, 360)
    finally:
        boot.terminate()
    assert codes == {"a": 0, "b": 0}, {n: tail(tmp_path, n) for n in codes}
    rounds = {n: {r["epoch"]: r for r in events(tmp_path, n, "round")} for n in "ab"}

    # The background all-reduce really ran and was applied, with nobody pushed into a resync by the
    # legitimate difference between eager peers.
    for name in "ab":
        outcomes = [r["outcome"] for r in rounds[name].values()]
        assert "resynced" not in outcomes and "skipped" not in outcomes, outcomes
        averaged = [r for r in rounds[name].values() if r["outcome"] == "averaged"]
        # One is enough for the identity below. More are not guaranteed: when hivemind's matchmaking lets a
        # follower give up while its leader counts it in, that background all-reduce runs to its timeouts
        # and, with the one-round cap, the next rounds step with the own term only (seen once in 2 cores).
        assert len(averaged) >= 1, (outcomes, [r["reason"] for r in rounds[name].values()], tail(tmp_path, name))
        assert all(r["group_size"] == 2 and r["bytes_sent"] > 0 for r in averaged)

    # Every stretch of rounds averaged on both peers preserves Q_a - Q_b (see the module docstring).
    both = sorted(e for e in rounds["a"] if e in rounds["b"]
                  and rounds["a"][e]["outcome"] == rounds["b"][e]["outcome"] == "averaged")
    weights = {tuple(rounds[n][e]["weights"]) for n in "ab" for e in both}
    assert len(weights) <= 1, f"the identity needs the same weights in every averaged round: {weights}"
    checked = 0
    for end in range(2, ROUNDS + 1):
        start = end
        while start - 1 in both:
            start -= 1
        states = {(n, e): _state(tmp_path / f"ck-{n}", e) for n in "ab" for e in (start, end)}
        if start == end or any(s is None or s[1] is None for s in states.values()):
            continue
        (w,) = weights
        share = w[0] / sum(w)
        q = {k: _q(theta, own, share) for k, (theta, own) in states.items()}
        before, after = q["a", start] - q["b", start], q["a", end] - q["b", end]
        torch.testing.assert_close(after, before, rtol=0, atol=2e-5)
        theta_a, theta_b = (torch.cat([t.reshape(-1) for t in states[n, end][0]]) for n in "ab")
        assert not torch.equal(theta_a, theta_b), "eager peers should differ by their own terms"
        checked += 1
    assert checked >= 1, (sorted(both), {n: [r["outcome"] for r in rounds[n].values()] for n in "ab"})
