"""Live progress for a volunteer at a terminal, or periodic log lines when nobody watches one.

On a TTY, one line is redrawn in place (at most ``redraw_s`` apart)::

    [training]  epoch 12  step 140/500  loss 3.412  1,830 tok/s  peers 7  all-reduce 4.1s

Without a TTY (output piped, a service, ``--log-file`` given for machines to read) the same fields are
logged every ``log_every_s`` seconds and at each phase change, so logs stay readable and grep-able instead
of filling with carriage returns.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from typing import TextIO

from p2p_diloco.inner_stats import InnerStats
from p2p_diloco.peer.report import RoundReport, SessionListener

logger = logging.getLogger(__name__)


class ProgressDisplay(SessionListener):
    """Phase, step k/H, loss, tokens/s, epoch, peers and the last all-reduce time.

    Args:
        stream: where the live line goes (stdout).
        live: redraw one line in place (a terminal) instead of logging periodic lines.
        tokens_per_step: tokens one inner step trains on (batch size x sequence length), for the live rate.
        redraw_s: minimum seconds between redraws; 0.25 keeps a terminal fluid at negligible cost.
        log_every_s: seconds between plain log lines; 30 gives a few lines per round of typical length.
    """

    def __init__(self, stream: TextIO | None = None, *, live: bool = False, tokens_per_step: int = 0,
                 redraw_s: float = 0.25, log_every_s: float = 30.0,
                 clock=time.monotonic) -> None:
        self.stream = stream or sys.stdout
        self.live = live
        self.tokens_per_step = tokens_per_step
        self.redraw_s = redraw_s
        self.log_every_s = log_every_s
        self.clock = clock
        self.phase = "starting"
        self.epoch = 0
        self.step = 0
        self.total = 0
        self.loss = math.nan
        self.tokens_per_s = math.nan
        self.peers = 0
        self.allreduce_s = math.nan
        self._lock = threading.Lock()
        self._last_draw = -math.inf
        self._width = 0
        self._rate_start: tuple[float, int] | None = None

    @classmethod
    def for_terminal(cls, stream: TextIO, *, log_file: str | None, tokens_per_step: int) -> ProgressDisplay:
        """Live when ``stream`` is a terminal and no ``--log-file`` was asked for; plain lines otherwise."""
        isatty = getattr(stream, "isatty", lambda: False)
        return cls(stream, live=bool(isatty()) and not log_file, tokens_per_step=tokens_per_step)

    def line(self) -> str:
        """The current progress as one line."""
        parts = [f"[{self.phase}]", f"epoch {self.epoch}"]
        if self.total:
            parts.append(f"step {self.step}/{self.total}")
        if math.isfinite(self.loss):
            parts.append(f"loss {self.loss:.3f}")
        if math.isfinite(self.tokens_per_s):
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        parts.append(f"peers {self.peers}")
        if math.isfinite(self.allreduce_s):
            parts.append(f"all-reduce {self.allreduce_s:.1f}s")
        return "  ".join(parts)

    # ------------------------------------------------------------------ SessionListener

    def status(self, phase: str, epoch: int) -> None:
        changed = phase != self.phase
        self.phase, self.epoch = phase, epoch
        if phase == "training":
            self._rate_start, self.step = None, 0
        self._show(force=changed)

    def inner_step(self, step: int, total: int, loss: float, epoch: int) -> None:
        now = self.clock()
        self.step, self.total, self.loss, self.epoch = step, total, loss, epoch
        if self._rate_start is None:
            self._rate_start = (now, step)
        elif self.tokens_per_step and now > self._rate_start[0]:
            t0, s0 = self._rate_start
            self.tokens_per_s = (step - s0) * self.tokens_per_step / (now - t0)
        self._show()

    def round(self, report: RoundReport, stats: InnerStats) -> None:
        self.epoch = report.new_epoch
        if math.isfinite(report.train_loss):
            self.loss = report.train_loss
        if stats.seconds > 0:
            self.tokens_per_s = stats.tokens_per_second
        if report.group_size > 1:
            self.allreduce_s = report.allreduce_seconds
        # run_peer prints a line per round next: leave the live line so that line starts clean.
        self.clear()

    def swarm(self, peers_visible: int, swarm_epoch: int | None) -> None:
        self.peers = peers_visible

    # ------------------------------------------------------------------ output

    def clear(self) -> None:
        """Erase the live line (before other output is printed); no-op in plain mode."""
        if not self.live:
            return
        with self._lock:
            if self._width:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
                self._width = 0
            self._last_draw = -math.inf

    def _show(self, force: bool = False) -> None:
        now = self.clock()
        interval = self.redraw_s if self.live else self.log_every_s
        if not force and now - self._last_draw < interval:
            return
        self._last_draw = now
        text = self.line()
        if not self.live:
            logger.info("progress: %s", text)
            return
        with self._lock:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._width = len(text)
