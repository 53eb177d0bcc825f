"""The simulator's fault schedule: which worker misses which round, drawn from a seed or scripted.

Each fault is one the real swarm meets, and the swarm's round policy handles it in the simulator exactly as on
the network (``simulate.swarm_mode``):

- **late** (``--late-rate``, script ``late@EPOCH:WORKER``): the worker's inner phase ends after the others'
  group formed (a slow GPU; the swarm fault ``slow_steps``). The others average without it; it finds the swarm
  ahead, downloads the state and folds its work into a later round (delayed updates).
- **drop** (``--drop-rate``, ``drop@EPOCH:WORKER``): the worker crashes before its all-reduce and restarts from
  the swarm's state (``kill_before_allreduce`` and a restart): its outer gradient of that round is lost.
  ``--drop-rate 0.5`` is the DiLoCo paper's "drop 50% of the outer gradients" experiment.
- **partial** (``--partial-rate``, ``partial@EPOCH``): the round's all-reduce fails mid-way (``fail_confirm``):
  nobody applies it, every member trains on and carries its work into the next round.
- **joiners** (``--join WORKER=ROUND``): the worker is absent until that round, then downloads the swarm's
  state and trains from it.

Drawn faults use ``random.Random`` seeded with (seed, round): the same seed gives the same schedule whatever
else changes. Scripted faults are keyed by the swarm's epoch, as ``P2P_DILOCO_FAULTS`` is, and fire once.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

_SCRIPT = re.compile(r"^(late|drop)@(\d+):(\d+)$|^(partial)@(\d+)$")


@dataclass(frozen=True)
class RoundFaults:
    """The faults of one simulated round."""

    late: frozenset[int] = frozenset()
    dropped: frozenset[int] = frozenset()
    partial: bool = False


@dataclass
class FaultSchedule:
    """Faults for the ``swarm`` simulation mode; all off by default."""

    seed: int = 0
    """Seeds the drawn faults (independent of the training seed)."""
    drop_rate: float = 0.0
    """Probability that a worker's outer gradient of a round is lost (the worker crashes and restarts from the
    swarm's state), each worker and round drawn independently."""
    late_rate: float = 0.0
    """Probability that a worker misses a round's group and folds its work into a later round."""
    partial_rate: float = 0.0
    """Probability that a round's all-reduce fails mid-way, so that no member applies it."""
    joins: dict[int, int] = field(default_factory=dict)
    """Worker index -> the round it joins in (absent before). Worker 0 is there from the start."""
    script: list[str] = field(default_factory=list)
    """Explicit faults: ``late@EPOCH:WORKER``, ``drop@EPOCH:WORKER``, ``partial@EPOCH``."""

    def __post_init__(self) -> None:
        for name in ("drop_rate", "late_rate", "partial_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {value}")
        self.joins = {int(w): int(r) for w, r in self.joins.items()}
        if 0 in self.joins and self.joins[0] != 0:
            raise ValueError("joins: worker 0 starts the swarm and cannot join later")
        if any(r < 0 for r in self.joins.values()):
            raise ValueError(f"joins: rounds must be >= 0, got {self.joins}")
        self._scripted: list[tuple[str, int, int]] = []
        for item in self.script:
            match = _SCRIPT.match(item.strip())
            if match is None:
                raise ValueError(f"faults: cannot read {item!r}; expected late@EPOCH:WORKER, drop@EPOCH:WORKER "
                                 "or partial@EPOCH")
            if match.group(4):
                self._scripted.append(("partial", int(match.group(5)), -1))
            else:
                self._scripted.append((match.group(1), int(match.group(2)), int(match.group(3))))
        self._fired: set[int] = set()

    @property
    def active(self) -> bool:
        return bool(self.drop_rate or self.late_rate or self.partial_rate or self.joins or self.script)

    def check_workers(self, workers: int) -> None:
        bad = sorted({w for w in self.joins if w >= workers} | {w for _, _, w in self._scripted if w >= workers})
        if bad:
            raise ValueError(f"faults: workers {bad} do not exist (there are {workers})")

    def joined(self, worker: int, rnd: int) -> bool:
        return self.joins.get(worker, 0) <= rnd

    def round_faults(self, rnd: int, epoch: int, workers: int) -> RoundFaults:
        """The faults of round ``rnd`` (0-based), whose swarm epoch is ``epoch``."""
        draw = random.Random(f"{self.seed}:{rnd}")
        late = {w for w in range(workers) if draw.random() < self.late_rate}
        dropped = {w for w in range(workers) if draw.random() < self.drop_rate} - late
        partial = draw.random() < self.partial_rate
        for i, (kind, at, worker) in enumerate(self._scripted):
            if at != epoch or i in self._fired:
                continue
            self._fired.add(i)
            if kind == "partial":
                partial = True
            else:
                (late if kind == "late" else dropped).add(worker)
        return RoundFaults(frozenset(late), frozenset(dropped - late), partial)
