"""The operators' files in monitoring/: promtool accepts the config and rules, Grafana can provision the
dashboards, and docker-compose mounts files that exist."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package 'prometheus': apt-get install -y "
    "prometheus; .ci/run installs it when it runs as root)")


@needs_promtool
def test_promtool_accepts_the_shipped_config_and_rules() -> None:
    config = subprocess.run([PROMTOOL, "check", "config", str(MONITORING / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert config.returncode == 0, config.stdout + config.stderr
    assert "WARNING" not in config.stdout + config.stderr  # e.g. a service-discovery file that does not exist
    rules = subprocess.run([PROMTOOL, "check", "rules", str(MONITORING / "alerts.yml")],
                           capture_output=True, text=True, timeout=60)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 9 rules found" in rules.stdout


def test_rules_cover_the_required_alerts() -> None:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    by_name = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    for name in ("P2PDilocoSwarmPeersDropped", "P2PDilocoNoRoundCompleted", "P2PDilocoLossNaN",
                 "P2PDilocoLossRising", "P2PDilocoPeerFarBehind"):
        assert name in by_name and by_name[name]["annotations"]["summary"], name


def test_dashboards_are_valid_for_grafana_provisioning() -> None:
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    ds_uid = datasource["datasources"][0]["uid"]
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/p2p_diloco.yml").read_text())
    assert provider["apiVersion"] == 1 and provider["providers"][0]["type"] == "file"
    paths = sorted((MONITORING / "grafana/dashboards").glob("*.json"))
    assert [p.name for p in paths] == ["peer.json", "swarm-overview.json"]
    uids = set()
    for path in paths:
        dash = json.loads(path.read_text())
        assert dash["uid"] and len(dash["uid"]) <= 40 and dash["title"], path.name
        uids.add(dash["uid"])
        variables = {v["name"] for v in dash["templating"]["list"]}
        assert variables, f"{path.name}: a dashboard for many peers or runs needs template variables"
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for panel in dash["panels"]:
            where = f"{path.name}/{panel.get('title')}"
            assert panel["title"] and panel["type"] in {"stat", "timeseries", "table", "gauge"}, where
            assert panel["datasource"] == {"type": "prometheus", "uid": ds_uid}, where
            assert panel["targets"] and set(panel["gridPos"]) == {"x", "y", "w", "h"}, where
            for target in panel["targets"]:
                assert target["expr"] and target["refId"] and target["datasource"]["uid"] == ds_uid, where
                used = {v for v in variables if f"${v}" in target["expr"]}
                assert used == variables, f"{where}: {target['expr']} ignores the dashboard's variables"
    assert len(uids) == len(paths)


def test_compose_mounts_files_that_exist() -> None:
    compose = yaml.safe_load((MONITORING / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"prometheus", "grafana"}
    for service in compose["services"].values():
        for volume in service["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (MONITORING / source).exists(), volume
    assert (MONITORING / "README.md").is_file()
