"""A round in the averager process: :class:`RoundProcess`, one per averager process.

``RoundProcess.step`` runs one round there (``commands.Step``): one matchmaking attempt and at most one
all-reduce of a formed group (plan, pre-scale, all-reduce, completion check). The host side (``average``,
buffers, results) stays in :mod:`p2p_diloco.swarm.averager`; this split keeps each module to one side of the
process boundary.

Its own state (settings, layout, timing, the access gate) is given when ``averager_process.AveragerProcess``
makes it; what it uses of hivemind's averager comes with each round as a :class:`HivemindSide`, whose
private names are in ``tests/unit/test_hivemind_internals.py``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import enter_asynchronously

from p2p_diloco.core.bounds import fresh_limits, output_bound, plain_tolerance
from p2p_diloco.core.rounds import Outcome, RoundResult
from p2p_diloco.swarm import registry
from p2p_diloco.swarm.access import AccessGate
from p2p_diloco.swarm.buffer_layout import BufferLayout
from p2p_diloco.swarm.claims import open_claim, sign_gather
from p2p_diloco.swarm.completion import confirm_complete
from p2p_diloco.swarm.config import SwarmConfig
from p2p_diloco.swarm.group import DEFAULT_MAX_ROUND_WEIGHT, GroupPlan, balancing_bandwidths, plan_group
from p2p_diloco.swarm.patience import JoinTiming
from p2p_diloco.swarm.protocol import use_round_key
from p2p_diloco.swarm.quorum import EarlyAssembly, Formed
from p2p_diloco.swarm.runner import (
    ByteCounter,
    CountingAllReduceRunner,
    FaultHook,
    RunnerFactory,
    no_faults,
    run_allreduce,
)

logger = logging.getLogger(__name__)


def _corrupt(tensors: Sequence[torch.Tensor], factor: object) -> None:
    """Test-only sabotage of our own input (``byzantine`` faults): multiply it by ``factor`` (NaN fills)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        return
    with torch.no_grad():
        for tensor in tensors:
            if math.isnan(factor):
                tensor.fill_(float("nan"))
            else:
                tensor.mul_(factor)


def _hook_assembly(matchmaking: Any, hook: FaultHook) -> None:
    """Call ``hook("assemble")`` each time this peer, as a leader, is about to form its group."""
    if getattr(matchmaking, "_assembly_hooked", False):
        return
    assemble = matchmaking.leader_assemble_group

    async def hooked() -> GroupInfo:
        hook("assemble")
        return await assemble()

    matchmaking.leader_assemble_group = hooked
    matchmaking._assembly_hooked = True


async def _settle_credit(compression: Any, averaged: Sequence[torch.Tensor], applied: bool) -> None:
    """Return what the replies dropped of our parts to our error-feedback residuals when the round is
    ``applied`` (it averaged, our own reducer kept our part, the trainer still wants it), else forget what was
    kept for that (``hivemind_codecs``, "What a top-k reply drops"). Runs while the caller still holds the
    averaged buffers, so the replies read are those of this round; a no-op for codecs without crediting. Never
    raises: a failed credit costs only the dropped entries (as without crediting), never the round."""
    credit = getattr(compression, "credit_replies", None)
    if credit is None:
        return
    if not applied:
        compression.forget_sent()
        return
    try:
        credited = await asyncio.get_running_loop().run_in_executor(None, credit, averaged)
    except Exception as e:  # the round stands whatever happens here
        logger.warning("Could not credit what the replies dropped to our residuals: %r", e)
        compression.forget_sent()
        return
    logger.debug("Credited %d values the replies dropped back to our residuals", credited)


def sender_limits(plan: GroupPlan, carried: Mapping[str, float], factor: float,
                  tolerance: float) -> list[tuple[float, float]]:
    """Per member of ``plan``, the most its pre-scaled fresh and late-work parts may weigh (L2, each region's
    parts together): reducers clip senders to these, members bound replies by them (``core.bounds``).

    The fresh limit is ``core.bounds.fresh_limits`` of the member's scaled, clipped norm claim and the carried
    norm it signed (``carried``: base58 id -> norm, ``claims.Claim.carried``; a member missing there carried
    nothing); the late work goes without error feedback and gets the codec's plain factor."""
    plain = plain_tolerance(tolerance)
    base = plan.sender_limits(factor, 1.0)  # per member (s_k c_k, s'_k c'_k): scales times clipped claims
    fresh = fresh_limits([b[0] for b in base], [carried.get(p.to_base58(), 0.0) for p in plan.peer_ids],
                         plan.fresh_weights(), factor, tolerance)
    return [(limit, plain * b[1]) for limit, b in zip(fresh, base, strict=True)]


async def _carried_norm(compression: Any) -> float:
    """What ``compression``'s error-feedback residuals add to our next parts (``CodecCompression.carried_norm``,
    computed off the event loop; cached once a round's warm-up ran); 0 for codecs without residuals."""
    carried = getattr(compression, "carried_norm", None)
    if carried is None:
        return 0.0
    return float(await asyncio.get_running_loop().run_in_executor(None, carried))


class SignedStep(StepControl):
    """hivemind's ``StepControl`` for our rounds: the host gives the round's metadata unsigned
    (``group.encode_gather``), and the averager process, which holds the codec's residuals, signs it with the
    carried norm (``claims.sign_gather``) before the search reads ``data_for_gather``."""

    signed: bytes | None = None
    """The signed entry hivemind gathers, set in the averager process (:meth:`RoundProcess.step`)."""

    @property
    def data_for_gather(self) -> bytes:
        return self.signed if self.signed is not None else super().data_for_gather


@dataclass(frozen=True)
class HivemindSide:
    """What a round uses of hivemind's ``DecentralizedAverager`` in its process, read from it for each round
    (``RoundAverager._hivemind_side``): hivemind makes these in the process's main coroutine."""

    peer_id: PeerID
    matchmaking: Any
    """hivemind's ``Matchmaking`` of this process (``_matchmaking``)."""
    p2p: Any
    prefix: str
    servicer_type: type
    """The averager's class: it names the RPCs the all-reduce runners call."""
    tensors: Callable[[], Any]
    """hivemind's ``get_tensors``: the shared averaging buffers, locked while the context lasts."""
    allreduce_kwargs: dict[str, Any]
    allreduce_timeout: float | None
    groups: dict[bytes, Any]
    """hivemind's ``_running_groups`` (``swarm.registry``)."""
    pending: asyncio.Event
    """hivemind's ``_pending_groups_registered``."""
    claim_key: Any
    """This peer's identity key (``claims.signing_key`` of its DHT): the round's metadata is signed with it here,
    with the codec's carried norm (``claims.sign_gather``)."""


class SearchStop:
    """``commands.GiveUp`` for the running search: made and read on the averager process's loop."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def begin(self) -> asyncio.Event:
        """A search starts: the event a give-up request sets."""
        self._event = asyncio.Event()
        return self._event

    def end(self) -> None:
        self._event = None

    def request(self) -> bool:
        """Ask the running search to stop; ``False`` when none runs (a request between searches stops nothing).
        The search decides whether it does (only while no group has formed), in the round's result."""
        if self._event is None:
            return False
        self._event.set()
        return True


class RoundProcess:
    """Rounds in the averager process (``commands.Step``), with the state they keep there.

    :param cfg: the swarm's settings (group sizes, deadlines, robust aggregation).
    :param layout: the pseudo-gradient's layout in the shared buffer: the whole model, or one fragment a round
      (``buffer_layout.BufferLayout``; each fragment then gets its own copy of the codec, so its error-feedback
      residuals are its own).
    :param gate: this process's access gate: plans refuse and ban through it.
    :param join_timing: matchmaking patience (``swarm.patience``), shared with the join handler.
    :param early: early assembly (``swarm.quorum``), shared with the join handler.
    :param tolerance: the codec's norm tolerances (``averager.codec_tolerance``: ``core.bounds.NormTolerance``),
      ``None``: no bounds.
    :param fault_hook: test-only, see ``runner.FaultHook``.
    """

    def __init__(self, cfg: SwarmConfig, layout: BufferLayout, gate: AccessGate,
                 join_timing: JoinTiming, early: EarlyAssembly, tolerance: float | None, fault_hook: FaultHook):
        self.cfg, self.layout = cfg, layout
        self._codecs: list[Any] = []
        """With fragments, each fragment's codec (:meth:`_codec`); made at the first round, before any residual."""
        self.gate, self.join_timing, self.early = gate, join_timing, early
        self.tolerance, self.fault_hook = tolerance, fault_hook
        self.search = SearchStop()
        self._warming: set[asyncio.Future[Any]] = set()
        """Carried norms being computed once a round ended (:meth:`_warm_carried`), held until each is done."""

    async def step(self, side: HivemindSide, *, step: StepControl, future_for_init: MPFuture,
                   due: tuple[str, ...] = (), allreduce_timeout: float | None = None,
                   stale: list[torch.Tensor] | None = None, step_back: bool = True, epoch: int | None = None,
                   fragment: int = 0) -> None:
        """One matchmaking attempt and at most one all-reduce; the result is a ``RoundResult``, not an exception.

        hivemind's own ``_step`` retries after failures; here a retry would re-scale buffers that were already
        scaled, and the caller prefers a prompt "skipped" to a late round anyway. Beside the search runs
        ``quorum.EarlyAssembly``: a leader forms its group as soon as every peer in ``due`` joined. The search
        declares under the key of its round's number (``epoch`` and ``fragment``, ``BufferLayout.round_number``;
        ``protocol.use_round_key``).
        """
        began = time.monotonic()
        matchmaking, me = side.matchmaking, side.peer_id.to_base58()
        self.gate.guard_leaders(matchmaking)
        self.join_timing.install(matchmaking)
        self.early.install(matchmaking)
        if epoch is not None:
            use_round_key(matchmaking, self.layout.round_number(epoch, fragment))
        if self.fault_hook is not no_faults:
            _hook_assembly(matchmaking, self.fault_hook)
        try:
            trigger, cancel = MPFuture(), MPFuture()
            step.attach(trigger, cancel)
            future_for_init.set_result((trigger, cancel))
            # the host built the metadata; the codec's residuals, and so what they add to our parts, live here
            carried = await _carried_norm(self._codec(side.allreduce_kwargs, fragment)["compression"])
            if not isinstance(step, SignedStep):
                raise TypeError(f"a round's step must be a SignedStep, got {type(step).__name__}")
            step.signed = sign_gather(step.data_for_gather, side.claim_key, carried)
            side.pending.clear()
            step.stage = AveragingStage.LOOKING_FOR_GROUP
            formed = Formed()
            search = asyncio.create_task(matchmaking.look_for_group(step))
            early = asyncio.create_task(self.early.watch(matchmaking, me, due, formed, step if step_back else None))
            cancelled = asyncio.create_task(step.wait_for_cancel())
            give_up = self.search.begin()
            asked = asyncio.create_task(give_up.wait())
            try:
                await asyncio.wait({search, cancelled, asked}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.search.end()
                early.cancel()
                asked.cancel()
            if step.cancelled():
                search.cancel()
                return
            cancelled.cancel()
            if give_up.is_set() and not search.done():
                # Decided here, on the loop where groups form: no group has formed, so none runs without us.
                search.cancel()
                await asyncio.wait({search})
                if search.cancelled():
                    step.set_result(RoundResult(
                        Outcome.SKIPPED, f"the swarm left epoch {epoch} before a group formed", left_behind=True,
                        wait_seconds=time.monotonic() - began))
                    return
                # it finished as the cancel came: a group that formed with us runs; an error is reported below
            elif give_up.is_set():
                logger.info("The swarm looked past epoch %s as the group of this round formed: running it", epoch)
            group_info = await search
            waited = time.monotonic() - began
            if group_info is None:
                if step.done():  # cancelled by the trainer as the search ended: nothing to report
                    return
                others = tuple(sorted(set(due) - {me}))
                step.set_result(RoundResult(Outcome.SKIPPED, "no group formed within matchmaking_timeout_s",
                                            wait_seconds=waited, due_members=formed.due,
                                            cut_members=max(0, formed.due - 1),
                                            cut_peers=others if formed.due else ()))
                return
            members = {peer.to_base58() for peer in group_info.peer_ids}
            await step.wait_for_trigger()
            with registry.registered(side.groups, side.pending, group_info):
                step.stage = AveragingStage.RUNNING_ALLREDUCE
                # filled as the round goes, so that a round cut off by the timeout still names its group
                result = RoundResult(Outcome.SKIPPED, "round interrupted")
                try:
                    await asyncio.wait_for(
                        self._aggregate(side, group_info, result, stale=stale, abandoned=step.done,
                                        fragment=fragment, **self._codec(side.allreduce_kwargs, fragment)),
                        allreduce_timeout or side.allreduce_timeout,
                    )
                except asyncio.TimeoutError:
                    stuck = "; ".join(runner.progress() for runner in registry.runners_of(side.groups, group_info))
                    logger.warning("All-reduce of round %s timed out: %s", group_info.group_id.hex()[:8], stuck)
                    result.skip(f"all-reduce did not finish within its deadline "
                                f"({allreduce_timeout or side.allreduce_timeout:.1f} s)")
                    result.timed_out = True
            result.wait_seconds = waited
            result.due_members, result.formed_early = formed.due, formed.early
            result.stepped_back = formed.stepped_back
            result.due_arrival_s = formed.due_arrival_s
            if formed.due:
                result.cut_peers = tuple(sorted((set(due) | {me}) - members))
                result.cut_members = len(result.cut_peers)
            if step.done():  # the trainer cancelled the round while it ran: it counts it as not averaged
                logger.info("Round %s ended (%s) after the trainer gave up on it", group_info.group_id.hex()[:8],
                            result.outcome.value)
                return
            step.set_result(result)
        except Exception as e:
            logger.warning("Averaging round failed: %r", e, exc_info=True)  # unexpected here: where from
            if not step.done():
                step.set_result(RoundResult(Outcome.SKIPPED, f"{type(e).__name__}: {e}",
                                            wait_seconds=time.monotonic() - began))
        finally:
            step.stage = AveragingStage.FINISHED
            side.pending.set()
            if not step.done():
                step.set_result(RoundResult(Outcome.SKIPPED, "round interrupted"))
            self._warm_carried(self._codec(side.allreduce_kwargs, fragment)["compression"])

    async def _aggregate(
        self, side: HivemindSide, group_info: GroupInfo, result: RoundResult, min_vector_size: int,
        stale: list[torch.Tensor] | None = None, abandoned: Callable[[], bool] | None = None, fragment: int = 0,
        **kwargs: Any
    ) -> RoundResult:
        """The round in a formed group; ``result`` is filled as it goes, so a round cut off by the caller's
        timeout still names its group. It ends ``AVERAGED`` only when every member confirmed.

        ``stale`` is the host's late work for this round (shared memory), or None: a member without late work
        still takes part in a fresh+stale round, with zeros it allocates here for this round only. The
        averaged stale region goes back to the host inside the result (``stale_term``). ``abandoned()`` says
        whether the trainer gave the round up (it then keeps the pseudo-gradient as late work): such a round's
        replies are not credited to the error-feedback residuals (:func:`_settle_credit`)."""
        began = time.monotonic()
        claims = [open_claim(raw, peer) for peer, raw in zip(group_info.peer_ids, group_info.gathered, strict=True)]
        carried = {peer.to_base58(): claim.carried for peer, claim in zip(group_info.peer_ids, claims, strict=True)
                   if not isinstance(claim, str)}
        plan = plan_group(
            group_info.peer_ids,
            [claim if isinstance(claim, str) else claim.metadata for claim in claims],  # each member's own claim
            side.peer_id,
            min_group_size=self.cfg.min_group_size,
            max_weight=self.cfg.max_round_weight or DEFAULT_MAX_ROUND_WEIGHT,
            weight_ratio=self.cfg.weight_outlier_ratio,
            allowed=self.gate.allowed,
        )
        rejected = dict(plan.rejected)
        result.contributors = tuple(p.to_base58() for p in plan.peer_ids)
        result.weights, result.stale_weights = (tuple(m.weight for m in plan.members),
                                                tuple(m.stale_weight for m in plan.members))
        result.stalenesses = tuple(m.staleness for m in plan.members)
        result.refused = tuple(f"{peer}: {reason}" for peer, reason in plan.refused)
        result.with_stale = plan.with_stale
        result.rejected = tuple(self.gate.ban(rejected))
        if plan.skip_reason is not None:
            return result.skip(plan.skip_reason)
        counter = ByteCounter()
        layout = self.layout.layout(fragment)
        num_tensors = len(layout)
        size = sum(math.prod(shape) for shape, _ in layout) * (2 if plan.with_stale else 1)
        bandwidths = [
            bw if mode != AveragingMode.CLIENT else 0.0
            for bw, mode in zip(plan.bandwidths, plan.modes, strict=True)
        ]
        fractions = await asyncio.get_running_loop().run_in_executor(
            None, load_balance_peers, size, balancing_bandwidths(bandwidths, private=self.gate.allowed is not None), min_vector_size
        )
        fresh_scale, stale_scale = plan.local_scales(side.peer_id)
        async with enter_asynchronously(side.tensors()) as buffers:
            tensors = self.layout.views(buffers, fragment)
            if plan.with_stale:
                if stale is None or len(stale) != num_tensors:
                    stale = [torch.zeros(shape, dtype=dtype) for shape, dtype in layout]
                else:
                    result.late_consumed = True  # scaled below and overwritten by the all-reduce, in place
                tensors += stale
            with torch.no_grad():
                for i, tensor in enumerate(tensors):
                    scale = fresh_scale if i < num_tensors else stale_scale
                    if scale == 0.0:
                        tensor.zero_()  # not mul_(0): leftovers of a failed round could hold inf
                    else:
                        tensor.mul_(scale)
            self.fault_hook("allreduce_begin")
            _corrupt(tensors, self.fault_hook("corrupt_input"))
            forget = getattr(kwargs["compression"], "forget_sent", None)
            if forget is not None:
                forget()  # what an earlier round left (cut off by its timeout) is owed nothing
            make_runner = self._runner_factory(side, plan, fractions, group_info.group_id, counter, kwargs)
            tolerance = self.tolerance
            limits = None if tolerance is None else sender_limits(plan, carried, self.cfg.norm_outlier_factor,
                                                                  tolerance)
            sparse = bool(getattr(kwargs["compression"], "sparse", False))  # top-k parts: see aggregation_for
            robust = dict(
                sender_weights=plan.fresh_weights(),
                limits=limits,
                screen_weights=plan.screen_weights(),
                method=self.cfg.aggregation_for(sparse=sparse),
                norm_factor=self.cfg.norm_outlier_factor,
                banned=frozenset(self.gate.banned),
            )
            bounds = None if limits is None or tolerance is None else tuple(
                output_bound([limit[region] for limit in limits], plan.fresh_weights(), tolerance)
                for region in (0, 1)
            )
            runner = make_runner(
                tensors, b"", fault_hook=self.fault_hook, robust=robust, bounds=bounds,
                fresh_tensors=num_tensors,
            )
            faults = await run_allreduce(runner, tensors)
            rejected.update(runner.rejected())
            reset = getattr(kwargs["compression"], "reset_residuals", None)
            me = side.peer_id.to_base58()
            if reset is not None and me in rejected:
                # our own reducer rejected our part: its error-feedback residual is not sent again
                logger.warning("Our own reducer rejected our part (%s): forgetting the error-feedback residuals",
                               rejected[me])
                reset()
            result.rejected = tuple(self.gate.ban(rejected))
            if self.fault_hook("confirm") is False:
                faults.append("completion denied by the fault hook")
            check = await confirm_complete(make_runner, not faults, plan.peer_ids, side.peer_id, runner)
            result.rejected = tuple(self.gate.ban(rejected | check.equivocators))
            await _settle_credit(kwargs["compression"], tensors[:num_tensors],
                                 not faults and check.confirmed and me not in rejected
                                 and not (abandoned is not None and abandoned()))
        result.allreduce_seconds = time.monotonic() - began
        result.bytes_sent, result.bytes_received = counter.sent, counter.received
        if faults:
            return result.skip("partial all-reduce: " + "; ".join(faults))
        if not check.confirmed:
            return result.skip(check.detail)
        result.outcome, result.reason = Outcome.AVERAGED, ""
        if plan.with_stale:
            result.stale_term = list(stale)
        return result

    def _warm_carried(self, compression: Any) -> None:
        """Compute the carried norm the next round announces now that this one ended, off the loop, while the
        trainer works: the next round's search then finds it cached instead of waiting a top-k pass over the
        residuals (about 30 ns a value: 30 s at 1B parameters). Never raises."""
        carried = getattr(compression, "carried_norm", None)
        if carried is None:
            return
        try:
            future = asyncio.get_running_loop().run_in_executor(None, carried)
        except RuntimeError as e:  # the loop is closing
            logger.debug("Could not start computing the carried norm: %r", e)
            return
        self._warming.add(future)
        future.add_done_callback(self._warmed)

    def _warmed(self, future: asyncio.Future[Any]) -> None:
        self._warming.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.warning("Could not compute the carried norm: %r", future.exception())

    def _codec(self, allreduce_kwargs: dict[str, Any], fragment: int) -> dict[str, Any]:
        """hivemind's all-reduce options with the codec of ``fragment``: the averager's own without fragments;
        with them, one copy per fragment, made from the averager's before its first round (so with no
        residual yet): a codec's error-feedback residuals are keyed by tensor index and part, which the
        fragments share, and each fragment must carry its own (``core.fragments``)."""
        base = allreduce_kwargs["compression"]
        if not self.layout.flat:
            return allreduce_kwargs
        if not self._codecs:
            self._codecs = [base] + [copy.deepcopy(base) for _ in range(1, self.layout.count)]
            for f, codec in enumerate(self._codecs):
                if getattr(codec, "feedback_tensors", None) is not None:
                    codec.feedback_tensors = len(self.layout.layout(f))
        return dict(allreduce_kwargs, compression=self._codecs[fragment])

    @staticmethod
    def _runner_factory(
        side: HivemindSide, plan: GroupPlan, fractions: Sequence[float], group_id: bytes, counter: ByteCounter, kwargs: dict
    ) -> RunnerFactory:
        def make(tensors: Sequence[torch.Tensor], suffix: bytes, **overrides: Any) -> CountingAllReduceRunner:
            options: dict[str, Any] = dict(
                p2p=side.p2p,
                servicer_type=side.servicer_type,
                prefix=side.prefix,
                tensors=tensors,
                group_id=group_id + suffix,
                ordered_peer_ids=plan.peer_ids,
                peer_fractions=tuple(fractions),
                weight=1.0,
                counter=counter,
                compression=kwargs["compression"],
                part_size_bytes=kwargs["part_size_bytes"],
                sender_timeout=kwargs["sender_timeout"],
                reducer_timeout=kwargs["reducer_timeout"],
            )
            options.update(overrides)
            runner = CountingAllReduceRunner(**options)
            registry.set_runner(side.groups, group_id + suffix, runner)
            return runner

        return make
