"""Streaming DiLoCo: the model synchronised in fragments at staggered times (Douillard et al., arXiv 2501.18512).

Plain DiLoCo puts the whole model's pseudo-gradient on the wire at one moment every H steps: the link idles for
the inner phase and is then saturated. Here the model's parameters are split into F fragments; fragment f
synchronises every H steps, offset by f·H/F, so at any moment about 1/F of the model is in flight and the peak
bandwidth drops about F-fold for the same total bytes.

**Assignment** (:func:`assign_fragments`). Transformer layers are dealt out strided: layer i goes to fragment
i mod F. Every fragment then holds shallow and deep layers, so each synchronisation refreshes a slice of the
whole depth rather than leaving, say, the head unsynchronised for most of H (the paper found strided slightly
better than contiguous). Parameters outside the layers (embeddings, final norm, an untied head) go, largest
first, to the fragment with the fewest values so far: the largest fragment is what the peak is made of, so it is
kept near 1/F of the model. A model whose parameter names show no layer index is dealt out tensor by tensor.

**Schedule** (:class:`FragmentSchedule`). Steps count from 1. Fragment f syncs at every step s >= 1 with
``s ≡ ⌊f·H/F⌋ (mod H)``; its first phase is therefore shorter (⌊f·H/F⌋ steps, H for fragment 0). At its sync
step the fragment's pseudo-gradient Δ_f = θ_f(anchors) − θ_f(local) is taken; its all-reduce overlaps the next
τ inner steps (``fragment_delay``), and at step s + τ the outer step runs on the fragment's anchors and the
result is merged into the local copy: θ_f ← α·θ_f(local) + (1 − α)·θ_f(global) (``fragment_alpha``). τ is at
most ⌊H/F⌋, so one fragment's all-reduce ends before the next fragment's starts; at a step where one fragment
merges and another syncs, the merge goes first.

**Each fragment round is a round of the round policy.** Every fragment has its own :class:`OuterState` (its
anchors, outer momentum, codec with its own error-feedback residual, and its own epoch) and its own
:class:`RoundDriver` over its own port. So whatever a whole round does, a fragment round does, for that fragment
alone: a failed or partial all-reduce is never applied (the fragment's parameters keep the work and the next
pseudo-gradient covers both phases: carried, outcome ``skipped``), late work and resyncs are kept per fragment,
and the checksum a peer publishes and votes on is the fragment's state's (its anchors and momentum at its
epoch): a drifted fragment is resynced alone, the others stay. F = 1 with τ = 0 and α = 0 is exactly DiLoCo: the
same driver, the same state, the same arithmetic (a test checks it bitwise).

Memory: the fragments' anchors and momentum together are one model's, as before; what shrinks is what is
in flight: a fragment's pseudo-gradient (and the averager's buffer for it) is 1/F of the model.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from p2p_diloco.core.evidence import EPOCH_LIMIT
from p2p_diloco.core.peer_state import OuterState
from p2p_diloco.core.pseudograd import pseudo_gradient
from p2p_diloco.core.round_driver import InFlight, RoundDriver, RoundPort
from p2p_diloco.core.rounds import RoundPolicy, RoundReport

__all__ = ["MAX_FRAGMENTS", "ROUND_LIMIT", "FragmentSchedule", "StreamingRounds", "SyncedWork", "assign_fragments",
           "round_number"]

logger = logging.getLogger(__name__)

MAX_FRAGMENTS = 64
"""The most fragments a run may have (``OuterConfig.fragments``): more than a model's layers rarely helps, and
it bounds the round numbers on the wire (:data:`ROUND_LIMIT`)."""
ROUND_LIMIT = (EPOCH_LIMIT + 1) * MAX_FRAGMENTS - 1
"""The largest round number (:func:`round_number`) any legal run announces: fragment ``F - 1`` of epoch
``EPOCH_LIMIT`` with ``F = MAX_FRAGMENTS``. Wire formats accept round numbers in ``[0, ROUND_LIMIT]``."""


def round_number(epoch: int, fragment: int, fragments: int) -> int:
    """The number a round of ``fragment`` (of ``fragments``) at that fragment's ``epoch`` meets under: e·F + f,
    the epoch itself for F = 1; ``ValueError`` outside ``[0, EPOCH_LIMIT]``, ``[0, F)`` and ``[1, MAX_FRAGMENTS]``."""
    for name, value, low, high in (("fragments", fragments, 1, MAX_FRAGMENTS), ("epoch", epoch, 0, EPOCH_LIMIT),
                                   ("fragment", fragment, 0, fragments - 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{name} must be an integer within [{low}, {high}], got {value!r}")
    return epoch * fragments + fragment


LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")
"""Where a parameter name carries its transformer layer (``model.layers.3.mlp...``, ``transformer.h.3...``)."""


def assign_fragments(names: Sequence[str], numels: Sequence[int], fragments: int) -> list[list[int]]:
    """The parameter indices of each of ``fragments`` fragments (each list sorted); see the module docstring.

    Raises:
        ValueError: fewer layers (or, without layers, tensors) than fragments, or mismatched inputs.
    """
    if len(names) != len(numels):
        raise ValueError(f"assign_fragments: {len(names)} names but {len(numels)} sizes")
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    layers: dict[int, list[int]] = {}
    loose: list[int] = []
    for index, name in enumerate(names):
        match = LAYER_INDEX.search(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(index)
        else:
            loose.append(index)
    if layers:
        units = [layers[key] for key in sorted(layers)]
        what = "layers"
    else:
        units, loose = [[index] for index in range(len(names))], []
        what = "parameter tensors"
    if len(units) < fragments:
        raise ValueError(f"fragments: the model has {len(units)} {what}, fewer than --fragments {fragments}; "
                         f"use at most {len(units)}")
    out: list[list[int]] = [[] for _ in range(fragments)]
    sizes = [0] * fragments
    for position, unit in enumerate(units):
        out[position % fragments].extend(unit)
        sizes[position % fragments] += sum(numels[i] for i in unit)
    for index in sorted(loose, key=lambda i: (-numels[i], i)):
        lightest = min(range(fragments), key=lambda f: (sizes[f], f))
        out[lightest].append(index)
        sizes[lightest] += numels[index]
    return [sorted(indices) for indices in out]


@dataclass(frozen=True)
class FragmentSchedule:
    """When each fragment syncs and merges; see the module docstring.

    Args:
        local_steps: H, steps between two syncs of one fragment.
        fragments: F, in [1, H].
        delay: τ, steps between a fragment's sync and its merge, in [0, ⌊H/F⌋].
    """

    local_steps: int
    fragments: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.fragments <= min(self.local_steps, MAX_FRAGMENTS):
            raise ValueError(f"fragments must be in [1, min(local_steps={self.local_steps}, {MAX_FRAGMENTS})], "
                             f"got {self.fragments}")
        if not 0 <= self.delay <= self.local_steps // self.fragments:
            raise ValueError(f"fragment delay must be in [0, {self.local_steps // self.fragments}], got {self.delay}")

    def offset(self, fragment: int) -> int:
        """The step (mod H) at which ``fragment`` syncs: ⌊f·H/F⌋."""
        return fragment * self.local_steps // self.fragments

    def syncs(self, step: int) -> list[int]:
        """Fragments whose pseudo-gradient is taken after inner step ``step`` (steps count from 1)."""
        if step < 1:
            return []
        return [f for f in range(self.fragments) if (step - self.offset(f)) % self.local_steps == 0]

    def merges(self, step: int) -> list[int]:
        """Fragments whose outer result is applied after inner step ``step`` (their sync was τ steps before)."""
        return self.syncs(step - self.delay)

    def sync_step(self, fragment: int, count: int) -> int:
        """The step of ``fragment``'s ``count``-th sync (from 1); 0 for ``count`` 0 (none yet)."""
        if count <= 0:
            return 0
        offset = self.offset(fragment)
        return offset + (count - 1) * self.local_steps if offset > 0 else count * self.local_steps

    def position(self, epochs: Sequence[int]) -> int:
        """Where a peer whose fragments are at ``epochs`` (rounds done, merged, by each) stands in the schedule:
        the step of the last merge among them (its sync plus τ), 0 before any. A joiner takes it from the epochs it
        downloaded, so no step counter needs to be trusted from a peer."""
        if len(epochs) != self.fragments:
            raise ValueError(f"{len(epochs)} fragment epochs for {self.fragments} fragments")
        last_sync = max(self.sync_step(f, e) for f, e in enumerate(epochs))
        return last_sync + self.delay if last_sync > 0 else 0

    def next_merge(self, step: int) -> int:
        """The first step after ``step`` at which some fragment merges (with τ = 0, where it syncs): where a swarm
        peer's inner phase ends, its sync τ steps earlier taken inside the phase."""
        event = self.next_event(step)
        for _ in range(2 * self.fragments + 1):  # each fragment syncs and merges once per H steps
            if self.merges(event):
                return event
            event = self.next_event(event)
        raise AssertionError(f"no merge within {self.local_steps} steps after step {step}")

    def next_event(self, step: int) -> int:
        """The first step after ``step`` at which some fragment syncs or merges."""
        candidates = []
        for f in range(self.fragments):
            for shift in (0, self.delay):
                base = self.offset(f) + shift
                ahead = step + 1 - base
                k = max(1 if self.offset(f) == 0 else 0, -(-ahead // self.local_steps))
                candidates.append(base + k * self.local_steps)
        return min(candidates)


@dataclass
class SyncedWork:
    """A fragment's pseudo-gradient taken at its sync step, waiting τ steps for its all-reduce and merge."""

    delta: list[Tensor]
    samples: float
    """Samples trained since the fragment's previous sync."""
    weight: float
    """Its weight in the all-reduce: the samples plus any work carried from a failed round."""
    step: int


class Fragment:
    """One fragment of a peer: which parameters, their outer state, their round driver and their own port."""

    def __init__(self, index: int, indices: Sequence[int], params: Sequence[Tensor], state: OuterState,
                 driver: RoundDriver) -> None:
        self.index, self.indices, self.params = index, list(indices), list(params)
        self.state, self.driver = state, driver
        self.samples = 0.0
        self.synced: SyncedWork | None = None
        self.flight: InFlight | None = None
        """Its round opened at its sync step, exchanging while training goes on (:meth:`StreamingRounds.launch`)."""

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


class StreamingRounds:
    """One peer's fragments and their rounds, driven step by step; see the module docstring.

    Args:
        params: the model's live parameters, in the run's fixed order.
        names: their names (for the assignment rule).
        schedule: when fragments sync and merge.
        policy: the round policy every fragment round follows.
        make_state: builds a fragment's outer state from its parameters (``f``, params).
        make_port: builds a fragment's port (``f``, its state, its params): in the swarm, the averager for that
            fragment's tensors; in the simulator, the fragment's in-process group.
        peer_id: this peer's id as the ports' results name it.
        alpha: α, the merge factor (``OuterConfig.fragment_alpha``).
        groups: the assignment; default :func:`assign_fragments`.

    Use: :meth:`begin` once; after each run of inner steps, :meth:`trained`; at each step of
    :meth:`FragmentSchedule.next_event`, :meth:`step` (a single peer), or :meth:`sync` / :meth:`finish` when a
    simulator reduces the group between them.
    """

    def __init__(self, params: Sequence[Tensor], names: Sequence[str], schedule: FragmentSchedule,
                 policy: RoundPolicy, make_state: Callable[[int, list[Tensor]], OuterState],
                 make_port: Callable[[int, OuterState, list[Tensor]], RoundPort], peer_id: str,
                 alpha: float = 0.0, groups: Sequence[Sequence[int]] | None = None) -> None:
        params = list(params)
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"fragment alpha must be in [0, 1), got {alpha}")
        if groups is None:
            groups = assign_fragments(names, [p.numel() for p in params], schedule.fragments)
        if len(groups) != schedule.fragments:
            raise ValueError(f"{len(groups)} fragment groups for {schedule.fragments} fragments")
        covered = sorted(i for group in groups for i in group)
        if covered != list(range(len(params))):
            raise ValueError("fragment groups must cover every parameter exactly once")
        self.schedule, self.alpha, self.peer_id = schedule, alpha, peer_id
        self.fragments: list[Fragment] = []
        for f, indices in enumerate(groups):
            own = [params[i] for i in indices]
            state = make_state(f, own)
            driver = RoundDriver(state, own, policy, make_port(f, state, own), peer_id, merge_alpha=alpha)
            self.fragments.append(Fragment(f, indices, own, state, driver))

    def begin(self) -> None:
        """Start training: every fragment's parameters become its anchors."""
        for fragment in self.fragments:
            fragment.driver.begin()

    def trained(self, samples: float) -> None:
        """Inner steps ran over ``samples`` samples (they count toward every fragment's next round)."""
        for fragment in self.fragments:
            fragment.samples += float(samples)

    @torch.no_grad()
    def sync(self, f: int, step: int) -> SyncedWork:
        """Take fragment ``f``'s pseudo-gradient now (its all-reduce may run during the next τ steps)."""
        fragment = self.fragments[f]
        if fragment.synced is not None:
            raise RuntimeError(f"fragment {f} synced at step {step} before its sync of step "
                               f"{fragment.synced.step} was finished")
        delta = pseudo_gradient(fragment.state.anchors, fragment.params)
        weight = fragment.driver.pending.weight_for(fragment.samples)
        fragment.synced = SyncedWork(delta, fragment.samples, weight, step)
        fragment.samples = 0.0
        return fragment.synced

    def launch(self, f: int, inner_seconds: float = 0.0) -> Callable[[], None]:
        """Open fragment ``f``'s round on the work taken at its sync (:meth:`sync`) and return its exchange: the
        caller runs it on any thread while the next τ steps train, then calls :meth:`finish` at the merge step,
        once the exchange returned (``RoundDriver.open``, ``exchange``, ``land``)."""
        fragment = self.fragments[f]
        synced = fragment.synced
        if synced is None or fragment.flight is not None:
            raise RuntimeError(f"fragment {f} has no synced work to launch, or a round in flight")
        fragment.synced = None
        report = RoundReport(epoch=fragment.state.epoch, fragment=f)
        flight = fragment.flight = fragment.driver.open(synced.samples, report, inner_seconds, delta=synced.delta)
        return lambda: fragment.driver.exchange(flight)

    def finish(self, f: int, inner_seconds: float = 0.0) -> RoundReport:
        """Fragment ``f``'s round on the work taken at its sync: the round policy's decisions, the outer step on
        its anchors and the α-merge into its parameters (or nothing applied, the work carried). A round
        :meth:`launch` opened lands here (its exchange must have returned)."""
        fragment = self.fragments[f]
        if fragment.flight is not None:
            flight, fragment.flight = fragment.flight, None
            return fragment.driver.land(flight)
        synced = fragment.synced
        if synced is None:
            raise RuntimeError(f"fragment {f} has no synced work to finish")
        fragment.synced = None
        report = RoundReport(epoch=fragment.state.epoch, fragment=f)
        return fragment.driver.end(synced.samples, report, inner_seconds, delta=synced.delta)

    def step(self, step: int, inner_seconds: float = 0.0) -> list[RoundReport]:
        """Everything due after inner step ``step`` for a peer whose port averages inside ``finish``: merges
        first, then syncs (finished at once when τ = 0)."""
        reports = [self.finish(f, inner_seconds) for f in self.schedule.merges(step)
                   if self.fragments[f].synced is not None]
        for f in self.schedule.syncs(step):
            self.sync(f, step)
            if self.schedule.delay == 0:
                reports.append(self.finish(f, inner_seconds))
        return reports
