"""A relay host's daemon starts (``swarm.relay_check.start_relay_dht``): each one counted, logged with its verdict
and why it was restarted, printed in the bootstrap's startup output and exported as a metric. The DHT and the
check are stand-ins here; tests/integration/test_relay_check.py runs them for real."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from p2p_diloco.cli.run_bootstrap import RELAY_LINE, BootstrapConfig, read_relay_line, relay_line
from p2p_diloco.monitoring.relay_metrics import RelayStartsCollector
from p2p_diloco.swarm import SwarmConfig, relay_check
from p2p_diloco.swarm.relay_check import (
    DEFAULT_RELAY_LIMIT_BYTES,
    PAYLOAD_BYTES,
    RelayCheck,
    RelayStartup,
    RelayVerdict,
    start_relay_dht,
    stream_verdict,
)

RELAY = SwarmConfig.for_loopback(use_relay=True, relay_service=True)


class FakeDHT:
    def __init__(self, n: int) -> None:
        self.n, self.stopped = n, False

    def shutdown(self) -> None:
        self.stopped = True


def _check(verdict: RelayVerdict) -> RelayCheck:
    return RelayCheck(verdict, PAYLOAD_BYTES if verdict is RelayVerdict.PASSED else 0, f"{verdict.value} (fake)", 0.5)


@pytest.fixture
def host(monkeypatch):
    """Stand-ins for the DHT and the check: ``verdicts`` is what each successive check says."""
    started: list[FakeDHT] = []
    verdicts: list[RelayVerdict] = []

    def fake_start(cfg, validators):
        started.append(FakeDHT(len(started) + 1))
        return started[-1]

    def fake_check(maddr: str, timeout_s: float = 20.0) -> RelayCheck:
        return _check(verdicts.pop(0))

    monkeypatch.setattr(relay_check, "start_dht", fake_start)
    monkeypatch.setattr(relay_check, "check_relay", fake_check)
    monkeypatch.setattr(relay_check, "visible_maddrs", lambda dht: [f"/ip4/127.0.0.1/tcp/5/p2p/Qm{dht.n}"])
    return started, verdicts


def _start_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "daemon start" in r.getMessage() and "of at most" in r.getMessage()]


def test_every_daemon_start_is_counted_and_logged_with_why_it_restarted(host, caplog) -> None:
    started, verdicts = host
    U, R, P = RelayVerdict.UNREACHABLE, RelayVerdict.RESET, RelayVerdict.PASSED
    verdicts += [U, R, R, P]  # the first daemon: unreachable, checked again, reset; the second reset; the third passes
    caplog.set_level(logging.INFO, logger=relay_check.__name__)
    startup = start_relay_dht(RELAY, attempts=5)
    assert startup.starts == 3 and startup.limit == 5
    assert [c.verdict for c in startup.checks] == [R, R, P] and startup.check.verdict is P
    assert startup.dht is started[-1] and [d.stopped for d in started] == [True, True, False]
    lines = [r.getMessage() for r in _start_lines(caplog)]
    assert len(lines) == 3, caplog.text
    for n, line in enumerate(lines[:2], 1):
        assert f"daemon start {n} of at most 5: reset" in line and "restarting the p2p daemon" in line, line
        assert "default relay answers" in line, line
    assert "daemon start 3 of at most 5: passed" in lines[2] and "restarting" not in lines[2]
    assert "Relay check passed after 3 daemon start(s)" in caplog.text
    assert not verdicts  # the unreachable daemon was checked again, not restarted


def test_a_relay_that_resets_at_every_start_stops_at_the_limit_and_says_so(host, caplog) -> None:
    started, verdicts = host
    verdicts += [RelayVerdict.RESET] * 3
    caplog.set_level(logging.INFO, logger=relay_check.__name__)
    startup = start_relay_dht(RELAY, attempts=3)
    assert startup.starts == 3 and all(c.verdict is RelayVerdict.RESET for c in startup.checks)
    assert [d.stopped for d in started] == [True, True, False]  # the last one runs on
    lines = [r.getMessage() for r in _start_lines(caplog)]
    assert len(lines) == 3 and "restarting" not in lines[-1], lines
    assert any(r.levelno == logging.ERROR and "after 3 daemon starts" in r.getMessage() for r in caplog.records)


def test_a_host_that_does_not_relay_starts_once_unchecked(host) -> None:
    started, _ = host
    startup = start_relay_dht(SwarmConfig.for_loopback())
    assert startup.starts == 0 and startup.check is None and len(started) == 1


def test_only_a_stream_cut_within_the_default_limit_is_a_reset() -> None:
    assert stream_verdict(PAYLOAD_BYTES, None)[0] is RelayVerdict.PASSED
    # a slow stream on a loaded host that the deadline ended past the default limit: our relay carried it
    verdict, detail = stream_verdict(DEFAULT_RELAY_LIMIT_BYTES + 1, asyncio.TimeoutError())
    assert verdict is RelayVerdict.PASSED and "past libp2p's default relay limit" in detail
    for received in (0, DEFAULT_RELAY_LIMIT_BYTES - 4096, DEFAULT_RELAY_LIMIT_BYTES):
        verdict, detail = stream_verdict(received, ConnectionResetError("reset"))
        assert verdict is RelayVerdict.RESET and f"after {received} bytes" in detail
    assert stream_verdict(1000, None)[0] is RelayVerdict.RESET


def test_the_bootstrap_prints_the_starts_in_a_line_it_can_read_back() -> None:
    cfg = BootstrapConfig()
    startup = RelayStartup(FakeDHT(1), (_check(RelayVerdict.RESET), _check(RelayVerdict.PASSED)), 32)
    line = relay_line(cfg, startup)
    assert line == f"{RELAY_LINE} passed after 2 daemon starts of at most 32 (reset, passed)"
    got = read_relay_line(f"12:00:01 INFO ...\n{line}\nbootstrap node Qm is up.\n")
    assert (got.verdict, got.starts, got.limit) == ("passed", 2, 32)
    one = relay_line(cfg, RelayStartup(FakeDHT(1), (_check(RelayVerdict.PASSED),), 8))
    assert read_relay_line(one).starts == 1 and "1 daemon start of" in one
    unchecked = RelayStartup(FakeDHT(1), (), 0)
    assert relay_line(cfg, unchecked).startswith(f"{RELAY_LINE} skipped") and read_relay_line(relay_line(cfg, unchecked)) is None
    off = BootstrapConfig(use_relay=False)
    assert relay_line(off, unchecked).startswith(f"{RELAY_LINE} off")


def test_the_starts_are_a_metric_by_verdict() -> None:
    registry = CollectorRegistry()
    checks = [_check(RelayVerdict.RESET), _check(RelayVerdict.RESET), _check(RelayVerdict.PASSED)]
    registry.register(RelayStartsCollector(checks, 32))
    text = generate_latest(registry).decode()
    assert 'p2p_diloco_swarm_relay_daemon_starts_total{verdict="reset"} 2.0' in text, text
    assert 'p2p_diloco_swarm_relay_daemon_starts_total{verdict="passed"} 1.0' in text, text
    assert 'p2p_diloco_swarm_relay_daemon_starts_total{verdict="unreachable"} 0.0' in text, text
    assert "p2p_diloco_swarm_relay_daemon_start_limit 32.0" in text, text
    unchecked = CollectorRegistry()
    unchecked.register(RelayStartsCollector([], 0))
    assert 'p2p_diloco_swarm_relay_daemon_starts_total{verdict="passed"} 0.0' in generate_latest(unchecked).decode()
