"""The metric names lorafarm's Grafana dashboard and Prometheus rules query (deploy/monitoring/),
and the names a /metrics exposition exports: for the checks that they match."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULES = MONITORING / "alerts.rules.yaml"
SCHEMA = MONITORING / "dashboard.schema.json"
# Our metrics all start lorafarm_ (ours) or vllm: (vLLM's names); recording rules are lorafarm:...
METRIC = re.compile(r"\b(?:lorafarm_[a-z0-9_]+|vllm:[a-z0-9_]+)\b")


def expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        exprs += [r["expr"] for r in group["rules"]]
    return exprs


def queried_metrics() -> set[str]:
    return {m for e in expressions() for m in METRIC.findall(e)}


def exported_metrics(exposition: str) -> set[str]:
    """Every series name the exposition can carry: sample names, plus the names of declared metrics
    that have no sample yet (a labelled counter before its first increment)."""
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                "summary": ("_sum", "_count", "")}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            base = name.removesuffix("_total") if kind == "counter" else name
            names.update(base + s for s in suffixes.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names
