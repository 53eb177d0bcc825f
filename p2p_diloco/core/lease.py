"""Buffer leases: who may touch a round's buffers, and when (no network).

One model-sized buffer plays several roles in a round, one after the other: the driver writes its
pseudo-gradient Δ into it, the averager process sends and overwrites it during the all-reduce, the driver
reads the group's mean back from it, and the swarm serves that mean to joiners one round behind
(``swarm.catchup``). Call order alone used to end each role. A :class:`BufferLease` makes the roles states,
and every access names the state it needs::

    WRITABLE ──send()──▶ IN_FLIGHT ──returned(averaged=True)──▶ READABLE ──serve()──▶ SERVED
        ▲                    │                                      │                   │
        └──returned(False)───┘                          release() from any state ──▶ RELEASED

* ``WRITABLE`` (Δ writable): :meth:`BufferLease.delta` hands the buffers out for writing (and reading: the
  work is the driver's until sent).
* ``IN_FLIGHT``: the round has them; only the port reads them (:meth:`BufferLease.in_flight`), and nothing of
  the driver's may touch them. A failed round returns them ``WRITABLE`` again: their values are garbage (a
  partial all-reduce wrote into them), but the buffers are idle and may take new work (a catch-up writes the
  late work there while the download runs).
* ``READABLE`` (mean readable): the all-reduce completed; the group's mean is there (:meth:`BufferLease.mean`).
* ``SERVED``: the outer step applied the mean and the port serves it as the round's update; it stays readable
  and may not be written.
* ``RELEASED``: the lease ended (:meth:`BufferLease.release`, run by the driver before it takes the next
  round's lease); the port's ``on_release`` ends the serving first. Nothing may be read or written.

A wrong access raises :class:`LeaseError` naming the state: a bug in the caller, never a network condition.

**Late work.** The round that folds late work takes it over (:meth:`BufferLease.fold`): the driver's
:class:`~p2p_diloco.core.rounds.PendingWork` lets go of it, so nothing of core's refers to tensors the
averager process scales and overwrites in place (the swarm shares the late work's memory with that process
rather than copying it: a second model-sized buffer for the whole fold round, at 1B parameters 4 GB). The
round hands it back (:meth:`BufferLease.returned`) only when it failed without touching it; otherwise it is
spent, folded into the group's terms or, when the round failed after the all-reduce wrote into it,
lost (one phase of late work, rather than a corrupted update later).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import torch

from p2p_diloco.core.rounds import LateWork


class LeaseState(str, enum.Enum):
    """Who may touch a round's buffers now; see the module docstring."""

    WRITABLE = "delta writable"
    IN_FLIGHT = "in flight"
    READABLE = "mean readable"
    SERVED = "served"
    RELEASED = "released"

    def __str__(self) -> str:
        return self.value


class LeaseError(RuntimeError):
    """A buffer was asked for in a state that does not allow it (a caller's bug)."""


class BufferLease:
    """A round's fresh buffers (and the late work it folds), with the state that says who may touch them.

    Args:
        fresh: the buffers for this round's pseudo-gradient: the port's shared averaging buffers, or tensors of
            the driver's own (``shared=False``).
        shared: the buffers belong to the port (another process may write them while ``IN_FLIGHT``).
        on_release: the port's part of :meth:`release` (the swarm stops serving the round's update from them);
            run once.
    """

    def __init__(self, fresh: Sequence[torch.Tensor], *, shared: bool = False,
                 on_release: Callable[[], None] | None = None) -> None:
        self._fresh = list(fresh)
        self.shared = shared
        self._on_release = on_release
        self._late: LateWork | None = None
        self.state = LeaseState.WRITABLE

    def _need(self, what: str, *states: LeaseState) -> None:
        if self.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise LeaseError(f"cannot {what}: the round's buffers are {self.state.value} (needs {allowed})")

    def delta(self) -> list[torch.Tensor]:
        """The buffers to write this round's pseudo-gradient into (``WRITABLE`` only)."""
        self._need("write the pseudo-gradient", LeaseState.WRITABLE)
        return self._fresh

    def fold(self, late: LateWork) -> None:
        """This round takes ``late`` over (``WRITABLE`` only): the caller must drop its own reference."""
        self._need("fold late work", LeaseState.WRITABLE)
        if self._late is not None:
            raise LeaseError("this round already folds late work")
        if len(late.delta) != len(self._fresh):
            raise LeaseError(f"late work holds {len(late.delta)} tensors, the round's buffers {len(self._fresh)}")
        self._late = late

    @property
    def folds_late(self) -> bool:
        return self._late is not None

    def send(self) -> None:
        """The round starts: the buffers (and the late work) belong to it until :meth:`returned`."""
        self._need("send", LeaseState.WRITABLE)
        self.state = LeaseState.IN_FLIGHT

    def in_flight(self) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """For the port running the round: the fresh buffers and the late work's tensors (or None)."""
        self._need("run the round", LeaseState.IN_FLIGHT)
        return self._fresh, None if self._late is None else self._late.delta

    def returned(self, averaged: bool, late_intact: bool) -> LateWork | None:
        """The round ended. ``averaged``: the buffers hold the group's mean (``READABLE``); otherwise they are
        idle and ``WRITABLE`` again (their values garbage). ``late_intact``: the round never wrote into the late
        work. Returns the late work when the caller gets it back (a failed round that left it intact)."""
        self._need("return from the round", LeaseState.IN_FLIGHT)
        self.state = LeaseState.READABLE if averaged else LeaseState.WRITABLE
        late, self._late = self._late, None
        return late if late is not None and not averaged and late_intact else None

    def mean(self) -> list[torch.Tensor]:
        """The group's mean, as the all-reduce left it (``READABLE`` or ``SERVED``)."""
        self._need("read the mean", LeaseState.READABLE, LeaseState.SERVED)
        return self._fresh

    def serve(self) -> None:
        """The port serves the mean (the round's update) until :meth:`release`; it may no longer be written."""
        self._need("serve the mean", LeaseState.READABLE)
        self.state = LeaseState.SERVED

    def release(self) -> None:
        """End the lease (idempotent): the port stops serving from the buffers, and nobody may touch them."""
        if self.state is LeaseState.RELEASED:
            return
        self.state = LeaseState.RELEASED
        self._late = None
        if self._on_release is not None:
            self._on_release()
