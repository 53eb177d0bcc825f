"""Experiment tracking: every round's record to Weights & Biases and/or TensorBoard.

``run_peer --wandb-project NAME`` and/or ``--tensorboard-dir DIR`` add an :class:`ExperimentTracker` to the
session's listeners. After every round it logs, at step = this peer's round number:

- ``train/loss`` (mean inner loss of the round) and, when the peer evaluated, ``eval/loss`` and
  ``eval/perplexity``;
- ``round/epoch``, ``round/group_size``, ``round/inner_steps``, ``round/max_staleness`` (of the work
  folded in), ``round/late_folded``, ``round/rejected``, and one ``outcome/NAME`` series per outcome
  (1 for the round's outcome, 0 for the others, so a chart of their sums counts outcomes);
- ``net/bytes_sent``, ``net/bytes_received``, ``time/allreduce_s``, ``time/blocked_s``, ``time/inner_s``;
- ``perf/utilization``: inner-phase seconds over the round's wall-clock seconds (from the end of the
  previous round, or the start of training), the share of time the accelerator trained;
  ``perf/tokens_per_s``.

One W&B run per peer, grouped by the run id (so the peers of a run sit together) and named after the peer
id; one TensorBoard sub-folder per peer id under ``--tensorboard-dir`` (point TensorBoard at the folder to
compare peers). The packages are optional: ``pip install 'p2p-diloco[tracking]'``. W&B reads its own
settings from the environment (``WANDB_API_KEY``, ``WANDB_MODE=offline`` to log without an account and
``wandb sync`` later, ``WANDB_DIR``).

Logging runs on the training thread once per round; both libraries hand the write to a background
thread or process, so it costs microseconds. A tracker failure is logged, never raised into training.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from p2p_diloco.config import TrackingConfig
from p2p_diloco.inner_stats import InnerStats
from p2p_diloco.peer.report import Outcome, RoundReport, SessionListener

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'p2p-diloco[tracking]' (or pip install wandb tensorboard)"


class TrackingError(RuntimeError):
    """A tracker cannot start (package missing, folder unwritable, W&B refused); the message says the fix."""


class Backend(Protocol):
    def start(self, peer_id: str) -> None: ...

    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class WandbBackend:
    """One W&B run per peer; started before the swarm is joined so that a refusal stops nothing."""

    def __init__(self, project: str, entity: str | None, run_id: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise TrackingError(f"--wandb-project needs the wandb package: {INSTALL_HINT}") from None
        try:
            self.run = wandb.init(project=project, entity=entity, group=run_id, job_type="peer", config=config)
        except Exception as e:  # noqa: BLE001 - wandb raises its own errors for login, network, settings
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TrackingError(f"W&B did not start: {first}. Log in (wandb login) or set WANDB_MODE=offline") from None

    def start(self, peer_id: str) -> None:
        self.run.name = f"{self.run.group}-{peer_id[-8:]}"
        self.run.config.update({"peer_id": peer_id}, allow_val_change=True)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardBackend:
    """Scalars into ``DIR/PEER_ID``; the writer opens once the peer id is known."""

    def __init__(self, directory: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrackingError(f"--tensorboard-dir needs the tensorboard package: {INSTALL_HINT}") from None
        self.root = Path(directory).expanduser()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingError(f"--tensorboard-dir {str(self.root)!r}: {e.strerror or e}") from None
        if not os.access(self.root, os.W_OK):
            raise TrackingError(f"--tensorboard-dir {str(self.root)!r} is not writable; pick another folder")
        self._writer_cls = SummaryWriter
        self.writer: Any = None

    def start(self, peer_id: str) -> None:
        self.writer = self._writer_cls(log_dir=str(self.root / (peer_id or "peer")))

    def log(self, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            self.start("")
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def round_values(report: RoundReport, stats: InnerStats, wall_seconds: float | None) -> dict[str, float]:
    """The scalars of one round (NaN losses of an empty phase are left out, not logged as NaN)."""
    values: dict[str, float] = {
        "round/epoch": report.new_epoch,
        "round/group_size": report.group_size,
        "round/inner_steps": report.inner_steps,
        "round/max_staleness": max(report.staleness, default=0),
        "round/late_folded": report.late_folded,
        "round/rejected": len(report.rejected),
        "net/bytes_sent": report.bytes_sent,
        "net/bytes_received": report.bytes_received,
        "time/inner_s": report.inner_seconds,
        "time/allreduce_s": report.allreduce_seconds,
        "time/blocked_s": report.blocked_seconds,
        "perf/tokens_per_s": stats.tokens_per_second,
    }
    values.update({f"outcome/{o.value}": float(report.outcome is o) for o in Outcome})
    if math.isfinite(report.train_loss):
        values["train/loss"] = report.train_loss
    if wall_seconds and wall_seconds > 0:
        values["perf/utilization"] = min(1.0, report.inner_seconds / wall_seconds)
    return values


class ExperimentTracker(SessionListener):
    """Sends each round's record to the configured backends (see the module docstring).

    Args:
        backends: started trackers (:class:`WandbBackend`, :class:`TensorBoardBackend`).
        clock: monotonic seconds, for the utilization's wall-clock time (tests pass a fake one).
    """

    def __init__(self, backends: list[Backend], clock: Callable[[], float] = time.monotonic) -> None:
        self.backends = list(backends)
        self.clock = clock
        self.step = 0
        self._since: float | None = None

    @classmethod
    def from_config(cls, cfg: TrackingConfig, run_id: str, config: dict[str, Any]) -> ExperimentTracker | None:
        """The tracker ``cfg`` asks for, or None; raises :class:`TrackingError` when one cannot start."""
        if not cfg.enabled:
            return None
        backends: list[Backend] = []
        if cfg.tensorboard_dir:
            backends.append(TensorBoardBackend(cfg.tensorboard_dir))
        if cfg.wandb_project:
            backends.append(WandbBackend(cfg.wandb_project, cfg.wandb_entity, run_id, config))
        return cls(backends)

    def set_peer_id(self, peer_id: str) -> None:
        """Name the W&B run and the TensorBoard folder (known once the session started its DHT)."""
        self._each("start", peer_id)

    # ------------------------------------------------------------------ SessionListener

    def status(self, phase: str, epoch: int) -> None:
        if phase == "training" and self._since is None:
            self._since = self.clock()

    def round(self, report: RoundReport, stats: InnerStats) -> None:
        now = self.clock()
        wall = now - self._since if self._since is not None else None
        self._since = now
        self.step += 1
        self._each("log", round_values(report, stats, wall), self.step)

    # ------------------------------------------------------------------ called by run_peer

    def eval(self, loss: float, epoch: int) -> None:
        """A held-out evaluation of the parameters of ``epoch`` (logged at the current round's step)."""
        if math.isfinite(loss):
            self._each("log", {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0)),
                               "round/epoch": epoch}, self.step)

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str, *args: Any) -> None:
        for backend in self.backends:
            try:
                getattr(backend, method)(*args)
            except Exception:  # noqa: BLE001 - a tracker's failure must not stop training
                logger.exception("tracker %s.%s failed", type(backend).__name__, method)
