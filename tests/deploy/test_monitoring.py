"""deploy/monitoring: the Grafana dashboard validates against its JSON schema and lays out without
overlaps; `promtool check rules` accepts the alert rules; every alert the issue names is there.
(That the queried metrics exist on a running farm is tests/e2e/test_platform.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.monitoring import DASHBOARD, RULES, SCHEMA, queried_metrics


def test_dashboard_schema_and_layout():
    from jsonschema import Draft202012Validator

    dash = json.loads(DASHBOARD.read_text())
    validator = Draft202012Validator(json.loads(SCHEMA.read_text()))
    errors = sorted(validator.iter_errors(dash), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not (cells & mine), f"panel {p['title']!r} overlaps another"
        cells |= mine
    # the schema itself rejects a broken panel (it can fail)
    broken = {**dash, "panels": [{**dash["panels"][1], "gridPos": {"x": 30, "y": 0, "w": 4, "h": 4}}]}
    assert list(validator.iter_errors(broken))


def test_rules_name_every_alert_the_fleet_needs():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    assert set(alerts) == {"LorafarmTenantTTFTOverTarget", "LorafarmAdapterEvictionsHigh", "LorafarmDeviceHitRateLow",
                           "LorafarmReplicaDown", "LorafarmRegistryUnreachable", "LorafarmProbeWrongMarker",
                           "LorafarmProbeErrors", "LorafarmProbeNoRightAnswer"}
    assert "0.95" in alerts["LorafarmDeviceHitRateLow"]["expr"]
    assert all(r["annotations"]["summary"] and r["labels"]["severity"] for r in alerts.values())
    assert {"vllm:time_to_first_token_seconds_bucket", "lorafarm_router_tenant_tokens_total",
            "lorafarm_router_price_per_replica_hour"} <= queried_metrics()


def test_promtool_check_rules(tmp_path):
    if shutil.which("promtool") is None:
        if os.environ.get("CI"):  # .ci/run installs it: missing there is a broken CI, not a skip
            pytest.fail("promtool missing under CI (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
    bad = tmp_path / "bad.rules.yaml"
    bad.write_text(RULES.read_text().replace("== 1", "== ", 1))  # a broken expression must fail
    assert subprocess.run(["promtool", "check", "rules", str(bad)], capture_output=True).returncode != 0


def test_promtool_probe_wrong_marker_alert_fires(tmp_path):
    """`promtool test rules`: one wrong canary answer pages, errors past 20% warn, all-right stays quiet."""
    if shutil.which("promtool") is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing under CI (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": 'lorafarm_probe_wrong_marker_total{model="probe/c0001:prod"}', "values": "0 0 0 1 1 1"},
                {"series": 'lorafarm_probe_wrong_marker_total{model="probe/c0000:prod"}', "values": "0 0 0 0 0 0"},
                {"series": 'lorafarm_probe_requests_total{model="probe/c0000:prod",result="ok"}', "values": "0+1x40"},
                {"series": 'lorafarm_probe_requests_total{model="probe/c0000:prod",result="error"}', "values": "0+1x40"},
            ],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "LorafarmProbeWrongMarker", "exp_alerts": [{
                    "exp_labels": {"severity": "page", "model": "probe/c0001:prod"},
                    "exp_annotations": {
                        "summary": "Canary probe/c0001:prod answered something other than its marker",
                        "description": next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                                            if r.get("alert") == "LorafarmProbeWrongMarker")["annotations"]["description"],
                    }}]},
                {"eval_time": "2m", "alertname": "LorafarmProbeWrongMarker", "exp_alerts": []},
                {"eval_time": "30m", "alertname": "LorafarmProbeErrors", "exp_alerts": [{
                    "exp_labels": {"severity": "warn", "model": "probe/c0000:prod"},
                    "exp_annotations": {"summary": "Canary probe/c0000:prod: 50% of probe requests failed or timed out"},
                }]},
            ],
        }],
    }
    f = tmp_path / "probe_test.yaml"
    f.write_text(yaml.safe_dump(test))
    out = subprocess.run(["promtool", "test", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
