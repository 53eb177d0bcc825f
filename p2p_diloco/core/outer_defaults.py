"""Outer learning rate and momentum chosen from H and the expected number of peers, when the user sets neither.

The paper's outer settings (lr 0.7, Nesterov momentum 0.9) were tuned at H = 500, k = 8 over hundreds of
rounds. A run at small H is a different regime, and a fixed default that ignores H loses there: at H = 20
with 3 peers on loopback, the peer at 0.7 / 0.9 ended at eval loss 2.19 after 150 s where lr 1 without
momentum ended at 2.01 (issue 32); in the simulator at k = 4, H = 20, 10 rounds, 0.7 / 0.9 ended 9.8% above
lr 1 without momentum (BENCHMARKS.md, "Outer settings sweeps", 3 seeds).

**The rule** (:func:`choose_outer`):

- **H below** :data:`SMALL_H` **(100): momentum 0, lr 1; lr 0.7 with eager overlap.** Measured on the tiny
  preset, 200 inner steps per worker, 3 seeds (BENCHMARKS.md, "Outer settings sweeps"): the best outer
  lr without momentum was 1 at H = 5 (40 rounds), 20 (10 rounds) and 50 (4 rounds), and at k = 2, 4 and 8
  (H = 20); momentum 0.6 or 0.9 cost 6.7% and 14.6% at lr 1 (H = 20), and still 1.6% and 8.9% at equal
  effective step over 40 rounds at H = 5. At small H consecutive rounds' pseudo-gradients point the same way
  (cosine 0.5-0.8 measured at H = 20, k = 4), and momentum compounds them. Eager overlap's best lr was 0.7
  (lr 1 cost 1.6%): the others' term it steps with is a round old.
- **H of** :data:`SMALL_H` **or more: momentum 0.9, lr by the expected number of peers k**: 0.4 for
  k = 1, 0.6 for k = 2-7 (the scaling-law study of DiLoCo, read from its figure at H = 30 and models of
  335M+: the best lr grows with the number of replicas and does not depend on model size), and 0.7 from
  k = 8 on (the DiLoCo paper's own setting at H = 500, k = 8, "robust across the grid"; the scaling-law
  figure reads 0.8 at k = 8 and H = 30, but its best lr also grows with H, so it does not say 0.8 at H = 500,
  and the paper measured 0.7 there). This is the regime of hundreds of rounds that those settings were
  found in; our own sweeps have no point there.
- The boundary at 100 lies between the largest H our sweeps measured (50, where lr 1 without momentum was
  best) and the paper's 500; it is a choice, not a measurement. What really decides is the number of
  rounds: momentum re-applies each pseudo-gradient about 1 / (1 - momentum) times over the next rounds, so
  it pays only over many rounds. A run of hundreds of rounds at small H may do better with the
  large-H settings, a run of a few rounds at H = 500 with the small-H ones: sweep your own H and k with
  ``python -m p2p_diloco.simulate sweep`` and pass ``--outer-lr`` / ``--outer-momentum`` (either one given
  is kept as given; the other is still chosen by this rule).

This module is pure arithmetic on the settings; ``config.OuterConfig`` applies it and the peer logs the
choice at start.
"""

from __future__ import annotations

from dataclasses import dataclass

SMALL_H = 100
"""Below this many inner steps per round the small-H settings apply (module docstring)."""

SMALL_H_LR, SMALL_H_EAGER_LR, SMALL_H_MOMENTUM = 1.0, 0.7, 0.0
LARGE_H_MOMENTUM = 0.9
LARGE_H_LR_BY_PEERS = ((1, 0.4), (2, 0.6), (8, 0.7))
"""(smallest k, lr) steps of the large-H outer lr: k = 1, k = 2-7, k >= 8 (module docstring)."""


@dataclass(frozen=True)
class OuterChoice:
    """The outer settings a run uses and, for each one the rule chose, why."""

    lr: float
    momentum: float
    chosen: tuple[str, ...]
    """Names of the settings the rule chose ("lr", "momentum"); empty when the user gave both."""
    why: str
    """One line for the start-up log: the rule's regime and its evidence."""

    def describe(self) -> str:
        if not self.chosen:
            return f"outer lr {self.lr:g}, momentum {self.momentum:g} (both given)"
        given = [name for name in ("lr", "momentum") if name not in self.chosen]
        return (f"outer lr {self.lr:g}, momentum {self.momentum:g}: chose {' and '.join(self.chosen)} ({self.why})"
                + (f"; {given[0]} as given" if given else "")
                + "; --outer-lr / --outer-momentum override")


def choose_outer(local_steps: int, expected_peers: int, overlap: str = "none", lr: float | None = None,
                 momentum: float | None = None) -> OuterChoice:
    """The outer lr and momentum for a run of ``local_steps`` (H) inner steps per round and about
    ``expected_peers`` (k) peers per round with ``overlap`` ('none' or 'eager'); ``lr`` or ``momentum``
    given (not ``None``) is kept as it is. See the module docstring for the rule and its evidence."""
    if local_steps < 1 or expected_peers < 1:
        raise ValueError(f"need local_steps >= 1 and expected_peers >= 1, got {local_steps}, {expected_peers}")
    if local_steps < SMALL_H:
        auto_lr = SMALL_H_EAGER_LR if overlap == "eager" else SMALL_H_LR
        auto_momentum = SMALL_H_MOMENTUM
        why = (f"H = {local_steps} < {SMALL_H}: tens of rounds, where lr {auto_lr:g} without momentum measured best"
               f"{' with eager overlap' if overlap == 'eager' else ''} (BENCHMARKS.md, outer settings sweeps)")
    else:
        auto_lr = next(value for least, value in reversed(LARGE_H_LR_BY_PEERS) if expected_peers >= least)
        auto_momentum = LARGE_H_MOMENTUM
        why = (f"H = {local_steps} >= {SMALL_H}, about {expected_peers} peer(s): the published settings for "
               f"hundreds of rounds, lr by the number of replicas")
    chosen = tuple(name for name, value in (("lr", lr), ("momentum", momentum)) if value is None)
    return OuterChoice(lr=auto_lr if lr is None else lr, momentum=auto_momentum if momentum is None else momentum,
                       chosen=chosen, why=why)
