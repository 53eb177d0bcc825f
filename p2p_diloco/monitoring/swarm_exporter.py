"""Swarm-level Prometheus metrics, read from the progress records peers publish in the DHT.

``run_bootstrap --metrics-port PORT --monitor-run-ids RUN [RUN ...]`` serves them, so the operator of a
bootstrap node sees the whole swarm from one place without access to volunteers' machines. Nothing here
trusts a peer more than the DHT records do: values come from :func:`p2p_diloco.swarm.records.fetch_progress`,
which validates every record and drops expired ones, so a peer that stops publishing disappears from
``p2p_diloco_swarm_peers_online`` once its record's TTL (``--progress-ttl-s`` of the peers) runs out.

Records this node drops (unsigned, forged, malformed: see :mod:`p2p_diloco.swarm.signing`) are counted in
``p2p_diloco_swarm_rejected_dht_records_total{reason}``; their signers are skipped from then on.

A background thread reads the DHT every ``interval_s`` seconds; scrapes serve the last snapshot, so a slow
DHT never makes Prometheus time out. Choose ``interval_s`` at or below the Prometheus scrape interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from p2p_diloco.swarm.records import PeerProgress, fetch_progress, global_epoch
from p2p_diloco.swarm.signing import REJECTED_RECORD_KINDS, record_audit

logger = logging.getLogger(__name__)
PREFIX = "p2p_diloco_swarm_"


@dataclass
class RunView:
    """What the last successful read of one run's records showed."""

    records: list[PeerProgress] = field(default_factory=list)
    epoch: int | None = None
    rounds_completed: int = 0
    """Highest global epoch seen: every epoch is one completed outer round, and taking the maximum keeps
    the counter monotonic when the most advanced peer leaves."""
    read_time: float = 0.0
    reads_ok: int = 0
    reads_failed: int = 0


class SwarmExporter:
    """Polls the DHT for ``run_ids`` and exposes the swarm's state as a Prometheus collector.

    Args:
        dht: a running hivemind DHT (the bootstrap node's own).
        run_ids: the runs to watch; every series carries a ``run_id`` label.
        interval_s: seconds between DHT reads.
        registry: where to register; a fresh one by default.
    """

    def __init__(self, dht, run_ids: Sequence[str], *, interval_s: float = 5.0,
                 registry: CollectorRegistry | None = None) -> None:
        if not run_ids:
            raise ValueError("run_ids: give at least one run id to monitor")
        self.dht = dht
        self.run_ids = list(dict.fromkeys(run_ids))
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._views = {run: RunView() for run in self.run_ids}
        self._rejected: dict[str, int] = dict.fromkeys(REJECTED_RECORD_KINDS, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    def start(self) -> SwarmExporter:
        self.poll_once()
        self._thread = threading.Thread(target=self._loop, name="swarm-exporter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 35)

    def poll_once(self) -> None:
        """Read every watched run's records now."""
        for run in self.run_ids:
            try:
                records = fetch_progress(self.dht, run)
            except Exception as e:  # noqa: BLE001 - a DHT hiccup must not kill the exporter
                logger.warning("Could not read the progress of run %s: %r", run, e)
                with self._lock:
                    self._views[run].reads_failed += 1
                continue
            epoch = global_epoch(records)
            with self._lock:
                view = self._views[run]
                view.records, view.epoch, view.read_time = records, epoch, time.time()
                view.rounds_completed = max(view.rounds_completed, epoch or 0)
                view.reads_ok += 1
        counts, _bans = record_audit(self.dht).take_report()  # the bans are logged and applied by the reader
        with self._lock:
            for kind, count in counts.items():
                self._rejected[kind] = self._rejected.get(kind, 0) + count

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll_once()

    # ------------------------------------------------------------------ prometheus_client collector

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        with self._lock:
            views = {run: RunView(list(v.records), v.epoch, v.rounds_completed, v.read_time, v.reads_ok,
                                  v.reads_failed) for run, v in self._views.items()}
            rejected_counts = dict(self._rejected)
        now = time.time()
        g = {name: GaugeMetricFamily(PREFIX + name, doc, labels=labels) for name, doc, labels in (
            ("peers_online", "Peers with an unexpired progress record.", ["run_id"]),
            ("training_peers_online", "Peers online that are not in client mode.", ["run_id"]),
            ("epoch", "Global epoch: the largest epoch a non-client peer publishes.", ["run_id"]),
            ("tokens_per_second", "Sum of the throughput peers publish.", ["run_id"]),
            ("peer_epoch", "Epoch each peer publishes.", ["run_id", "peer_id"]),
            ("peer_epoch_lag", "Global epoch minus the peer's epoch.", ["run_id", "peer_id"]),
            ("peer_tokens_per_second", "Throughput each peer publishes.", ["run_id", "peer_id"]),
            ("peer_record_age_seconds", "Seconds since each peer last published progress.", ["run_id", "peer_id"]),
            ("last_read_timestamp_seconds", "Unix time of the last successful DHT read.", ["run_id"]),
        )}
        rounds = CounterMetricFamily(PREFIX + "rounds_completed", "Outer rounds the swarm completed (highest "
                                     "global epoch seen).", labels=["run_id"])
        reads = CounterMetricFamily(PREFIX + "dht_reads", "DHT reads of the progress records, by result.",
                                    labels=["run_id", "result"])
        for run, view in views.items():
            g["peers_online"].add_metric([run], len(view.records))
            g["training_peers_online"].add_metric([run], sum(not r.client_mode for r in view.records))
            g["tokens_per_second"].add_metric([run], sum(r.tokens_per_s for r in view.records))
            if view.epoch is not None:
                g["epoch"].add_metric([run], view.epoch)
            for r in view.records:
                g["peer_epoch"].add_metric([run, r.peer_id], r.epoch)
                if view.epoch is not None:
                    g["peer_epoch_lag"].add_metric([run, r.peer_id], max(0, view.epoch - r.epoch))
                g["peer_tokens_per_second"].add_metric([run, r.peer_id], r.tokens_per_s)
                g["peer_record_age_seconds"].add_metric([run, r.peer_id], max(0.0, now - r.time))
            if view.read_time:
                g["last_read_timestamp_seconds"].add_metric([run], view.read_time)
            rounds.add_metric([run], view.rounds_completed)
            reads.add_metric([run, "ok"], view.reads_ok)
            reads.add_metric([run, "failed"], view.reads_failed)
        rejected = CounterMetricFamily(PREFIX + "rejected_dht_records", "DHT records this node dropped, each "
                                       "counted once, by kind.", labels=["reason"])
        for kind, count in rejected_counts.items():
            rejected.add_metric([kind], count)
        yield from g.values()
        yield rounds
        yield reads
        yield rejected
