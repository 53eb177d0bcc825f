"""The relay check's daemon starts as a Prometheus metric of the bootstrap node (``run_bootstrap --metrics-port``).

A relay host starts its p2p daemon until a check finds its own relay answering (``swarm.relay_check``). Each
start is counted once in ``p2p_diloco_swarm_relay_daemon_starts_total{verdict}`` by the check's verdict on that
daemon: ``reset`` starts were replaced, so a node whose relay works shows ``passed`` 1 and ``reset`` the
restarts it took; ``passed`` 0 with other starts counted means its relay was left unchecked (``unreachable``)
or still resets relayed streams (every start ``reset``). All three series exist from the start, at 0 when the
node relays nothing or skipped the check (``--relay-check-starts 0``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from p2p_diloco.swarm.relay_check import RelayCheck, RelayVerdict

STARTS = "p2p_diloco_swarm_relay_daemon_starts"
LIMIT = "p2p_diloco_swarm_relay_daemon_start_limit"


class RelayStartsCollector:
    """A fixed snapshot of the checks a relay host made at start (they happen once, before metrics are served)."""

    def __init__(self, checks: Sequence[RelayCheck], limit: int) -> None:
        self.counts = {v.value: sum(c.verdict is v for c in checks) for v in RelayVerdict}
        self.limit = int(limit)

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        starts = CounterMetricFamily(STARTS, "p2p daemons this relay host started to check its relay, by the "
                                     "check's verdict on each (reset: replaced by the next start).",
                                     labels=["verdict"])
        for verdict, count in self.counts.items():
            starts.add_metric([verdict], count)
        yield starts
        yield GaugeMetricFamily(LIMIT, "Most daemon starts the relay check may make (--relay-check-starts; 0: "
                                "not checked).", value=self.limit)


__all__ = ["LIMIT", "STARTS", "RelayStartsCollector"]
