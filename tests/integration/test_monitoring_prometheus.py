"""A real Prometheus scrapes a real swarm (a bootstrap node and 2 peers on loopback) with the shipped dashboards and
alert rules: every dashboard query returns data, every rule evaluates, and killing a peer fires the
peer-count alert. The same swarm checks that the peers' counters agree with their JSON round logs."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from swarm_procs import events, start_bootstrap, start_peer, tail, wait_for

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
PROMETHEUS = shutil.which("prometheus")
RUN = "mon1"
# Grafana substitutes these before a query reaches Prometheus; "All" of a multi-value variable is ".+".
TEMPLATE_VARS = {"$__rate_interval": "30s", "$run_id": ".+", "$instance": ".+"}

pytestmark = [
    pytest.mark.long,
    pytest.mark.slow,
    pytest.mark.timeout(600),  # about 2 minutes; the deadlines below allow for a heavily loaded machine
    pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed (Debian package "
                       "'prometheus': apt-get install -y prometheus; .ci/run installs it when it runs as root)"),
]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def query(prom: str, expr: str) -> list[dict]:
    body = get_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, PromQL with template variables substituted) for every panel target."""
    found = []
    for path in sorted((MONITORING / "grafana" / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in TEMPLATE_VARS.items():
                    expr = expr.replace(var, value)
                assert "$" not in expr, f"{path.name}/{panel['title']}: unknown variable in {expr}"
                found.append((path.name, panel["title"], expr))
    return found


def fast_rules(tmp: Path) -> Path:
    """The shipped rules with every `for:` set to 0s, so a condition fires at its first evaluation."""
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            rule["for"] = "0s"
    path = tmp / "alerts-fast.yml"
    path.write_text(yaml.safe_dump(rules))
    return path


def start_prometheus(tmp: Path, port: int, boot_port: int, peer_ports: list[int]) -> subprocess.Popen:
    (tmp / "targets").mkdir()
    # Peers come through file-based discovery, as in the shipped prometheus.yml.
    (tmp / "targets" / "peers.json").write_text(json.dumps(
        [{"targets": [f"127.0.0.1:{p}" for p in peer_ports], "labels": {"role": "peer"}}]))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(fast_rules(tmp))],
        "scrape_configs": [
            {"job_name": "p2p_diloco_swarm", "static_configs": [{"targets": [f"127.0.0.1:{boot_port}"]}]},
            {"job_name": "p2p_diloco_peers",
             "file_sd_configs": [{"files": [str(tmp / "targets" / "*.json")], "refresh_interval": "1s"}]},
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = open(tmp / "prometheus.out", "w")
    return subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=out, stderr=subprocess.STDOUT)


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def counters_match_log(tmp: Path, name: str, port: int) -> bool:
    """Does the peer's /metrics agree with its round log? Read the log on both sides of the scrape, since
    a round's counters move a moment before its log line is written."""
    before = events(tmp, name, "round")
    metrics = scrape(port)
    if events(tmp, name, "round") != before or not before:
        return False
    expected = {
        ("p2p_diloco_sent_bytes_total", (("codec", "none"),)): sum(r["bytes_sent"] for r in before),
        ("p2p_diloco_received_bytes_total", (("codec", "none"),)): sum(r["bytes_received"] for r in before),
        ("p2p_diloco_inner_phase_seconds_count", ()): len(before),
        ("p2p_diloco_tokens_processed_total", ()): sum(r["inner_steps"] for r in before) * 4 * 64,
        ("p2p_diloco_late_contributions_folded_total", ()): sum(r["late_folded"] for r in before),
    }
    for outcome in {r["outcome"] for r in before}:
        expected[("p2p_diloco_rounds_total", (("outcome", outcome),))] = sum(
            r["outcome"] == outcome for r in before)
    return all(metrics.get(key) == value for key, value in expected.items())


def test_prometheus_runs_every_dashboard_query_and_alert_on_a_live_swarm(tmp_path: Path) -> None:
    prom_port, boot_port, *peer_ports = free_ports(4)
    prom_url = f"http://127.0.0.1:{prom_port}"
    names = ["a", "b"]
    procs: dict[str, subprocess.Popen] = {}
    boot, maddr = start_bootstrap(tmp_path, "--metrics-port", str(boot_port), "--monitor-run-ids", RUN,
                                  "--monitor-interval-s", "1")
    try:
        for name, port in zip(names, peer_ports, strict=True):
            procs[name] = start_peer(tmp_path, name, maddr, "--run-id", RUN, "--metrics-port", str(port),
                                     "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"), "--checkpoint-every", "1",
                                     "--local-steps", "3", "--min-local-steps", "1")
        procs["prometheus"] = start_prometheus(tmp_path, prom_port, boot_port, peer_ports)
        wait_for(lambda: ready(f"{prom_url}/-/ready"), 60, "Prometheus to be ready")

        def swarm_trained() -> bool:
            for name, proc in procs.items():
                assert proc.poll() is None, f"{name} exited: {tail(tmp_path, name)}"
            done = query(prom_url, "p2p_diloco_swarm_rounds_completed_total >= 1")
            up = query(prom_url, "up == 1")
            return bool(done) and len(up) == 3 and all(events(tmp_path, n, "round") for n in names)

        wait_for(swarm_trained, 300, "every peer to finish a round, scraped by Prometheus")
        # A real all-reduce moved bytes, and each peer's counters equal what its round log reports.
        wait_for(lambda: any(r["bytes_sent"] > 0 for n in names for r in events(tmp_path, n, "round")), 240,
                 "an all-reduce between peers")
        for name, port in zip(names, peer_ports, strict=True):
            wait_for(lambda n=name, p=port: counters_match_log(tmp_path, n, p), 120,
                     f"{name}'s /metrics to agree with its round log")
        # The exporter counts the peers whose records its last DHT read found (one read per scrape): a read
        # can miss a record being republished, so wait for a scrape that saw both (bounded), not the latest one.
        wait_for(lambda: [r["value"][1] for r in query(prom_url, "p2p_diloco_swarm_peers_online")] == ["2"], 60,
                 "the swarm exporter to count both peers online")

        # Every PromQL expression of every dashboard panel returns data. Poll: a series that appeared
        # a second ago needs two scrapes before rate() has a value.
        pending = dashboard_queries()
        assert len(pending) >= 30
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            pending = [q for q in pending if not query(prom_url, q[2])]
            if pending:
                time.sleep(1)
        assert not pending, f"dashboard queries with no data: {pending}"
        for path in (MONITORING / "grafana" / "dashboards").glob("*.json"):
            for var in json.loads(path.read_text())["templating"]["list"]:
                metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["query"]["query"]).groups()
                values = get_json(f"{prom_url}/api/v1/label/{label}/values?match[]={metric}")["data"]
                assert values, f"{path.name}: template variable {var['name']} has no values"

        # Every alert rule evaluates without error; in the healthy swarm the peer-count alert is silent.
        def rules_evaluated() -> list[dict]:
            groups = get_json(f"{prom_url}/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert len(rules) == 9
            return rules if all(r["health"] != "unknown" for r in rules) else []

        wait_for(rules_evaluated, 30, "every alert rule to be evaluated")
        assert [(r["name"], r.get("lastError")) for r in rules_evaluated() if r["health"] != "ok"] == []

        def firing() -> set[str]:
            alerts = get_json(f"{prom_url}/api/v1/alerts")["data"]["alerts"]
            return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}

        # Silent once the rules were evaluated on the healthy swarm: a swarm that trains within seconds of its
        # start can get here while the evaluation from before the peers published still fires (count 0).
        wait_for(lambda: not {"P2PDilocoSwarmPeersDropped", "P2PDilocoSwarmEmpty"} & firing(), 30,
                 "the peer-count alerts to be silent in the healthy swarm")
        procs["b"].send_signal(signal.SIGKILL)
        procs["b"].wait(timeout=30)
        # b's endpoint is gone at once; its DHT progress record lasts until its TTL (30 s) runs out.
        wait_for(lambda: {"P2PDilocoSwarmPeersDropped", "P2PDilocoPeerDown"} <= firing(), 120,
                 "the peer-count and peer-down alerts to fire after killing a peer")
        assert query(prom_url, "p2p_diloco_swarm_peers_online")[0]["value"][1] == "1"
    finally:
        for proc in [*procs.values(), boot]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [*procs.values(), boot]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
