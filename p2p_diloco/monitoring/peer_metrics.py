"""Per-peer Prometheus metrics: a :class:`SessionListener` that turns what the session does into series.

Served by ``run_peer --metrics-port PORT`` on ``/metrics``. Names follow Prometheus conventions: the
``p2p_diloco_`` prefix, base units in the name (``_seconds``, ``_bytes``), ``_total`` on counters. Every
labelled series whose label values are known in advance (round outcomes, rejection reasons, the codec) is
created at zero when the peer starts, so dashboards and ``rate()`` see it before the first event instead of
an empty result.

Each instance owns its own :class:`~prometheus_client.CollectorRegistry`, so several sessions in one
process (tests) never collide and the endpoint shows only this peer's series (no process collectors of the
default registry mixed in unless asked for).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

from p2p_diloco.core.rounds import Stall
from p2p_diloco.inner_stats import InnerStats
from p2p_diloco.peer.report import Outcome, RoundReport, SessionListener
from p2p_diloco.swarm.signing import REJECTED_RECORD_KINDS

PREFIX = "p2p_diloco_"
OUTCOMES = tuple(o.value for o in Outcome)
STALL_CAUSES = tuple(s.value for s in Stall if s is not Stall.NONE)
PHASES = ("starting", "training", "matchmaking", "averaging", "syncing")

# Seconds: loopback rounds take a few seconds, internet rounds of a 150M model tens to hundreds.
ALLREDUCE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, float("inf"))
WAIT_BUCKETS = ALLREDUCE_BUCKETS
INNER_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 3600, 7200, float("inf"))
STALENESS_BUCKETS = (1, 2, 3, 4, 6, 8, 16, float("inf"))

# Rejection reasons are free text naming peers, epochs and digests; a label per distinct text would grow
# without bound. They are mapped to a fixed set of kinds (first keyword that matches wins).
REJECTION_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("other_run", ("run id", "state of run")),
    ("other_model", ("fingerprint", "model")),
    ("non_finite", ("nan", "infinite", "finite")),
    ("checksum_mismatch", ("checksum", "hash", "sha")),
    ("wrong_epoch", ("epoch",)),
    ("bad_weight", ("weight",)),
    ("bad_shape", ("shape", "dtype", "tensor", "bytes", "size")),
    ("malformed", ("malformed", "metadata", "parse", "schema")),
    ("timeout", ("timeout", "timed out")),
)
REJECTION_REASONS = tuple(kind for kind, _ in REJECTION_KINDS) + ("other",)
RECORD_REJECTION_REASONS = (*REJECTED_RECORD_KINDS, "other")
"""Labels of ``rejected_dht_records``: the kinds of ``swarm.signing`` (unsigned, bad_signature, wrong_owner,
malformed, oversized), "other" for any kind a newer peer version reports."""


def rejection_kind(entry: str) -> str:
    """The label for one ``"peer: reason"`` entry: one of :data:`REJECTION_REASONS`."""
    reason = entry.split(": ", 1)[1] if ": " in entry else entry
    text = reason.lower()
    for kind, keywords in REJECTION_KINDS:
        if any(re.search(rf"\b{re.escape(k)}", text) for k in keywords):
            return kind
    return "other"


class PeerMetrics(SessionListener):
    """Per-peer metrics, updated from session callbacks (cheap: a few dictionary updates each).

    Args:
        peer_id, run_id, model, codec: constant labels of the ``p2p_diloco_peer_info`` series; ``codec`` also
            labels the byte counters (``--compression``).
        served_downloads: returns how many times this peer served its state to a joiner so far (read at
            scrape time; see ``StateServer.served``).
        registry: where the series live; a fresh one by default.
    """

    def __init__(self, *, peer_id: str = "", run_id: str = "", model: str = "", codec: str = "none",
                 served_downloads: Callable[[], int] | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.codec = codec
        self._lock = threading.Lock()
        self._last_checkpoint: float | None = None
        r = self.registry
        self.info = Gauge(PREFIX + "peer_info", "Constant 1, labelled with this peer's identity.",
                          ["peer_id", "run_id", "model", "codec"], registry=r)
        self._identity = (run_id, model, codec)
        self.set_peer_id(peer_id)
        self.phase = Gauge(PREFIX + "phase", "1 for the phase the peer is in now, 0 for the others.",
                           ["phase"], registry=r)
        self.epoch = Gauge(PREFIX + "epoch", "Outer epoch of this peer's parameters (completed rounds).", registry=r)
        self.stalled = Gauge(PREFIX + "swarm_stalled",
                             "1 while rounds skip for a reason no waiting fixes (cause: all_clients, every peer in "
                             "client mode; unreachable, this full peer cannot be dialled); 0 otherwise. The log "
                             "says the fix.", ["cause"], registry=r)
        self.steps = Gauge(PREFIX + "inner_step", "Inner optimizer steps taken (the trainer's counter).",
                           registry=r)
        self.phase_step = Gauge(PREFIX + "phase_step", "Step within the current inner phase.", registry=r)
        self.local_steps = Gauge(PREFIX + "local_steps", "Inner steps DyLU chose for the current phase.", registry=r)
        self.train_loss = Gauge(PREFIX + "train_loss", "Mean training loss of the last inner phase.", registry=r)
        self.step_loss = Gauge(PREFIX + "step_loss", "Training loss of the last inner step.", registry=r)
        self.nonfinite = Counter(PREFIX + "nonfinite_losses", "Inner steps or evaluations whose loss was NaN "
                                 "or infinite (the loss-NaN alert fires on any increase).", registry=r)
        self.eval_loss = Gauge(PREFIX + "eval_loss", "Held-out loss at the last evaluation.", registry=r)
        self.tokens_per_second = Gauge(PREFIX + "tokens_per_second",
                                       "Training throughput of the last inner phase.", registry=r)
        self.tokens = Counter(PREFIX + "tokens_processed", "Tokens trained on by this process.", registry=r)
        self.rounds = Counter(PREFIX + "rounds", "Outer rounds by outcome.", ["outcome"], registry=r)
        self.allreduce_seconds = Histogram(PREFIX + "allreduce_seconds", "All-reduce duration of a round.",
                                           buckets=ALLREDUCE_BUCKETS, registry=r)
        self.wait_seconds = Histogram(PREFIX + "matchmaking_wait_seconds",
                                      "Time spent finding a group before the all-reduce.",
                                      buckets=WAIT_BUCKETS, registry=r)
        self.cut_members = Counter(PREFIX + "matchmaking_cut_members",
                                   "Peers verified due in a round that its group left out (stragglers past "
                                   "the matchmaking window).", registry=r)
        self.window_seconds = Gauge(PREFIX + "matchmaking_window_seconds",
                                    "Matchmaking window of the last round, learned from arrivals within "
                                    "--matchmaking-time-s.", registry=r)
        self.allreduce_deadline_seconds = Gauge(PREFIX + "allreduce_deadline_seconds",
                                                "All-reduce deadline of the last round, learned from past "
                                                "all-reduces within --allreduce-timeout-s.", registry=r)
        self.formed_early = Counter(PREFIX + "matchmaking_formed_early",
                                    "Rounds this peer's group formed before the window ended, every due peer "
                                    "having joined.", registry=r)
        self.blocked_seconds = Histogram(PREFIX + "network_blocked_seconds",
                                         "Time training waited for the network in a round.",
                                         buckets=ALLREDUCE_BUCKETS, registry=r)
        self.inner_seconds = Histogram(PREFIX + "inner_phase_seconds", "Duration of an inner phase.",
                                       buckets=INNER_BUCKETS, registry=r)
        self.sent = Counter(PREFIX + "sent_bytes", "All-reduce payload sent, by codec.", ["codec"], registry=r)
        self.received = Counter(PREFIX + "received_bytes", "All-reduce payload received, by codec.", ["codec"],
                                registry=r)
        self.group_size = Gauge(PREFIX + "group_size", "Members of the last all-reduce group.", registry=r)
        self.late_folded = Counter(PREFIX + "late_contributions_folded",
                                   "Late contributions (any member's) applied in this peer's rounds.", registry=r)
        self.staleness = Histogram(PREFIX + "late_contribution_staleness_rounds",
                                   "Staleness of each late contribution folded in.",
                                   buckets=STALENESS_BUCKETS, registry=r)
        self.peers_visible = Gauge(PREFIX + "peers_visible", "Peers of this run and model visible in the DHT.",
                                   registry=r)
        self.swarm_epoch = Gauge(PREFIX + "swarm_epoch", "Largest epoch peers publish in the DHT.", registry=r)
        self.downloads_received = Counter(PREFIX + "state_downloads_received",
                                          "State downloads by this peer, by result.", ["result"], registry=r)
        r.register(_ServedCollector(served_downloads))
        self.rejected = Counter(PREFIX + "rejected_contributions",
                                "Group members or donors refused, by kind of reason.", ["reason"], registry=r)
        self.rejected_records = Counter(PREFIX + "rejected_dht_records",
                                        "DHT records dropped on receipt or when read, each counted once, by "
                                        "kind (unsigned, bad_signature, wrong_owner, malformed, oversized).",
                                        ["reason"], registry=r)
        self.checkpoint_age = Gauge(PREFIX + "checkpoint_age_seconds",
                                    "Seconds since the last checkpoint was written (NaN before the first).",
                                    registry=r)
        self.checkpoint_age.set_function(self._checkpoint_age)
        self.checkpoints = Counter(PREFIX + "checkpoints_written", "Checkpoints written.", registry=r)
        for outcome in OUTCOMES:
            self.rounds.labels(outcome)
        for phase in PHASES:
            self.phase.labels(phase).set(1 if phase == "starting" else 0)
        for cause in STALL_CAUSES:
            self.stalled.labels(cause).set(0)
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason)
        for reason in RECORD_REJECTION_REASONS:
            self.rejected_records.labels(reason)
        for result in ("ok", "failed"):
            self.downloads_received.labels(result)
        self.sent.labels(codec)
        self.received.labels(codec)
        for gauge in (self.train_loss, self.step_loss, self.eval_loss):
            gauge.set(math.nan)

    # ------------------------------------------------------------------ SessionListener

    def status(self, phase: str, epoch: int) -> None:
        for name in PHASES:
            self.phase.labels(name).set(1 if name == phase else 0)
        self.epoch.set(epoch)

    def inner_step(self, step: int, total: int, loss: float, epoch: int) -> None:
        self.steps.inc()
        self.phase_step.set(step)
        self.local_steps.set(total)
        self.step_loss.set(loss)
        if not math.isfinite(loss):
            self.nonfinite.inc()
        self.epoch.set(epoch)

    def round(self, report: RoundReport, stats: InnerStats) -> None:
        self.rounds.labels(report.outcome).inc()
        self.epoch.set(report.new_epoch)
        stall = str(getattr(report, "stall", ""))
        if report.outcome is not Outcome.SKIPPED or stall:  # a skip for another reason leaves it as it was
            for cause in STALL_CAUSES:
                self.stalled.labels(cause).set(1 if cause == stall else 0)
        self.train_loss.set(report.train_loss)
        self.inner_seconds.observe(max(0.0, report.inner_seconds))
        if stats.tokens:
            self.tokens.inc(stats.tokens)
        if stats.seconds > 0:
            self.tokens_per_second.set(stats.tokens_per_second)
        if report.group_size:
            self.group_size.set(report.group_size)
        if report.group_size > 1:  # an all-reduce ran (solo and resync rounds have none)
            self.allreduce_seconds.observe(max(0.0, report.allreduce_seconds))
        blocked = getattr(report, "blocked_seconds", None)  # absent in older session versions
        if blocked is not None and report.group_size > 1:
            self.blocked_seconds.observe(max(0.0, float(blocked)))
        if report.wait_seconds > 0:
            self.wait_seconds.observe(max(0.0, report.wait_seconds))
        self.cut_members.inc(max(0, int(getattr(report, "cut_members", 0))))
        if getattr(report, "window_s", 0.0) > 0:  # 0: no round ran (solo, resync)
            self.window_seconds.set(report.window_s)
            self.allreduce_deadline_seconds.set(report.allreduce_deadline_s)
        if getattr(report, "formed_early", False):
            self.formed_early.inc()
        self.sent.labels(self.codec).inc(max(0, int(report.bytes_sent)))
        self.received.labels(self.codec).inc(max(0, int(report.bytes_received)))
        if report.late_folded:
            self.late_folded.inc(report.late_folded)
            for s in report.staleness:
                if s > 0:
                    self.staleness.observe(s)
        for entry in _rejections(report):
            self.rejected.labels(rejection_kind(entry)).inc()
        for kind, count in (getattr(report, "rejected_records", None) or {}).items():
            self.rejected_records.labels(kind if kind in RECORD_REJECTION_REASONS else "other").inc(max(0, int(count)))

    def swarm(self, peers_visible: int, swarm_epoch: int | None) -> None:
        self.peers_visible.set(peers_visible)
        if swarm_epoch is not None:
            self.swarm_epoch.set(swarm_epoch)

    def state_transfer(self, direction: str, ok: bool) -> None:
        if direction == "received":
            self.downloads_received.labels("ok" if ok else "failed").inc()

    # ------------------------------------------------------------------ called by run_peer

    def eval(self, loss: float, epoch: int) -> None:
        """A held-out evaluation finished."""
        if not math.isfinite(loss):
            self.nonfinite.inc()
        self.eval_loss.set(loss)
        self.epoch.set(epoch)

    def inner_steps_total(self, steps: int) -> None:
        """Set the step gauge to the trainer's counter (it survives resumes; each step then adds one)."""
        self.steps.set(steps)

    def set_peer_id(self, peer_id: str) -> None:
        """Label ``p2p_diloco_peer_info`` with the peer id (known once the session started its DHT)."""
        self.info.clear()
        self.info.labels(peer_id, *self._identity).set(1)

    def checkpoint_saved(self, when: float | None = None) -> None:
        with self._lock:
            self._last_checkpoint = time.time() if when is None else when
        self.checkpoints.inc()

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the server (``shutdown()``)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server

    # ------------------------------------------------------------------ internals

    def _checkpoint_age(self) -> float:
        with self._lock:
            last = self._last_checkpoint
        return math.nan if last is None else max(0.0, time.time() - last)


class _ServedCollector:
    """``p2p_diloco_state_downloads_served_total``, read at scrape time from the state server's count."""

    def __init__(self, served: Callable[[], int] | None) -> None:
        self._served = served

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(PREFIX + "state_downloads_served",
                                     "Times this peer served its state to a joiner.")
        try:
            value = int(self._served()) if self._served is not None else 0
        except Exception:  # noqa: BLE001 - the averager may be shutting down; report zero, not an error
            value = 0
        family.add_metric([], value)
        yield family

    def describe(self) -> Iterable[CounterMetricFamily]:
        return self.collect()


def _rejections(report: RoundReport) -> Iterable[str]:
    rejected = getattr(report, "rejected", None) or []
    return [str(entry) for entry in rejected]
