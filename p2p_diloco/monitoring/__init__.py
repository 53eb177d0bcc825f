"""Monitoring: per-peer Prometheus metrics, the swarm-level exporter and the terminal progress display.

- :class:`PeerMetrics`: a ``SessionListener`` behind ``run_peer --metrics-port``;
- :class:`SwarmExporter`: the swarm seen from the DHT, behind ``run_bootstrap --metrics-port``;
- :class:`ProgressDisplay`: the live line (or periodic log lines) of ``run_peer``;
- :class:`~p2p_diloco.monitoring.tracking.ExperimentTracker`: each round to W&B and/or TensorBoard behind
  ``run_peer --wandb-project`` / ``--tensorboard-dir`` (the optional ``tracking`` extra).

Dashboards, alert rules and a Prometheus + Grafana stack for operators live in the repository's
``monitoring/`` folder.
"""

from __future__ import annotations

from p2p_diloco.monitoring.peer_metrics import PeerMetrics, rejection_kind
from p2p_diloco.monitoring.progress import ProgressDisplay
from p2p_diloco.monitoring.swarm_exporter import SwarmExporter

__all__ = ["PeerMetrics", "ProgressDisplay", "SwarmExporter", "rejection_kind"]
