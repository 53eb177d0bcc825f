"""Per-peer metrics, the swarm exporter and the progress display move as training moves."""

from __future__ import annotations

import functools
import io
import logging
import math
import time
import urllib.request

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import MSGPackSerializer, get_dht_time
from prometheus_client.parser import text_string_to_metric_families

from p2p_diloco.cli import run_bootstrap
from p2p_diloco.inner_stats import InnerStats
from p2p_diloco.monitoring import PeerMetrics, ProgressDisplay, SwarmExporter, rejection_kind
from p2p_diloco.monitoring.peer_metrics import RECORD_REJECTION_REASONS, REJECTION_REASONS
from p2p_diloco.peer.report import RoundReport
from p2p_diloco.swarm import SwarmConfig, publish_progress, start_dht
from p2p_diloco.swarm.records import progress_key
from p2p_diloco.swarm.signing import own_subkey

pytestmark = pytest.mark.timeout(120)


def value(metrics: PeerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def stats(steps: int, tokens: int, seconds: float, loss: float = 3.0) -> InnerStats:
    return InnerStats(steps=steps, samples=steps * 4, tokens=tokens, seconds=seconds, mean_loss=loss, last_loss=loss)


def report(**fields) -> RoundReport:
    base = dict(epoch=3, outcome="averaged", group_size=3, new_epoch=4, inner_steps=10, inner_seconds=20.0,
                allreduce_seconds=1.5, wait_seconds=0.7, bytes_sent=1000, bytes_received=2000, train_loss=2.5)
    base.update(fields)
    return RoundReport(**base)


def test_counters_grow_by_what_each_round_reports() -> None:
    served = [0]
    m = PeerMetrics(peer_id="p", run_id="r", model="tiny", codec="int8", served_downloads=lambda: served[0])
    # Known label values exist at zero before anything happened, so dashboards see them at once.
    assert value(m, "p2p_diloco_rounds_total", outcome="skipped") == 0
    assert value(m, "p2p_diloco_sent_bytes_total", codec="int8") == 0
    assert all(value(m, "p2p_diloco_rejected_contributions_total", reason=r) == 0 for r in REJECTION_REASONS)
    assert all(value(m, "p2p_diloco_rejected_dht_records_total", reason=r) == 0 for r in RECORD_REJECTION_REASONS)
    assert math.isnan(value(m, "p2p_diloco_checkpoint_age_seconds"))

    m.status("training", 3)
    assert value(m, "p2p_diloco_phase", phase="training") == 1
    assert value(m, "p2p_diloco_phase", phase="starting") == 0
    for step in range(1, 11):
        m.inner_step(step, 10, 3.0 - step / 10, 3)
    assert value(m, "p2p_diloco_inner_step") == 10
    assert value(m, "p2p_diloco_phase_step") == 10 and value(m, "p2p_diloco_local_steps") == 10
    m.status("averaging", 3)
    assert value(m, "p2p_diloco_phase", phase="averaging") == 1
    assert value(m, "p2p_diloco_phase", phase="training") == 0

    m.round(report(staleness=[0, 2, 0], late_folded=1,
                   rejected=["QmA: epoch 3 differs from ours 4", "QmB: tensor 2 holds NaN values"],
                   rejected_records={"unsigned": 3, "wrong_owner": 1, "a_future_kind": 2},
                   record_bans=["QmC: signed a DHT record rejected as wrong_owner"]),
            stats(10, 2560, 20.0))
    assert value(m, "p2p_diloco_sent_bytes_total", codec="int8") == 1000
    assert value(m, "p2p_diloco_received_bytes_total", codec="int8") == 2000
    assert value(m, "p2p_diloco_rounds_total", outcome="averaged") == 1
    assert value(m, "p2p_diloco_tokens_processed_total") == 2560
    assert value(m, "p2p_diloco_tokens_per_second") == pytest.approx(128.0)
    assert value(m, "p2p_diloco_epoch") == 4 and value(m, "p2p_diloco_group_size") == 3
    assert value(m, "p2p_diloco_train_loss") == 2.5
    assert value(m, "p2p_diloco_allreduce_seconds_sum") == 1.5
    assert value(m, "p2p_diloco_allreduce_seconds_bucket", le="2.5") == 1
    assert value(m, "p2p_diloco_allreduce_seconds_bucket", le="1.0") == 0
    assert value(m, "p2p_diloco_matchmaking_wait_seconds_sum") == pytest.approx(0.7)
    assert value(m, "p2p_diloco_inner_phase_seconds_count") == 1
    assert value(m, "p2p_diloco_late_contributions_folded_total") == 1
    assert value(m, "p2p_diloco_late_contribution_staleness_rounds_sum") == 2
    assert value(m, "p2p_diloco_rejected_contributions_total", reason="wrong_epoch") == 1
    assert value(m, "p2p_diloco_rejected_contributions_total", reason="non_finite") == 1
    assert value(m, "p2p_diloco_rejected_dht_records_total", reason="unsigned") == 3
    assert value(m, "p2p_diloco_rejected_dht_records_total", reason="wrong_owner") == 1
    assert value(m, "p2p_diloco_rejected_dht_records_total", reason="other") == 2
    assert value(m, "p2p_diloco_rejected_dht_records_total", reason="a_future_kind") is None  # bounded labels

    # A second round adds exactly its own numbers; a resync (no all-reduce) adds none to the histograms.
    m.round(report(bytes_sent=300, bytes_received=500, allreduce_seconds=4.0), stats(8, 2048, 16.0))
    m.round(report(outcome="resynced", group_size=0, bytes_sent=0, bytes_received=0, allreduce_seconds=0.0,
                   wait_seconds=0.0), stats(5, 1280, 10.0))
    assert value(m, "p2p_diloco_sent_bytes_total", codec="int8") == 1300
    assert value(m, "p2p_diloco_received_bytes_total", codec="int8") == 2500
    assert value(m, "p2p_diloco_tokens_processed_total") == 2560 + 2048 + 1280
    assert value(m, "p2p_diloco_allreduce_seconds_count") == 2
    assert value(m, "p2p_diloco_allreduce_seconds_sum") == 5.5
    assert value(m, "p2p_diloco_rounds_total", outcome="resynced") == 1
    assert value(m, "p2p_diloco_inner_phase_seconds_count") == 3

    m.swarm(5, 7)
    m.state_transfer("received", True)
    m.state_transfer("received", False)
    served[0] = 2
    assert value(m, "p2p_diloco_peers_visible") == 5 and value(m, "p2p_diloco_swarm_epoch") == 7
    assert value(m, "p2p_diloco_state_downloads_received_total", result="ok") == 1
    assert value(m, "p2p_diloco_state_downloads_received_total", result="failed") == 1
    assert value(m, "p2p_diloco_state_downloads_served_total") == 2  # read from the server at scrape time


def test_losses_checkpoint_age_and_identity() -> None:
    m = PeerMetrics(run_id="r", model="tiny")
    m.set_peer_id("12D3KooWabc")
    assert value(m, "p2p_diloco_peer_info", peer_id="12D3KooWabc", run_id="r", model="tiny", codec="none") == 1
    assert value(m, "p2p_diloco_peer_info", peer_id="", run_id="r", model="tiny", codec="none") is None
    m.eval(4.2, 1)
    assert value(m, "p2p_diloco_eval_loss") == 4.2
    assert value(m, "p2p_diloco_nonfinite_losses_total") == 0
    m.inner_step(1, 5, float("nan"), 1)
    m.eval(float("inf"), 1)
    assert value(m, "p2p_diloco_nonfinite_losses_total") == 2
    m.checkpoint_saved(time.time() - 100)
    assert 100 <= value(m, "p2p_diloco_checkpoint_age_seconds") < 200
    assert value(m, "p2p_diloco_checkpoints_written_total") == 1
    m.inner_steps_total(500)
    m.inner_step(1, 5, 3.0, 1)
    assert value(m, "p2p_diloco_inner_step") == 501


@pytest.mark.parametrize("entry, kind", [
    ("QmA: run id 'x' differs from ours 'y'", "other_run"),
    ("QmA: model fingerprint abc differs from ours def", "other_model"),
    ("QmA: epoch 3 differs from ours 4", "wrong_epoch"),
    ("QmA: the aggregate holds NaN or infinite values", "non_finite"),
    ("QmA: parameters hash to 12ab..., the donor claims 34cd...", "checksum_mismatch"),
    ("QmA: malformed metadata: truncated", "malformed"),
    ("QmA: something nobody foresaw", "other"),
])
def test_rejection_reasons_map_to_a_bounded_set(entry: str, kind: str) -> None:
    assert rejection_kind(entry) == kind


def test_metrics_endpoint_serves_the_registry() -> None:
    m = PeerMetrics(codec="fp16")
    m.round(report(bytes_sent=4096), stats(3, 768, 3.0))
    server = m.serve(0, addr="127.0.0.1")
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
    samples = {(s.name, tuple(s.labels.items())): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("p2p_diloco_sent_bytes_total", (("codec", "fp16"),))] == 4096
    assert not any(name.startswith("process_") for name, _ in samples)  # only this peer's series


async def _plant(_dht: object, node: object, key: str, subkey: object, value: object) -> None:
    """Runs in a DHT's process: put a record straight into its storage, past the guard."""
    storage = node.protocol.storage  # type: ignore[attr-defined]
    storage.store_subkey(DHTID.generate(source=key), subkey, MSGPackSerializer.dumps(value), get_dht_time() + 60)


def test_swarm_exporter_reads_peers_progress_from_the_dht() -> None:
    boot = start_dht(SwarmConfig.for_loopback())
    peers = []
    try:
        maddrs = [str(a) for a in boot.get_visible_maddrs()]
        peers = [start_dht(SwarmConfig.for_loopback(initial_peers=maddrs)) for _ in range(2)]
        for node, epoch, tps in zip(peers, (5, 3), (100.0, 50.0), strict=True):
            assert publish_progress(node, "mx", epoch=epoch, inner_step=10, steps_per_s=1.0, samples_per_s=4.0,
                                    tokens_per_s=tps, fingerprint="abcdef12", ttl_s=60)
        exporter = SwarmExporter(boot, ["mx", "other-run"], interval_s=1.0)
        exporter.poll_once()
        get = exporter.registry.get_sample_value
        ids = {node.peer_id.to_base58(): epoch for node, epoch in zip(peers, (5, 3), strict=True)}
        assert get("p2p_diloco_swarm_peers_online", {"run_id": "mx"}) == 2
        assert get("p2p_diloco_swarm_peers_online", {"run_id": "other-run"}) == 0
        assert get("p2p_diloco_swarm_epoch", {"run_id": "mx"}) == 5
        assert get("p2p_diloco_swarm_tokens_per_second", {"run_id": "mx"}) == 150
        for peer_id, epoch in ids.items():
            assert get("p2p_diloco_swarm_peer_epoch_lag", {"run_id": "mx", "peer_id": peer_id}) == 5 - epoch
        assert get("p2p_diloco_swarm_rounds_completed_total", {"run_id": "mx"}) == 5

        # The leading peer advances; then it withdraws (its record gone): rounds stay counted.
        publish_progress(peers[0], "mx", epoch=6, inner_step=20, steps_per_s=1.0, samples_per_s=4.0,
                         tokens_per_s=100.0, fingerprint="abcdef12", ttl_s=60)
        exporter.poll_once()
        assert get("p2p_diloco_swarm_rounds_completed_total", {"run_id": "mx"}) == 6
        peers[0].store(progress_key("mx"), None, expiration_time=get_dht_time() + 60, subkey=own_subkey(peers[0]))
        exporter.poll_once()
        assert get("p2p_diloco_swarm_peers_online", {"run_id": "mx"}) == 1
        assert get("p2p_diloco_swarm_epoch", {"run_id": "mx"}) == 3
        assert get("p2p_diloco_swarm_rounds_completed_total", {"run_id": "mx"}) == 6
        assert get("p2p_diloco_swarm_dht_reads_total", {"run_id": "mx", "result": "ok"}) == 3
        assert get("p2p_diloco_swarm_rejected_dht_records_total", {"reason": "unsigned"}) == 0

        # A node holding a record under a bare peer id (unsigned, as a node without the guard would): its
        # answer is dropped on receipt, counted, and changes nothing.
        forged = functools.partial(_plant, key=progress_key("mx"), subkey="QmForged", value=dict(epoch=99))
        peers[1].run_coroutine(forged)
        exporter.poll_once()
        assert get("p2p_diloco_swarm_epoch", {"run_id": "mx"}) == 3
        assert get("p2p_diloco_swarm_rejected_dht_records_total", {"reason": "unsigned"}) >= 1
    finally:
        for node in [*peers, boot]:
            node.shutdown()


def test_progress_line_on_a_terminal_and_plain_lines_otherwise(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    out = io.StringIO()
    live = ProgressDisplay(out, live=True, tokens_per_step=256, clock=lambda: now[0])
    live.swarm(4, 2)
    live.status("training", 2)
    for step in range(1, 6):
        now[0] += 1.0
        live.inner_step(step, 10, 3.25, 2)
    line = out.getvalue().split("\r")[-1].strip()
    assert line == "[training]  epoch 2  step 5/10  loss 3.250  256 tok/s  peers 4"
    live.round(report(new_epoch=3, allreduce_seconds=4.12), stats(10, 2560, 10.0))
    assert out.getvalue().endswith("\r")  # the live line is erased before run_peer prints the round
    assert live.line().endswith("all-reduce 4.1s") and "epoch 3" in live.line()

    plain = ProgressDisplay(io.StringIO(), live=False, log_every_s=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="p2p_diloco.monitoring.progress"):
        plain.status("training", 0)
        for step in range(1, 61):
            now[0] += 1.0
            plain.inner_step(step, 60, 3.0, 0)
        plain.status("averaging", 0)
    lines = [r.getMessage() for r in caplog.records]
    assert plain.stream.getvalue() == ""  # nothing drawn in place
    assert len(lines) == 4 and lines[0].startswith("progress: [training]") and "[averaging]" in lines[-1]
    assert not ProgressDisplay.for_terminal(io.StringIO(), log_file=None, tokens_per_step=1).live


@pytest.mark.parametrize("argv, message", [
    (["--monitor-run-ids", "bad id!"], "monitor_run_ids"),
    (["--metrics-port", "70000"], "metrics_port"),
    (["--monitor-interval-s", "0"], "monitor_interval_s"),
])
def test_bootstrap_monitoring_flags_fail_with_one_line(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        run_bootstrap.main(["--identity-path", "unused.id", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err
