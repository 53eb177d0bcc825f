"""``run_peer``: train with a p2p_diloco swarm.

- no arguments: start a new swarm on the embedded defaults (tiny model, embedded corpus) and print how
  others join;
- ``--initial-peers MADDR ...``: join an existing swarm;
- ``doctor [same flags]``: check that joining would work, without training (:mod:`p2p_diloco.cli.doctor`);
- ``export [same flags] --output DIR``: the model as a Hugging Face folder (:mod:`p2p_diloco.cli.export`);
- ``eval [same flags]``: loss and perplexity on the held-out split (:mod:`p2p_diloco.cli.evaluate`);
- ``plot LOGFILE...``: round logs (``--log-file``) to a PNG (:mod:`p2p_diloco.cli.plot`).

Under ``torchrun --nproc-per-node N $(which run_peer) ...`` the N processes are one peer: a multi-GPU node
(:mod:`p2p_diloco.peer.node_session`). Every rank runs the loop below; rank 0 alone talks to the swarm,
prints, logs, serves metrics and writes checkpoints.

The training loop below is plain PyTorch (``InnerTrainer``); the swarm is reached only through the
``SwarmSession`` contract.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

from p2p_diloco.build import build_local, build_model_and_tokenizer
from p2p_diloco.checkpoint import CheckpointError, DamagedCheckpointError, load_latest, set_aside
from p2p_diloco.cli.common import make_parser, parse_config, setup_logging, usage_error
from p2p_diloco.cli.open_files import raise_open_files_limit
from p2p_diloco.config_loader import to_dict
from p2p_diloco.data.sources import DataSourceError
from p2p_diloco.host_memory import return_freed_memory, threshold_for
from p2p_diloco.models import ModelLoadError, count_parameters, model_fingerprint
from p2p_diloco.monitoring import PeerMetrics, ProgressDisplay
from p2p_diloco.monitoring.tracking import ExperimentTracker, TrackingError
from p2p_diloco.peer.config import PeerConfig
from p2p_diloco.peer.faults import NO_FAULTS, FaultPlan
from p2p_diloco.peer.node import NodeError, NodeGroup, NodeLaunch
from p2p_diloco.peer.node_model import NodeModel
from p2p_diloco.peer.node_session import NodeSession
from p2p_diloco.peer.report import Outcome
from p2p_diloco.peer.resume import save_session, state_dict_of
from p2p_diloco.peer.runlog import RunLog
from p2p_diloco.peer.session import SwarmSession
from p2p_diloco.peer.streaming_session import StreamingSession
from p2p_diloco.swarm import SwarmStartError
from p2p_diloco.trainer import place_model

logger = logging.getLogger(__name__)
PROG = "run_peer"
SUBCOMMANDS = {"doctor": "p2p_diloco.cli.doctor", "export": "p2p_diloco.cli.export",
               "eval": "p2p_diloco.cli.evaluate", "plot": "p2p_diloco.cli.plot"}
"""``run_peer NAME ...`` runs the module's ``main`` with the remaining arguments."""


class Stop(BaseException):
    """SIGINT/SIGTERM: leave the swarm cleanly. A BaseException (like KeyboardInterrupt), so that no
    ``except Exception`` it passes through, such as a round's failure handling, swallows it: the handler
    ignores further signals, so a swallowed Stop would leave the peer running."""


def _raise_stop(*_: object) -> None:
    # Only the first signal interrupts; shutting down must not be interrupted in turn.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise Stop()


def _load_resume(cfg: PeerConfig, fingerprint: str):
    if not cfg.run.resume:
        return None
    try:
        ck = load_latest(cfg.run.checkpoint_dir)
    except DamagedCheckpointError as e:
        if not cfg.run.start_fresh:
            usage_error(PROG, f"{e}. Nothing was changed: restore it from a backup, or pass --start-fresh to "
                              "keep it aside (renamed damaged-ckpt-*) and start without it")
        _set_aside(e.damaged)
        logger.info("Starting without a checkpoint (--start-fresh)")
        return None
    except CheckpointError as e:
        usage_error(PROG, str(e))
    if ck is None:
        logger.info("No checkpoint in %s yet; starting without one", cfg.run.checkpoint_dir)
        return None
    checks = [("run_id", cfg.run.run_id), ("fingerprint", fingerprint)]
    if "seq_len" in ck.manifest:  # not in the fingerprint (no parameter depends on it); older checkpoints lack it
        checks.append(("seq_len", cfg.model.seq_len))
    for key, ours in checks:
        if ck.manifest.get(key) != ours:
            usage_error(PROG, f"checkpoint {ck.path} belongs to {key} {ck.manifest.get(key)!r}, not {ours!r}; "
                              "use another --checkpoint-dir or the matching --run-id/--model/--seq-len")
    _set_aside(ck.skipped)
    return ck


def _set_aside(damaged: Sequence[tuple[Path, str]]) -> None:
    """Rename damaged checkpoints out of the way of later saves (one of the same epoch would replace them)."""
    for path, reason in damaged:
        logger.warning("Damaged checkpoint %s (%s) kept as %s", path, reason, set_aside(path))


class _NodeExit:
    """Whether this process became a rank of a node (then it leaves through :func:`_exit_node`)."""

    started = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the peer; a rank of a node ends with ``os._exit`` once everything is closed (see :func:`_exit_node`)."""
    try:
        code = _main(argv)
    except SystemExit as e:
        if not _NodeExit.started:
            raise
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        if not _NodeExit.started:
            raise
        traceback.print_exc()
        code = 1
    if _NodeExit.started:
        _exit_node(code)
    return code


def _exit_node(code: int) -> None:
    """Leave a node's rank without interpreter finalization.

    By now the swarm session and the run log are closed and no collective is pending. What finalization would
    still do is free the DDP reducer and the process group, which joins gloo's worker thread while holding the
    GIL; that thread, releasing the tensors of a finished collective, may be waiting for the GIL: the rank hung
    at exit now and then in this project's CPU tests, and torchrun waited for it.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    parser = make_parser(PROG, "Train a language model together with a p2p_diloco swarm. Subcommands: "
                               "doctor, export, eval, plot (run_peer SUBCOMMAND --help).", PeerConfig)
    cfg, args = parse_config(parser, PeerConfig, argv)
    setup_logging(args.verbose)
    raise_open_files_limit()  # before any child process: they inherit it (see cli.open_files)
    # Before the model exists and the swarm's processes are forked; the threshold by where the step runs (see
    # host_memory). A device this machine lacks is refused later, with the node's own message.
    requested = cfg.inner.device
    on_cuda = requested.startswith("cuda") or (requested == "auto" and torch.cuda.is_available())
    return_freed_memory(threshold_for("cuda" if on_cuda else "cpu"))
    cfg, group = _join_node(cfg)
    lead = group is None or group.lead  # rank 0 of a node (or a one-GPU peer) prints, logs and checkpoints
    ranks = group.world_size if group else 1  # each rank trains on its own --batch-size
    runlog = RunLog(cfg.run.log_file if lead else None)
    try:
        tokenizer, model = build_model_and_tokenizer(cfg)
    except (ModelLoadError, ValueError) as e:
        usage_error(PROG, str(e))
    fingerprint = model_fingerprint(model, cfg.model.model)
    ck = _load_resume(cfg, fingerprint) if lead else None
    try:
        faults = FaultPlan.from_env(lambda action, epoch: runlog.write("fault", action=action, epoch=epoch))
    except ValueError as e:
        usage_error(PROG, str(e))
    display = ProgressDisplay.for_terminal(sys.stdout, log_file=cfg.run.log_file,
                                           tokens_per_step=cfg.inner.batch_size * cfg.model.seq_len * ranks)
    if group is None and cfg.outer.fragments > 1:
        try:
            session = StreamingSession(cfg, list(model.parameters()), fingerprint,
                                       names=[name for name, _ in model.named_parameters()], listeners=[display],
                                       faults=faults or NO_FAULTS)
        except ValueError as e:
            usage_error(PROG, str(e))
        try:
            place_model(model, cfg.inner)
        except ValueError as e:
            usage_error(PROG, str(e))
    elif group is None:
        session = SwarmSession(cfg, list(model.parameters()), fingerprint, listeners=[display],
                               faults=faults or NO_FAULTS)
        # On its device before session.start() forks the swarm's processes (see SwarmSession.start), and only
        # after the session took its fp32 anchors from the weights as built (a bf16 cast first would round them).
        try:
            place_model(model, cfg.inner)
        except ValueError as e:
            usage_error(PROG, str(e))
    elif cfg.outer.fragments > 1:
        usage_error(PROG, "--fragments: a node of several GPUs does not synchronise fragments yet; run it with "
                          "--fragments 1, or each GPU as a peer of its own")
    else:
        try:
            node_model = NodeModel(model, cfg.node.parallel, group)
        except NodeError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
            return 1
        except ValueError as e:
            usage_error(PROG, str(e))
        model = node_model.module  # what this rank trains: a DDP replica or its FSDP2 shards
        swarm_session = SwarmSession(cfg, node_model.full, fingerprint, listeners=[display],
                                     faults=faults or NO_FAULTS) if lead else None
        session = NodeSession(cfg, group, node_model, swarm_session)
    if ck is not None:
        try:
            session.load_state_dict(state_dict_of(ck))
        except ValueError as e:
            usage_error(PROG, f"checkpoint {ck.path} cannot be resumed: {e}; use another --checkpoint-dir")
    metrics = _start_metrics(cfg, session) if cfg.run.metrics_port and lead else None
    tracker: ExperimentTracker | None = None
    try:
        try:
            how = session.start()
        except SwarmStartError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 1
        # Only now: the DHT and averager processes are forked by start(), and a child that inherited this
        # handler would ignore the SIGTERM its parent's shutdown sends it, and outlive the peer.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _raise_stop)
        tracker = _start_tracking(cfg, session) if lead else None
        try:
            local = build_local(cfg, session.data_id, session.data_position, parts=(tokenizer, model))
        except (DataSourceError, ValueError) as e:
            usage_error(PROG, str(e))
        session.bind_data(local.stream)
        trainer = local.trainer
        trainer.resume_at(session.inner_step)
        if metrics:
            metrics.set_peer_id(session.peer_id)
            metrics.inner_steps_total(trainer.step_count)
        if not lead:
            print(f"node {how}: training on {trainer.device}", flush=True)
        elif group is not None:
            print(f"peer {session.peer_id}: a node of {group.world_size} ranks ({cfg.node.parallel}), "
                  f"{count_parameters(model):,}-parameter {cfg.model.model} on {trainer.device}, run "
                  f"{cfg.run.run_id!r}, {how}", flush=True)
        else:
            print(f"peer {session.peer_id}: {count_parameters(model):,}-parameter {cfg.model.model} on "
                  f"{trainer.device}, run {cfg.run.run_id!r}, {how}", flush=True)
        if lead and cfg.outer.choice is not None:
            print(cfg.outer.choice.describe(), flush=True)
        if lead and cfg.swarm.client_mode:  # nobody can dial it, so its addresses are no use to others
            print("client mode: others join through the run's full peers or bootstrap nodes, not this peer",
                  flush=True)
        elif lead:
            print(f"others join with: run_peer --run-id {cfg.run.run_id} --model {cfg.model.model} "
                  f"--initial-peers {' '.join(session.visible_maddrs()[:2])}", flush=True)
        runlog.write("start", peer_id=session.peer_id, epoch=session.epoch, how=how, config=to_dict(cfg),
                     maddrs=session.visible_maddrs(), params_sha256=session.params_sha256(), node_ranks=ranks)
        if cfg.run.eval_every:  # 0: no evaluation at all
            eval_loss = trainer.evaluate(local.eval_batches)
            runlog.write("eval", peer_id=session.peer_id, epoch=session.epoch, eval_loss=eval_loss)
            if metrics:
                metrics.eval(eval_loss, session.epoch)
            if tracker:
                tracker.eval(eval_loss, session.epoch)
            if lead:
                print(f"epoch {session.epoch}: eval loss {eval_loss:.4f}", flush=True)

        def on_saved(epoch: int, seconds: float) -> None:  # on the checkpoint writer's thread
            runlog.write("checkpoint", peer_id=session.peer_id, epoch=epoch, checkpoint_seconds=seconds)
            if metrics:
                metrics.checkpoint_saved()

        while not session.done:
            session.begin_round()
            steps = session.local_steps()
            stats = trainer.train_steps(steps, session.on_inner_step)
            report = session.end_round(stats)
            # every eval_every rounds, and after a run's last round (whatever the cadence, its final loss)
            evaluated = cfg.run.eval_every and (session.rounds_done % cfg.run.eval_every == 0 or session.done)
            eval_loss = trainer.evaluate(local.eval_batches) if evaluated else float("nan")
            if metrics and evaluated:
                metrics.eval(eval_loss, session.epoch)
            if tracker and evaluated:
                tracker.eval(eval_loss, session.epoch)
            runlog.write("round", peer_id=session.peer_id, eval_loss=eval_loss, **report.as_dict())
            if lead:
                print(f"epoch {report.epoch} -> {report.new_epoch}: {report.outcome} (group {report.group_size}), "
                      f"{report.inner_steps} steps, train {report.train_loss:.4f}"
                      + (f", eval {eval_loss:.4f}" if evaluated else "")
                      + f", all-reduce {report.allreduce_seconds:.1f}s"
                      + (f" [{report.reason}]" if report.reason and report.outcome is not Outcome.AVERAGED else ""),
                      flush=True)
            else:  # the digest every rank checked against rank 0's (the test of a node reads it)
                print(f"node rank {group.rank}: epoch {report.epoch} -> {report.new_epoch}: {report.outcome}, "
                      f"params sha256 {report.params_sha256}", flush=True)
            if cfg.run.checkpoint_dir and session.rounds_done % cfg.run.checkpoint_every == 0:
                save_session(session, on_saved)
    except Stop:
        display.clear()
        print("stopping" if group is None else f"node rank {group.rank}: stopping", flush=True)
    except (NodeError, SwarmStartError) as e:  # SwarmStartError: the averager process died mid-run
        display.clear()
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        if group is None or not group.is_collective_failure(e):
            raise
        display.clear()  # DDP's or FSDP2's own collective, during an inner step
        print(f"{PROG}: error: {group.failure('training', e)}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        session.close()
        runlog.close()
        if tracker:
            tracker.close()
    return 0


def _join_node(cfg: PeerConfig) -> tuple[PeerConfig, NodeGroup | None]:
    """Under torchrun (``WORLD_SIZE`` > 1): this rank's device (``cuda:LOCAL_RANK``, or the CPU with gloo)
    and the node's process group. A plain process: ``cfg`` unchanged and no group."""
    try:
        launch = NodeLaunch.from_env()
    except ValueError as e:
        usage_error(PROG, str(e))
    if launch is None:
        return cfg, None
    requested = cfg.inner.device
    if requested == "mps" or (requested.startswith("cuda:")):
        usage_error(PROG, f"--device {requested} cannot be used by a node of {launch.world_size} ranks: each rank "
                          "uses cuda:LOCAL_RANK (pass --device cuda or auto, and CUDA_VISIBLE_DEVICES to pick GPUs), "
                          "or --device cpu")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available() or launch.local_rank >= torch.cuda.device_count():
            usage_error(PROG, f"node rank {launch.rank} needs cuda:{launch.local_rank} but this machine shows "
                              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s); "
                              "lower torchrun's --nproc-per-node or pass --device cpu")
        device = torch.device(f"cuda:{launch.local_rank}")
    else:
        device = torch.device("cpu")
    cfg = dataclasses.replace(cfg, inner=dataclasses.replace(cfg.inner, device=str(device)))
    _NodeExit.started = True
    try:
        group = NodeGroup(launch, device, cfg.node.timeout_s)
    except NodeError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    logger.info("Node rank %d of %d (%s, %s)", launch.rank, launch.world_size, group.backend, cfg.node.parallel)
    return cfg, group


def _start_tracking(cfg: PeerConfig, session: SwarmSession) -> ExperimentTracker | None:
    """W&B and/or TensorBoard (--wandb-project, --tensorboard-dir) as a listener of the session.

    Started after the session: its DHT and averager processes are forked by then, before the trackers'
    threads and W&B's service process exist.
    """
    try:
        tracker = ExperimentTracker.from_config(cfg.tracking, cfg.run.run_id, to_dict(cfg))
    except TrackingError as e:
        usage_error(PROG, str(e))
    if tracker is not None:
        tracker.set_peer_id(session.peer_id)
        session.add_listener(tracker)
    return tracker


def _start_metrics(cfg: PeerConfig, session: SwarmSession) -> PeerMetrics:
    """Serve this peer's Prometheus metrics on --metrics-port and let them observe the session."""
    metrics = PeerMetrics(run_id=cfg.run.run_id, model=cfg.model.model, codec=cfg.outer.compression,
                          served_downloads=lambda: session.served_downloads)
    try:
        metrics.serve(cfg.run.metrics_port)
    except OSError as e:
        usage_error(PROG, f"cannot serve metrics on port {cfg.run.metrics_port}: {e.strerror or e}; "
                          "pick a free --metrics-port")
    session.add_listener(metrics)
    logger.info("Prometheus metrics on http://0.0.0.0:%d/metrics", cfg.run.metrics_port)
    return metrics


if __name__ == "__main__":
    sys.exit(main())
