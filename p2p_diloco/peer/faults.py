"""Fault injection keyed by (peer, epoch), for tests and chaos drills on a real swarm.

Faults are read from the environment variable ``P2P_DILOCO_FAULTS`` so that the production command
line stays clean; with the variable unset nothing here runs. Syntax: comma-separated ``ACTION@EPOCH``
entries, optionally ``ACTION@EPOCH=VALUE``:

- ``kill_before_allreduce@E``: SIGKILL this peer when its epoch-E round is about to average;
- ``kill_during_allreduce@E``: SIGKILL this peer after it sent its first all-reduce part in epoch E;
- ``slow_steps@E=SECONDS``: sleep SECONDS after every inner step of epoch E (a slow GPU, a busy host);
- ``fail_confirm@E``: report an incomplete all-reduce in epoch E (a reducer that fails mid-way);
- ``slow_sender@E=SECONDS``: stall SECONDS inside the epoch-E all-reduce, after the first part went out (a
  congested uplink; beyond ``next_chunk_timeout_s`` the groupmates give up on this peer);
- ``byzantine@E=SCALE``: send the epoch-E pseudo-gradient multiplied by SCALE (e.g. -20: a scaled,
  sign-flipped attack), announcing the norm of what it sends; ``nan_input@E``: send NaN instead. Reducers
  must reject or out-vote these;
- ``hostile_reducer@E=FACTOR``: as a reducer in epoch E, send the groupmates the first averaged part
  multiplied by FACTOR (a hostile reducer). Members must refuse it and ban this peer;
- ``equivocate@E=FACTOR``: as a reducer in epoch E, send ONE groupmate the first averaged part multiplied by
  FACTOR and the others the true one (equivocation; a FACTOR below 1 stays within every bound). The
  completion check must catch it: nobody applies the round, that groupmate bans this peer;
- ``stall_leader@E=SECONDS``: as the leader of the epoch-E group, block the averager's event loop for SECONDS
  right before assembling the group (an overloaded machine). Its followers must still be there;
- ``start_together@E=N``: before the first inner step of epoch E, wait until N peers' progress records of this
  run and model are visible, this peer's own included (at most ``START_TOGETHER_MAX_S``). Peers started at once
  that must average from epoch 0 then all begin it together, however far apart their processes came up: the
  condition the first round reads (who is visible, who is due), not a guess at how long start-up takes.

Faults outside one peer (a partition, losing the bootstrap node) are driven by the tests themselves.

Each fault that fires writes a ``fault`` event to the run log first, so a test can assert it fired (``slow_steps``
and ``start_together`` only pace a peer and write none). A fault fires once (a skipped round is retried in the
same epoch and must not meet the fault again), except ``slow_steps``, which slows every inner step of its epoch.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import psutil

ENV = "P2P_DILOCO_FAULTS"
ACTIONS = (
    "kill_before_allreduce",
    "kill_during_allreduce",
    "slow_steps",
    "fail_confirm",
    "slow_sender",
    "byzantine",
    "nan_input",
    "hostile_reducer",
    "equivocate",
    "stall_leader",
    "start_together",
)
_NEEDS_VALUE = ("slow_steps", "slow_sender", "byzantine", "hostile_reducer", "equivocate", "stall_leader",
                "start_together")

START_TOGETHER_MAX_S = 300.0
"""Longest wait of ``start_together`` for the others' records: then the peer starts anyway (a peer that never
came up must not hold the others for the whole test; the test's own assertions then say what went wrong)."""
START_TOGETHER_POLL_S = 0.2
"""How often ``start_together`` reads the records while it waits (one DHT read each)."""


@dataclass(frozen=True)
class Fault:
    action: str
    epoch: int
    value: float = 0.0


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        action, _, rest = item.partition("@")
        epoch_text, _, value_text = rest.partition("=")
        if action not in ACTIONS or not epoch_text.isdigit():
            raise ValueError(f"{ENV}: cannot read {item!r}; expected ACTION@EPOCH[=VALUE] with ACTION in "
                             f"{', '.join(ACTIONS)}")
        try:
            value = float(value_text) if value_text else 0.0
        except ValueError:
            raise ValueError(f"{ENV}: {item!r} has a value that is not a number") from None
        if action in _NEEDS_VALUE and (not value_text or not math.isfinite(value)):
            raise ValueError(f"{ENV}: {item!r} needs a finite number, e.g. {action}@{epoch_text}=2")
        faults.append(Fault(action, int(epoch_text), value))
    return faults


class FaultHooks(Protocol):
    """The points where an injected fault can act. Every hook is a no-op here, so a production peer runs
    :data:`NO_FAULTS` and its code path reads without conditions; :class:`FaultPlan` overrides them."""

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose faults are due from now on."""

    def after_inner_step(self) -> None:
        """After every inner step (``slow_steps``)."""

    def before_phase(self, visible_peers: Callable[[], int]) -> None:
        """Before an inner phase, once its epoch is set (``start_together``); ``visible_peers`` reads how many
        peers' progress records of this run and model are visible, this peer's own included."""

    def before_allreduce(self) -> None:
        """Right before this peer's work is sent (``kill_before_allreduce``)."""

    def swarm_hook(self) -> Callable[[str], bool | float | None] | None:
        """The hook the averager process runs (``swarm.runner.FaultHook``); None runs none."""
        return None


class NoFaults(FaultHooks):
    """Production: no fault acts."""


NO_FAULTS = NoFaults()


class FaultPlan(FaultHooks):
    """The faults of this peer; ``record`` is called with (action, epoch) right before a fault acts."""

    def __init__(self, faults: list[Fault], record: Callable[[str, int], None]) -> None:
        self.faults = faults
        self.record = record
        # Shared with the averager process (forked), whose hook needs the current epoch.
        self._epoch = mp.Value("q", 0, lock=False)
        self._fired = mp.Array("b", max(1, len(faults)), lock=False)
        self._peer_pid = os.getpid()

    @classmethod
    def from_env(cls, record: Callable[[str, int], None]) -> FaultPlan | None:
        text = os.environ.get(ENV, "")
        return cls(parse_faults(text), record) if text.strip() else None

    def set_epoch(self, epoch: int) -> None:
        self._epoch.value = epoch

    def _pending(self, action: str) -> int | None:
        """Index of the first fault of ``action`` due in this epoch that has not fired yet."""
        for i, fault in enumerate(self.faults):
            if fault.action == action and fault.epoch == self._epoch.value and not self._fired[i]:
                return i
        return None

    def _find(self, action: str) -> Fault | None:
        """The due fault of ``action``, marked as fired (``slow_steps`` stays due for its whole epoch)."""
        i = self._pending(action)
        if i is None:
            return None
        if action != "slow_steps":
            self._fired[i] = 1
        return self.faults[i]

    def _crash(self) -> None:
        """SIGKILL the whole peer: its DHT and averager processes and their p2p daemons first (a crashed
        machine takes them all; killed alone, the host would leave them serving RPCs as orphans), then the
        host process, then this process if it is another one."""
        try:
            children = psutil.Process(self._peer_pid).children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            if child.pid != os.getpid():
                with contextlib.suppress(psutil.Error):
                    child.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._peer_pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def swarm_hook(self) -> Callable[[str], bool | float | None]:
        return self.averager_hook

    def before_allreduce(self) -> None:
        if self._find("kill_before_allreduce"):
            self.record("kill_before_allreduce", self._epoch.value)
            self._crash()

    def after_inner_step(self) -> None:
        fault = self._find("slow_steps")
        if fault:
            time.sleep(fault.value)

    def before_phase(self, visible_peers: Callable[[], int]) -> None:
        fault = self._find("start_together")
        if not fault:
            return
        deadline = time.monotonic() + START_TOGETHER_MAX_S
        while visible_peers() < fault.value and time.monotonic() < deadline:
            time.sleep(START_TOGETHER_POLL_S)

    def averager_hook(self, stage: str) -> bool | float | None:
        """Runs inside the averager process (see ``swarm.runner.FaultHook``)."""
        if stage == "announce":
            i = self._pending("byzantine")
            return None if i is None else self.faults[i].value
        if stage in ("corrupt_output", "equivocate"):
            action = "hostile_reducer" if stage == "corrupt_output" else "equivocate"
            fault = self._find(action)
            if fault:
                self.record(action, self._epoch.value)
                return fault.value
            return None
        if stage == "corrupt_input":
            for action in ("byzantine", "nan_input"):
                fault = self._find(action)
                if fault:
                    self.record(action, self._epoch.value)
                    return fault.value if action == "byzantine" else math.nan
        if stage == "assemble":
            stall = self._find("stall_leader")
            if stall:
                self.record("stall_leader", self._epoch.value)
                time.sleep(stall.value)
            return None
        slow = self._find("slow_sender") if stage == "part_sent" else None
        if slow:
            self.record("slow_sender", self._epoch.value)
            time.sleep(slow.value)
        if stage == "part_sent" and self._find("kill_during_allreduce"):
            self.record("kill_during_allreduce", self._epoch.value)
            self._crash()
        if stage == "confirm" and self._find("fail_confirm"):
            self.record("fail_confirm", self._epoch.value)
            return False
        return None
