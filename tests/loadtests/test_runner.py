"""Per-step figures from the per-request CSV and from the replicas' real /metrics expositions."""

import math

import pytest

from handler.serving.metrics import ReplicaMetrics
from loadtests.report import highest_ok_rate
from loadtests.runner import cache_rates, closed_throughput, percentile, summarize


def _row(tier, ttft, phase="measure", error="", tokens=11, tpot=0.01):
    return {"phase": phase, "tier": tier, "error": error, "ttft_s": "" if error else str(ttft),
            "tpot_s": "" if error else str(tpot), "e2e_s": "" if error else str(ttft + tpot * (tokens - 1)),
            "itl_max_s": "", "output_tokens": str(tokens), "sent_s": "1.0"}  # fmt: skip


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 95) == 5
    assert math.isnan(percentile([], 50))
    assert percentile(list(range(101)), 95) == 95


def test_summary_splits_by_tier_counts_errors_and_skips_warmup():
    rows = [_row("gpu", 0.05 * k) for k in range(1, 21)] + [_row("disk", 2.0), _row("disk", 3.0)]
    rows += [_row("gpu", 9.0, phase="warmup"), _row("", 0, error="http_503"), _row("ram", 0, error="stream_x")]
    out = {g["group"]: g for g in summarize(rows, window_s=10.0)}
    assert list(out) == ["all", "gpu", "ram", "disk"]
    assert out["all"]["requests"] == 24 and out["all"]["errors"] == 2
    assert out["all"]["errors_by_kind"] == "http_503=1;stream_x=1"
    assert out["gpu"]["requests"] == 20 and out["gpu"]["errors"] == 0
    assert out["gpu"]["ttft_p50_ms"] == pytest.approx(525)  # the warm-up's 9 s is not counted
    assert out["disk"]["ttft_p95_ms"] == pytest.approx(2950)
    assert out["ram"]["ok"] == 0 and math.isnan(out["ram"]["ttft_p50_ms"])
    assert out["all"]["tpot_p50_ms"] == pytest.approx(10)
    assert out["all"]["achieved_rate"] == pytest.approx(2.4)


def test_closed_throughput_counts_measured_tokens_over_the_span():
    rows = [{"phase": "measure", "error": "", "sent_s": str(s), "e2e_s": "1.0", "output_tokens": "10",
             "ttft_s": "0.1", "tpot_s": "0.1"} for s in (0.0, 1.0, 2.0, 3.0)]  # fmt: skip
    rows.append({**rows[0], "phase": "warmup", "output_tokens": "1000"})
    t = closed_throughput(rows)
    assert t["output_tokens_per_s"] == pytest.approx(10.0)  # 40 tokens from 0 s to 4 s
    assert t["requests"] == 4


def _scrape(path, m: ReplicaMetrics, stamp: float):
    path.write_text(f"# lorafarm-scrape-time {stamp}\n# url x\n" + m.render().decode())


def test_cache_rates_from_replica_metrics(tmp_path):
    a, b = ReplicaMetrics("r0"), ReplicaMetrics("r1")
    a.adapter_slot_hits.inc(5)  # before the window: not counted
    _scrape(tmp_path / "replica0-start.prom", a, 100.0)
    _scrape(tmp_path / "replica1-start.prom", b, 100.0)
    a.adapter_slot_hits.inc(6)
    b.adapter_slot_hits.inc(2)
    a.adapter_slot_misses.labels(tier="ram").inc(1)
    b.adapter_slot_misses.labels(tier="disk").inc(1)
    for m in (a, b):
        m.record_load("ram", 0.01, ok=True)
    a.record_eviction("gpu")
    a.record_eviction("ram")  # not a device-slot eviction
    _scrape(tmp_path / "replica0-end.prom", a, 130.0)
    _scrape(tmp_path / "replica1-end.prom", b, 130.0)
    r = cache_rates(tmp_path)
    assert r["device_hit_rate"] == pytest.approx(8 / 10)
    assert r["ram_hit_rate"] == pytest.approx(1 / 2)
    assert r["loads_per_min"] == pytest.approx(4.0)  # 2 loads in 30 s
    assert r["evictions_per_min"] == pytest.approx(2.0)


def test_cache_rates_without_scrapes_are_nan(tmp_path):
    assert math.isnan(cache_rates(tmp_path)["device_hit_rate"])


def test_highest_ok_rate_stops_at_the_first_failure():
    def step(rate, p95, errors=0):
        return {"run": "s", "rate": str(rate), "group": "all", "ttft_p95_ms": str(p95), "errors": str(errors)}

    sweep = [step(1, 200), step(2, 900), step(4, 1500), step(8, 500)]
    assert highest_ok_rate(sweep, "s") == 2
    assert highest_ok_rate([step(1, 200), step(2, 300, errors=1)], "s") == 1
    assert highest_ok_rate([step(1, 2000)], "s") is None
