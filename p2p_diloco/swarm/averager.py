"""One round of pseudo-gradient averaging over the swarm: ``RoundAverager.average(...) -> RoundResult``.

A round is: find a group (hivemind matchmaking, gathering every member's ``MemberInfo``), agree on a plan
(``group.plan_group``: compatible members, fresh-only or fresh+stale layout, scales), run hivemind's butterfly
all-reduce over the pre-scaled buffers, then a tiny second all-reduce in the same group, the completion check,
in which every member reports whether its own view of the first one was complete. Only when every member
confirms is the round "averaged"; any failure anywhere makes it "skipped" for everyone who hears of it, so a
partial average is never returned as the full one.

``RoundAverager`` subclasses hivemind's ``DecentralizedAverager`` rather than wrapping it because what it
changes are hooks of that class that run inside its background process: the RPC handlers, the registration
of handlers, shutdown and the command loop. Each such hook is one method here, in this one class, that hands
the work to the ``averager_process.AveragerProcess`` made in that process (``run``): rounds
(``round_process``), access checks (``access``) and state chunks (``chunk_transfer``). The rest of this class
is the training process's side: ``average``, the buffers, bans and the state this peer serves.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind detects streaming RPCs by typing's alias only

import hivemind
import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.compression import CompressionBase, NoCompression
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time

from p2p_diloco.core.bounds import NormTolerance, l2_norm
from p2p_diloco.core.deadlines import ArrivalDeadlines, RoundDeadlines
from p2p_diloco.core.rounds import Outcome, RoundResult
from p2p_diloco.swarm import commands, registry
from p2p_diloco.swarm.access import serve_bounded
from p2p_diloco.swarm.averager_process import AveragerProcess
from p2p_diloco.swarm.buffer_layout import BufferLayout
from p2p_diloco.swarm.chunk_transfer import ServingCounters, request_chunks, request_manifests
from p2p_diloco.swarm.claims import signing_key
from p2p_diloco.swarm.config import SwarmConfig, read_allowed_peers
from p2p_diloco.swarm.group import (
    FINGERPRINT_PATTERN,
    MemberInfo,
    encode_gather,
)
from p2p_diloco.swarm.hivemind_codecs import CodecCompression, wire_norm_tolerance
from p2p_diloco.swarm.patience import JoinTiming
from p2p_diloco.swarm.protocol import averager_prefix
from p2p_diloco.swarm.round_process import HivemindSide, SignedStep
from p2p_diloco.swarm.round_wait import wait_for_round
from p2p_diloco.swarm.runner import (
    FaultHook,
    no_faults,
)
from p2p_diloco.swarm.state import StateProvider
from p2p_diloco.swarm.state_server import state_donors

logger = logging.getLogger(__name__)
_HOST_GRACE_S = 10.0


class RoundAverager(DecentralizedAverager):
    """Averages pseudo-gradients shaped like ``template`` with the peers of one run and model.

    :param template: tensors with the shapes and floating dtypes of the pseudo-gradients (values unused).
    :param dht: this peer's DHT (see ``dht.start_dht``).
    :param cfg: swarm settings; the group sizes and deadlines come from here.
    :param fingerprint: 8-64 lowercase hex characters naming the model (``checksum.layout_fingerprint``).
      It is part of the matchmaking prefix, so peers of another model do not even match, and it is checked
      again in the gathered metadata. So is the protocol version (``swarm.protocol``): peers of another
      release neither match nor find each other's state nor call each other's RPCs.
    :param compression: hivemind codec for the all-reduce parts (default: none). Pre-scaled values are about
      the size of the weighted mean, so relative-error codecs (fp16, 8-bit) behave as on plain gradients.
    :param fault_hook: test-only, see ``runner.FaultHook``.
    :param fragments: Streaming DiLoCo's fragments (``core.fragments.assign_fragments``: the parameter indices of
      each): every round then averages one fragment, named in :meth:`average`, and the shared buffer holds only
      the largest one (``buffer_layout.BufferLayout``). ``None``: the whole model every round.

    Memory: one shared-memory buffer the size of ``template`` (the fresh pseudo-gradient; write it there
    directly with :meth:`fresh_buffers` to save a copy), or of its largest fragment. A round that folds late work creates a second one for
    that round only (in shared memory, dropped when the caller drops the result's ``stale_term``).
    ``average(..., copy_out=False)`` returns views of the shared buffer instead of a copy. Only one
    ``average`` call may run at a time.
    """

    def __init__(
        self,
        template: Sequence[torch.Tensor],
        dht: hivemind.DHT,
        cfg: SwarmConfig,
        *,
        fingerprint: str,
        compression: CompressionBase | None = None,
        fault_hook: FaultHook | None = None,
        fragments: Sequence[Sequence[int]] | None = None,
        start: bool = True,
    ):
        if not template:
            raise ValueError("template must hold at least one tensor")
        if not all(t.is_floating_point() for t in template):
            raise ValueError("pseudo-gradients must have floating-point dtypes")
        if not isinstance(fingerprint, str) or not FINGERPRINT_PATTERN.fullmatch(fingerprint):
            raise ValueError(f"fingerprint must be 8-64 lowercase hex characters, got {fingerprint!r}")
        self.cfg, self.fingerprint, self._claim_key = cfg, fingerprint, signing_key(dht)  # signs our metadata
        self.layout = BufferLayout.of(template, fragments)
        """Which tensors a round averages and where they lie in the shared buffer (whole model or a fragment)."""
        buffers = self.layout.make_buffers()
        self._fault_hook: FaultHook = fault_hook or no_faults
        self._tolerance = codec_tolerance(compression if compression is not None else NoCompression())
        if isinstance(compression, CodecCompression):
            # error feedback for the fresh region only: late work is sent once, and a residual for the late
            # region would be a second model-sized buffer kept for the run (docs/architecture.md, "Memory");
            # with fragments, each fragment's codec is a copy of this one (``AveragerProcess``)
            compression.feedback_tensors = len(self.layout.layout(0))
        self.allowed = read_allowed_peers(cfg.allowed_peers) if cfg.allowed_peers else None
        """A private swarm's members (``SwarmConfig.allowed_peers``), ``None``: anyone."""
        self._join_timing = JoinTiming(cfg.request_timeout_s)  # this side's deadlines; the process has its own
        self.counters = ServingCounters()
        """What both processes know of the state this peer serves (shared memory, made before the fork)."""
        self._state_provider: StateProvider | None = None
        self._process: AveragerProcess | None = None
        """The averager process's side, made there by :meth:`run`; ``None`` in the training process."""
        # lives on the caller's side: it learns from the results ``average`` returns
        self.deadlines = ArrivalDeadlines(
            window_ceiling_s=cfg.matchmaking_time_s,
            request_timeout_s=cfg.request_timeout_s,
            allreduce_ceiling_s=cfg.allreduce_timeout_s,
            next_chunk_timeout_s=cfg.next_chunk_timeout_s,
            adaptive=cfg.adaptive_deadlines,
        )
        super().__init__(
            buffers,
            dht,
            start=False,
            prefix=averager_prefix(cfg.run_id, fingerprint) + self.layout.tag,
            target_group_size=cfg.target_group_size,
            min_group_size=cfg.min_group_size,
            # hivemind waits at least this long in every window; the learned window lies between it and
            # matchmaking_time_s (see core.deadlines)
            min_matchmaking_time=self.deadlines.window.floor if cfg.adaptive_deadlines else cfg.matchmaking_time_s,
            request_timeout=cfg.request_timeout_s,
            allreduce_timeout=cfg.allreduce_timeout_s,
            next_chunk_timeout=cfg.next_chunk_timeout_s,
            compression=compression if compression is not None else NoCompression(),
            part_size_bytes=cfg.part_size_bytes,
            bandwidth=cfg.bandwidth_mbps,
            client_mode=cfg.client_mode,
            allow_state_sharing=False,
            declare_state_period=cfg.declare_state_period_s,
            shutdown_timeout=cfg.shutdown_timeout_s,
        )
        if start:
            self.run_in_background(await_ready=True, timeout=cfg.startup_timeout_s)
            self._block_command_pipe()

    def _block_command_pipe(self) -> None:
        """Make the averager process's reads of its command pipe blocking again (call once it is ready).

        hivemind's averager process watches its end of the pipe with its event loop's ``add_reader``, and uvloop
        (libuv) sets that descriptor non-blocking. Python's ``Connection`` writes a message above 16 KiB as two
        writes, length then payload, and the reader, woken by the length, then finds the payload not there yet:
        ``BlockingIOError``, which hivemind logs and skips, leaving the pipe mid-message; the next read unpickles
        garbage and the averager's thread dies (``EOFError``). Messages that large are ordinary: the download's
        destination tensors and chunk digests, a fold round's late-work tensors. Measured: a 77 KB command lost
        the averager on the first try, and joiners of the memory benchmark (``small`` preset) lost theirs in 2 of
        3 downloads. The flag belongs to the pipe's open file, which this process shares with the averager
        process, so clearing it here fixes the reads there. Blocking costs nothing: the reader reads only after
        ``poll()`` said a message began, and the rest follows at once."""
        os.set_blocking(self._inner_pipe.fileno(), True)

    # ---------------------------------------------------------------- averager process (hivemind's hooks)

    def run(self) -> None:
        """``multiprocessing.Process.run``, in the averager process: make its side first, then hivemind's loop."""
        self._process = AveragerProcess(
            self.cfg, self.peer_id.to_base58(), self.layout, self.allowed, self._tolerance, self.counters,
            host_state=self._get_current_state_from_host_process,
            sharing=lambda: self.allow_state_sharing,
            stub=lambda peer: self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix),
            fault_hook=self._fault_hook,
        )
        super().run()

    def _side(self) -> AveragerProcess:
        if self._process is None:
            raise RuntimeError("the averager process's side is used outside the averager process")
        return self._process

    def _hivemind_side(self) -> HivemindSide:
        """What a round uses of hivemind's side of this averager, as hivemind's loop has set it up."""
        return HivemindSide(
            peer_id=self.peer_id, matchmaking=self._matchmaking, p2p=self._p2p, prefix=self.prefix,
            servicer_type=type(self), tensors=self.get_tensors, allreduce_kwargs=self.allreduce_kwargs,
            allreduce_timeout=self._allreduce_timeout, groups=self._running_groups,
            pending=self._pending_groups_registered, claim_key=self._claim_key,
        )

    async def _run_command(self, command: commands.Command) -> None:
        """Run one command from the training process (``swarm.commands``)."""
        await self._side().run_command(command, self._hivemind_side)

    async def add_p2p_handlers(self, p2p: P2P, wrapper: Any = None, *, namespace: str | None = None,
                               balanced: bool = False) -> None:
        """hivemind's registration of every ``rpc_*`` handler, then the one-request ones bounded
        (``access.serve_bounded``)."""
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)
        await serve_bounded(p2p, type(self), self if wrapper is None else wrapper, namespace=namespace,
                            balanced=balanced, wait_s=self.cfg.request_timeout_s)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking, gated (``AveragerProcess.join_group``)."""
        async for message in self._side().join_group(request, context, getattr(self, "_matchmaking", None),
                                                        super().rpc_join_group):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's part exchange, gated (``AveragerProcess.aggregate_part``)."""
        async for message in self._side().aggregate_part(stream, context, super().rpc_aggregate_part):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's whole-state stream: closed. Joiners fetch chunks (``rpc_state_chunk``), each verified on
        receipt; a second way to pull the whole model would only be a second way to load this peer."""
        return
        yield  # an async generator that yields nothing

    async def rpc_state_chunk(self, request: averaging_pb2.DownloadData, context: P2PContext
                              ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """A state chunk or manifest (``AveragerProcess.state_chunk``)."""
        async for message in self._side().state_chunk(request, context):
            yield message

    def shutdown(self) -> None:
        """hivemind's shutdown, quiet when the averager process has stopped already.

        A SIGTERM sent to the whole process group (systemd, ``docker stop`` with an init, a terminal's
        Ctrl+C) reaches the averager process too, and it may be gone before the host's own shutdown runs;
        hivemind logs that as an error with a traceback, which here is the normal way to stop.
        """
        if not self.is_alive():
            logger.debug("The averager process had stopped already")
            return
        super().shutdown()

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind's shutdown, given the runners it expects: our registry holds futures of runners
        (``swarm.registry``), and hivemind's loop over it would fail at the first one."""
        groups, self._running_groups = self._running_groups, {}
        registry.finalize(groups)
        await super()._shutdown(timeout)

    # ---------------------------------------------------------------- state serving (training process)

    def set_state_provider(self, provider: StateProvider | None) -> None:
        """Serve ``provider()`` (metadata dict, tensors) to joiners from now on; ``None`` stops serving."""
        self._state_provider = provider
        self.allow_state_sharing = provider is not None
        self.mark_state_live(provider is not None)

    def get_current_state(self) -> tuple[dict[str, Any], list[torch.Tensor], None]:
        """Called by hivemind in this (host) process when the averager process serves our state."""
        provider = self._state_provider
        if provider is None:
            raise RuntimeError("this peer is not sharing state")
        metadata, tensors = provider()
        return metadata, list(tensors), None

    def mark_state_live(self, live: bool) -> None:
        """The host published a state (True) or withdrew it to change it (False)."""
        if live:
            self.counters.bump_published()
        self.counters.live.value = live

    def bump_state_version(self) -> None:
        self.counters.bump_version()

    def streams_open(self) -> int:
        return int(self.counters.streams_open.value)

    def manifests_served(self) -> int:
        return int(self.counters.manifests_served.value)

    def downloading(self) -> bool:
        return self.counters.downloading()

    def state_donors(self) -> list[tuple[str, float]]:
        """Peers announcing shareable state for this run and model: ``(peer id, priority)``, best first."""
        return state_donors(self.dht, self.prefix, self.peer_id, self.allowed)

    def fetch_manifests(self, peers: Sequence[str], *, timeout: float, max_bytes: int,
                        base: str | None = None) -> dict[str, bytes | str]:
        """Each donor's raw state manifest, or why there is none (``chunk_transfer.request_manifests``)."""
        return request_manifests(self._outer_pipe, peers, timeout=timeout, max_bytes=max_bytes, base=base)

    def fetch_chunks(self, peers: Sequence[str], sha: str, dest: Sequence[torch.Tensor], n_params: int,
                     digests: bytes, have: set[int], partial: Path | None, timeout: float) -> dict[str, Any]:
        """The chunks of state ``sha`` from ``peers``, verified, into ``dest`` (``chunk_transfer.request_chunks``)."""
        return request_chunks(self._outer_pipe, peers, sha, dest, n_params, digests, have, partial, timeout)

    # ---------------------------------------------------------------- host side

    def average(
        self,
        fresh: Sequence[torch.Tensor] | None,
        weight: float,
        staleness: int,
        epoch: int,
        stale: Sequence[torch.Tensor] | None = None,
        stale_weight: float = 0.0,
        due: Collection[str] = (),
        copy_out: bool = True,
        left_behind: Callable[[bool], bool] | None = None,
        step_back: bool = True,
        fragment: int = 0,
        published: Mapping[str, float] | None = None,
    ) -> RoundResult:
        """Run one round and return its result; never raises for network trouble, never blocks past
        ``matchmaking_timeout_s + 2 * request_timeout_s + allreduce_timeout_s`` (plus a few seconds; the
        ``2 * request_timeout_s`` is how long a follower keeps waiting for its leader, see ``patience``).

        :param fresh: this round's pseudo-gradients (theta_start - theta_local), or ``None`` if this peer has
          none (it still receives the group's aggregates).
        :param weight: weight of ``fresh`` in the mean, e.g. samples or tokens processed; 0 means no fresh work.
        :param staleness: age in epochs of ``stale`` (0 when there is none); reported to the group.
        :param epoch: the round's epoch; only members announcing the same epoch are averaged together.
        :param stale: an older pseudo-gradient being folded into this round, or ``None``.
        :param stale_weight: its effective weight (the caller's discount already applied).
        :param due: base58 ids of the peers verified due in this round (``quorum.due_peers`` of the signed
          progress records); when this peer leads and all of them joined, the group forms before the
          ``matchmaking_time_s`` window ends. Empty: the window decides.
        :param step_back: a leader still alone when its first window ends lets the next due peer lead
          (``quorum.EarlyAssembly``); ``False`` when a client-mode peer is due (it could not join such a leader).
        :param copy_out: return the fresh mean as a copy. ``False`` returns views of the shared buffer, valid
          until the next ``average`` or :meth:`fresh_buffers` call: apply them before that (saves a
          model-sized copy per round).
        :param left_behind: asked every ``round_wait.poll_interval`` while no group has formed yet (on this thread,
          which only waits then), with whether the round's matchmaking window is still open; ``True`` asks the
          averager process to give the round up (``Evidence.left_behind``: every peer this one believes is past
          ``epoch``; within the window also ``Evidence.round_over``: each of them finished the round), which it
          does only while no group has formed: the result is then skipped with ``left_behind``, else the
          group's own (see ``round_wait.wait_for_round``). ``None``: wait up to ``matchmaking_timeout_s``.
        :param fragment: with fragments, the one this round averages (``fresh``, ``stale`` and the mean are its
          tensors; ``epoch`` is its epoch); it meets only peers averaging the same fragment at the same epoch.
        :param published: peer id -> its progress record's expiration as read for this round: a peer the last
          round cut that wrote its record again since grows this round's window (``core.deadlines``).
        """
        self.layout.check_fragment(fragment)
        if fresh is not None:
            self.layout.check("fresh", fresh, fragment)
        if stale is not None:
            self.layout.check("stale", stale, fragment)
        # A Byzantine test peer announces the norm of what it will send, as a real attacker could.
        scale = self._fault_hook("announce")
        inflate = abs(scale) if isinstance(scale, float) and math.isfinite(scale) else 1.0
        info = MemberInfo.for_round(
            self.cfg.run_id,
            self.fingerprint,
            self.layout.round_number(epoch, fragment),
            weight,
            stale_weight,
            staleness,
            fresh is not None,
            stale is not None,
            norm=inflate * l2_norm(fresh) if fresh is not None else 0.0,
            stale_norm=inflate * l2_norm(stale) if stale is not None else 0.0,
        )
        has_fresh, has_stale = info.has_fresh, info.has_stale
        budget = (self.cfg.matchmaking_timeout_s + self._join_timing.patience + self.cfg.allreduce_timeout_s
                  + _HOST_GRACE_S)
        if not self.is_alive():
            return RoundResult(Outcome.SKIPPED, "the averager process is not running", epoch)
        with self._locked_buffers(budget) as buffers:
            if buffers is None:
                return RoundResult(Outcome.SKIPPED, "the averaging buffers stayed busy (a previous round runs)", epoch)
            for src, dst in zip(fresh if has_fresh else (), self.layout.views(buffers, fragment), strict=False):
                if src.data_ptr() != dst.data_ptr():  # written in place through fresh_buffers(): no copy
                    dst.copy_(src.detach())
        # The late work goes to shared memory for this round, in place: the averager process maps the caller's
        # own CPU tensors (share_memory_ moves their storage, a tensor at a time) instead of a copy of them,
        # which had put a second model-sized buffer beside the late work for the whole fold round.
        stale_shared = [_shared(src) for src in stale] if has_stale else None
        try:
            deadlines = self.deadlines.next_round(published)
            # signed in the averager process, with what the codec's residuals add (``round_process``)
            gather = encode_gather(self.bandwidth, self.mode, info)
            control = self._begin_step(gather, tuple(due), deadlines, stale_shared, step_back=step_back, epoch=epoch,
                                       fragment=fragment)
        except Exception as e:
            return RoundResult(Outcome.SKIPPED, f"could not start the round: {e!r}", epoch)
        try:
            result = wait_for_round(control, budget, left_behind, after_s=deadlines.window_s, give_up=self._give_up)
        except TimeoutError:
            control.cancel()
            # the averager process may have scaled the late work in place before it went silent
            return RoundResult(Outcome.SKIPPED, f"no answer from the averager within {budget:.0f} s", epoch,
                               late_consumed=has_stale)
        except Exception as e:
            return RoundResult(Outcome.SKIPPED, f"round failed: {e!r}", epoch, late_consumed=has_stale)
        finally:
            del stale_shared
        if result.left_behind:  # no group formed, nothing touched; its wait says nothing of the arrivals
            result.epoch = epoch
            logger.info("Round %d skipped: %s", epoch, result.reason)
            return result
        result.window_s, result.allreduce_deadline_s = deadlines.window_s, deadlines.allreduce_s
        self.deadlines.observe(
            deadlines,
            due_members=result.due_members,
            cut=result.cut_peers,
            members=result.contributors,
            # an early peer that stepped back waited for the others to arrive: no sample of their spread
            wait_s=float("nan") if result.stepped_back else result.wait_seconds,
            due_arrival_s=None if result.stepped_back else result.due_arrival_s,
            allreduce_s=result.allreduce_seconds if result.averaged else None,
            allreduce_timed_out=result.timed_out,
        )
        return self._make_result(result, epoch, budget, copy_out, fragment)

    def _give_up(self) -> None:
        """Ask the averager process to stop looking for the running round's group (``commands.GiveUp``)."""
        commands.send(self._outer_pipe, commands.GiveUp(MPFuture()))

    @contextlib.contextmanager
    def fresh_buffers(self, timeout: float = 0.0, fragment: int = 0) -> Iterator[list[torch.Tensor] | None]:
        """The shared fresh buffers (``fragment``'s views, with fragments), locked, to write this round's
        pseudo-gradient into; then pass them to :meth:`average` as ``fresh`` (no copy is made). ``None`` when a
        round still holds them after ``timeout`` seconds (write the pseudo-gradient elsewhere then)."""
        self.layout.check_fragment(fragment)
        with self._locked_buffers(timeout) as buffers:
            yield None if buffers is None else self.layout.views(buffers, fragment)

    def ban(self, peer_id: str, reason: str) -> MPFuture:
        """Ban ``peer_id`` for the rest of the run in the averager process, where matchmaking, the all-reduce
        and state downloads are served (e.g. for a malformed DHT record it signed). The future resolves once
        the ban applies; a ban while the process is down is dropped with a warning."""
        future: MPFuture = MPFuture()
        if not self.is_alive():
            logger.warning("Could not ban %s: the averager process is not running", peer_id)
            future.set_result(None)
            return future
        commands.send(self._outer_pipe, commands.Ban(peer_id, reason, future))
        return future

    @contextlib.contextmanager
    def _locked_buffers(self, timeout: float) -> Iterator[Sequence[torch.Tensor] | None]:
        if not self.lock_averaged_tensors.acquire(timeout=timeout):
            yield None
            return
        try:
            yield self._averaged_tensors
        finally:
            self.lock_averaged_tensors.release()

    def _begin_step(self, data_for_gather: bytes, due: tuple[str, ...], deadlines: RoundDeadlines,
                    stale: list[torch.Tensor] | None = None, step_back: bool = True,
                    epoch: int | None = None, fragment: int = 0) -> StepControl:
        """hivemind's ``step(wait=False)`` with a bounded hand-shake and no retries inside a round; the
        window and the all-reduce deadline are this round's ``deadlines``, ``stale`` the round's late work,
        ``epoch`` and ``fragment`` pick the round's matchmaking key (``protocol.round_group_bits`` of the round's
        number, ``BufferLayout.round_number``). ``data_for_gather`` is our metadata (``group.encode_gather``),
        unsigned: the averager process signs it with the codec's carried norm (``round_process``)."""
        now = get_dht_time()
        deadline = self._join_timing.deadline(self.cfg.matchmaking_timeout_s)
        control = SignedStep(
            scheduled_time=self._join_timing.scheduled_time(now, deadlines.window_s, deadline, self.cfg.client_mode),
            deadline=deadline,
            allow_retries=False,
            weight=1.0,
            data_for_gather=data_for_gather,
        )
        future_for_init = MPFuture()
        commands.send(self._outer_pipe, commands.Step(control, future_for_init, due, deadlines.allreduce_s, stale,
                                                      step_back, epoch, fragment))
        try:
            trigger, cancel = future_for_init.result(timeout=self.cfg.startup_timeout_s)
        except BaseException:
            # The averager process did not take the step (it is shutting down, or stuck). hivemind's
            # ``StepControl.__del__`` asserts that a trigger is attached, so a control dropped bare prints a
            # traceback at exit; give it spent futures so it dies quietly, and let the caller skip the round.
            trigger, cancel = MPFuture(), MPFuture()
            trigger.set_result(None)
            cancel.set_result(None)
            control.attach(trigger, cancel)
            raise
        control.attach(trigger, cancel)
        control.allow_allreduce()
        return control

    def _make_result(self, result: RoundResult, epoch: int, timeout: float, copy_out: bool = True,
                     fragment: int = 0) -> RoundResult:
        """The averager process's result, for ``epoch``, with the averaged buffers read back if it averaged.
        The stale term (if any) came back inside the result: the round's own shared buffer, no copy."""
        result.epoch = epoch
        if result.refused:
            logger.warning("Round %d: refused group members: %s", epoch, "; ".join(result.refused))
        if result.rejected:
            logger.warning("Round %d: rejected hostile input: %s", epoch, "; ".join(result.rejected))
        if not result.averaged:
            logger.info("Round %d skipped: %s", epoch, result.reason)
            return result
        with self._locked_buffers(timeout) as buffers:
            if buffers is None:
                return result.skip("could not read the averaged buffers back")
            result.fresh_mean = [t.clone() if copy_out else t for t in self.layout.views(buffers, fragment)]
        if result.with_stale and (result.stale_term is None or len(result.stale_term) != len(result.fresh_mean)):
            return result.skip("the averager process returned no stale term")
        if not all(bool(torch.isfinite(t).all()) for t in result.fresh_mean + (result.stale_term or [])):
            # every member validates its own input, so this means a member sent NaN or inf on purpose
            result.skip("the aggregate holds NaN or infinite values")
        return result


def codec_tolerance(compression: CompressionBase) -> float | None:
    """The norm tolerances the round checks use for ``compression`` (``core.bounds.NormTolerance``): the codec's
    plain factor for what is sent (with the carried norm each sender announces, ``core.bounds.fresh_limits``)
    and for the replies; as a float, ``hivemind_codecs.wire_norm_tolerance``, the worst case that caps what a
    sender may announce its error feedback carries."""
    tolerance = wire_norm_tolerance(compression)
    if tolerance is None or not isinstance(compression, CodecCompression):
        return tolerance  # dense: no error feedback, one factor for all
    plain = NormTolerance.of(compression.codec.name, False)
    return NormTolerance(tolerance, plain.plain, plain.reply)


def _shared(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself in shared memory when it is a CPU tensor (moved in place), else a shared CPU copy."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.to("cpu", memory_format=torch.contiguous_format, copy=True)
    return tensor.share_memory_()
