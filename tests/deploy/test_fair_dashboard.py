"""The dashboard's "Fair share by tenant" row (issue 35) queries metrics a replica exports: the
exposition of the replica's own collectors (handler.serving.metrics.TenantCollector,
handler.serving.prep.FairQueuesCollector) over a real fairness policy and a real fair thread pool
carries every name the row's panels query."""

from __future__ import annotations

import json
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from handler.engine.fairness import FairPolicy, TenantReport
from handler.serving.metrics import TenantCollector
from handler.serving.prep import FairQueuesCollector
from handler.threads import FairThreadPool
from tests.deploy.monitoring import DASHBOARD, METRIC, exported_metrics

ROW = "Fair share by tenant"


def fair_row_panels() -> list[dict]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"].startswith(ROW))
    out = []
    for p in panels[start + 1:]:
        if p["type"] == "row":
            break
        out.append(p)
    return out


def replica_exposition() -> str:
    policy = FairPolicy(8)
    for t in ("attacker", "victim"):
        policy.arrive(t)
        policy.admit(t)
        policy.charge(t, prefill=10, decode=5)
        policy.queued(t, 0.02)
    policy.arrive("attacker")
    policy.requeue("attacker", "share")
    named, other = policy.ledger.snapshot()
    engine = SimpleNamespace(
        stats=lambda: SimpleNamespace(preemptions_kv=0, preemptions_share=1),
        tenant_stats=lambda: TenantReport(named, other, policy.active(), "fair"))
    handler = SimpleNamespace(engine=engine, _prep=FairThreadPool(2), grammar_pool=None, grammar_builder=None,
                              token_bound=None)
    reg = CollectorRegistry()
    reg.register(TenantCollector(handler, "dev-tiny"))
    reg.register(FairQueuesCollector(handler))
    return generate_latest(reg).decode()


def test_the_fair_share_row_has_the_issues_panels():
    titles = " | ".join(p["title"] for p in fair_row_panels())
    for words in ("tokens/s by tenant", "queue time p95 by tenant", "Preemptions", "counter spread",
                  "Queue depth by tenant"):
        assert words in titles, (words, titles)


def test_the_fair_share_row_queries_only_what_a_replica_exports():
    queried = {m for p in fair_row_panels() for t in p["targets"] for m in METRIC.findall(t["expr"])}
    assert {"lorafarm_tenant_generation_tokens_total", "lorafarm_tenant_queue_time_seconds_bucket",
            "lorafarm_preemptions_total", "lorafarm_tenant_preemptions_total", "lorafarm_fair_counter_spread",
            "lorafarm_tenant_waiting", "lorafarm_tenant_queue_waiting"} <= queried
    missing = queried - exported_metrics(replica_exposition())
    assert not missing, missing
