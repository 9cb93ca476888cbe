"""Run the locust suite (loadtests/locustfile.py) headless, one subprocess per step, and turn what
it wrote into per-step figures.

A step is one locust run: a warm-up, then `duration` measured seconds. Its per-request CSV gives
exact percentiles (locust's own CSVs round response times); the replicas' /metrics scraped at the
window's start and end give, as counter differences over the window:

    device hit rate = slot_hits / (slot_hits + slot_misses)         (requests found in a slot)
    RAM hit rate    = slot_misses{tier=ram} / slot_misses           (misses served from host RAM)
    loads/min       = 60 * loads{outcome=ok} / window               (into device slots)
    evictions/min   = 60 * evictions{tier=gpu} / window             (out of device slots)
    prefix hit rate = prefix_cache_hits / prefix_cache_queries       (prompt tokens the prefix cache served)

The requests CSV gives the same prefix figure from the answers themselves (cached share: the sum of
usage.prompt_tokens_details.cached_tokens over the sum of prompt_tokens).

Locust runs in its own process because it monkey-patches the standard library with gevent.
"""

from __future__ import annotations

import csv
import json
import math
import os
import resource
import subprocess
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.workload import workload_flags

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
REPO = Path(__file__).resolve().parent.parent
TIERS = ("gpu", "ram", "disk", "remote", "base")


@dataclass
class Target:
    """Where the load goes: the router, a tenant key, the models (most popular first)."""

    router_url: str
    api_key: str
    models: list[str]
    replica_urls: list[str] = field(default_factory=list)
    base_model: str = ""


class LocustFailed(RuntimeError):
    pass


def run_locust(
    target: Target,
    out: Path,
    name: str,
    *,
    mode: str = "open",
    rate: float = 1.0,
    duration: float = 30.0,
    warmup: float = 10.0,
    workload: dict | None = None,
    concurrency: int = 32,
    distinct: int = 1,
    models: list[str] | None = None,
    progress: bool = True,
    expected: int | None = None,
) -> Path:
    """One locust run; writes `<out>/<name>-requests.csv`, `<out>/<name>_stats.csv` (locust's),
    `<out>/<name>-metrics/`. Returns the requests CSV. Ctrl-C stops locust before returning."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    models_file = out / f"{name}-models.txt"
    models_file.write_text("\n".join(models or target.models) + "\n")
    requests_csv = out / f"{name}-requests.csv"
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "1", "-r", "1",
        "--host", target.router_url, "--run-time", f"{int(warmup + duration + 180)}s", "--stop-timeout", "30",
        "--csv", str(out / name), "--only-summary", "--skip-log-setup", "--exit-code-on-error", "0",
        "--api-key", target.api_key, "--models-file", str(models_file), "--mode", mode,
        "--arrival-rate", str(rate), "--duration", str(duration), "--warmup", str(warmup),
        "--concurrency", str(concurrency), "--distinct", str(distinct),
        "--requests-csv", str(requests_csv), "--metrics-dir", str(out / f"{name}-metrics"),
        "--replica-urls", ",".join(target.replica_urls), *workload_flags(workload or {}),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    log = open(out / f"{name}-locust.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    total = expected if expected is not None else (int(rate * (warmup + duration)) if mode == "open" else None)
    try:
        with tqdm(total=total, desc=name, unit="req", disable=not progress, leave=True) as bar:
            while proc.poll() is None:
                time.sleep(0.5)
                bar.update(max(0, _count_rows(requests_csv) - bar.n))
            bar.update(max(0, _count_rows(requests_csv) - bar.n))
    finally:
        if proc.poll() is None:  # Ctrl-C (or any error) while it ran: stop it, keep what it wrote
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    if proc.returncode != 0 or not requests_csv.exists():
        tail = (out / f"{name}-locust.log").read_text(errors="replace")[-2000:]
        raise LocustFailed(f"locust ({name}) exited with status {proc.returncode}:\n{tail}")
    return requests_csv


def _count_rows(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return max(0, sum(1 for _ in f) - 1)
    except OSError:
        return 0


class TokenTimes:
    """The token events of one stream (perf_counter times): the first, the last, the gaps between them.
    A token event is a chunk with text, or the finish chunk (tokens that decode to no text yet send
    none): the first one is the first token the client sees."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []

    def tick(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now

    def fields(self, sent: float, end: float, tokens: int) -> dict:
        """ttft_s, e2e_s, tpot_s (as in vLLM's benchmark: (last - first) / (tokens - 1)), itl_max_s."""
        return {"ttft_s": round(self.first - sent, 6), "e2e_s": round(end - sent, 6),
                "tpot_s": round((self.last - self.first) / (tokens - 1), 6) if tokens > 1 else "",
                "itl_max_s": round(max(self.gaps), 6) if self.gaps else ""}  # fmt: skip


# -- statistics ---------------------------------------------------------------------------


def read_requests(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _num(row: dict, key: str) -> float | None:
    value = row.get(key, "")
    return float(value) if value not in ("", None) else None


def summarize(rows: list[dict], window_s: float) -> list[dict]:
    """Measured rows -> one dict per group ("all", then each tier seen): counts and latency
    percentiles in ms. Errors count in "all" (by kind) and in their tier when it is known."""
    measured = [r for r in rows if r.get("phase", "measure") == "measure"]
    groups: dict[str, list[dict]] = {"all": measured}
    for r in measured:
        if r.get("tier"):
            groups.setdefault(r["tier"], []).append(r)
    out = []
    for name in ["all", *[t for t in TIERS if t in groups], *sorted(set(groups) - {"all", *TIERS})]:
        rs = groups[name]
        ok = [r for r in rs if not r.get("error")]
        errors = Counter(r["error"] for r in rs if r.get("error"))
        row = {"group": name, "requests": len(rs), "ok": len(ok), "errors": sum(errors.values()),
               "errors_by_kind": ";".join(f"{k}={v}" for k, v in sorted(errors.items())),
               "share": len(rs) / len(measured) if measured else math.nan,
               "achieved_rate": len(rs) / window_s if window_s else math.nan,
               "output_tokens_per_s": sum(int(r["output_tokens"] or 0) for r in ok) / window_s if window_s else math.nan}  # fmt: skip
        for metric in ("ttft", "tpot", "e2e", "itl_max"):
            vals = [v for r in ok if (v := _num(r, f"{metric}_s")) is not None]
            for p in (50, 95, 99):
                row[f"{metric}_p{p}_ms"] = 1000 * percentile(vals, p)
        row.update(_cached(ok))
        out.append(row)
    return out


def _cached(ok: list[dict]) -> dict:
    """Prefix-cache figures from the answers: cached_share = sum(cached_tokens) / sum(prompt_tokens)
    over the answers that reported both; cached_requests = answers with cached_tokens > 0; system
    prompt share = requests that sent a system prompt (NaN where the CSV has no such columns)."""
    both = [(c, p) for r in ok if (c := _num(r, "cached_tokens")) is not None and (p := _num(r, "prompt_tokens"))]
    systems = [_num(r, "system_words") for r in ok if r.get("system_words", "") not in ("", None)]
    return {"cached_share": sum(c for c, _ in both) / sum(p for _, p in both) if both else math.nan,
            "cached_requests": sum(1 for c, _ in both if c > 0),
            "system_prompt_requests": sum(1 for w in systems if w and w > 0) if systems else math.nan}  # fmt: skip


def closed_throughput(rows: list[dict]) -> dict:
    """Saturation throughput of a closed-loop step: output tokens of measured requests over the time
    from the first measured send to the last measured answer."""
    measured = [r for r in rows if r["phase"] == "measure" and not r["error"]]
    if not measured:
        return {"requests": 0, "errors": 0, "output_tokens_per_s": 0.0, "requests_per_s": 0.0}
    start = min(float(r["sent_s"]) for r in measured)
    end = max(float(r["sent_s"]) + float(r["e2e_s"]) for r in measured)
    tokens = sum(int(r["output_tokens"]) for r in measured)
    span = max(1e-9, end - start)
    return {
        "requests": len(measured),
        "errors": sum(1 for r in rows if r["phase"] == "measure" and r["error"]),
        "output_tokens_per_s": tokens / span,
        "requests_per_s": len(measured) / span,
        "ttft_p50_ms": 1000 * percentile([float(r["ttft_s"]) for r in measured], 50),
        "tpot_p50_ms": 1000 * percentile([float(r["tpot_s"]) for r in measured if r["tpot_s"]], 50),
    }


# -- replica /metrics ---------------------------------------------------------------------


def parse_metrics(text: str) -> tuple[float | None, dict[tuple[str, tuple], float]]:
    """A /metrics exposition -> (scrape unix time, {(sample name, sorted labels): value})."""
    from prometheus_client.parser import text_string_to_metric_families

    stamp = None
    for line in text.splitlines()[:3]:
        if line.startswith("# lorafarm-scrape-time "):
            stamp = float(line.split()[-1])
    samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    except ValueError:
        pass
    return stamp, samples


def _total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n in (name, name + "_total") and want <= set(ls))


def scrape(urls: list[str], folder: Path, label: str) -> None:
    """Save `cpu-<label>.json` (the machine's /proc/stat line, this process's CPU seconds, the load
    average) and each replica's /metrics as `replica<i>-<label>.prom` (read by cpu_use, cache_rates)."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.time()
    # what bounds the rate: the machine's CPU (/proc/stat) and this load generator's own share
    usage = resource.getrusage(resource.RUSAGE_SELF)
    try:
        machine = Path("/proc/stat").read_text().splitlines()[0]
    except OSError:
        machine = ""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    (folder / f"cpu-{label}.json").write_text(json.dumps({"time": stamp, "proc_stat_cpu": machine,
                                                          "loadgen_cpu_s": usage.ru_utime + usage.ru_stime,
                                                          "loadavg": list(load)}))  # fmt: skip
    for i, url in enumerate(urls):
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError as e:
            text = f"# scrape failed: {e}\n"
        (folder / f"replica{i}-{label}.prom").write_text(f"# lorafarm-scrape-time {stamp}\n# url {url}\n{text}")


def cache_rates(metrics_dir: Path) -> dict:
    """Hit rates and per-minute loads/evictions over the window, summed over the replicas scraped."""
    d = defaultdict(float)
    window = []
    for start_file in sorted(metrics_dir.glob("replica*-start.prom")):
        end_file = start_file.with_name(start_file.name.replace("-start", "-end"))
        if not end_file.exists():
            continue
        t0, a = parse_metrics(start_file.read_text())
        t1, b = parse_metrics(end_file.read_text())
        if not a or not b:
            continue
        if t0 and t1:
            window.append(t1 - t0)
        for key, name, labels in [
            ("hits", "lorafarm_adapter_slot_hits", {}),
            ("misses", "lorafarm_adapter_slot_misses", {}),
            ("ram_misses", "lorafarm_adapter_slot_misses", {"tier": "ram"}),
            ("loads", "lorafarm_adapter_loads", {"outcome": "ok"}),
            ("load_errors", "lorafarm_adapter_loads", {"outcome": "error"}),
            ("evictions", "lorafarm_adapter_evictions", {"tier": "gpu"}),
            ("prefix_queries", "lorafarm_prefix_cache_queries", {}),
            ("prefix_hits", "lorafarm_prefix_cache_hits", {}),
        ]:
            d[key] += _total(b, name, **labels) - _total(a, name, **labels)
    if not window:
        return {"device_hit_rate": math.nan, "ram_hit_rate": math.nan, "loads_per_min": math.nan,
                "evictions_per_min": math.nan, "load_errors": math.nan, "prefix_hit_rate": math.nan,
                "prefix_queries": math.nan}  # fmt: skip
    minutes = max(window) / 60.0
    looked_up = d["hits"] + d["misses"]
    return {
        "device_hit_rate": d["hits"] / looked_up if looked_up else math.nan,
        "ram_hit_rate": d["ram_misses"] / d["misses"] if d["misses"] else math.nan,
        "loads_per_min": d["loads"] / minutes,
        "evictions_per_min": d["evictions"] / minutes,
        "load_errors": d["load_errors"],
        # prompt tokens served from the prefix cache / prompt tokens looked up (vLLM's definition)
        "prefix_hit_rate": d["prefix_hits"] / d["prefix_queries"] if d["prefix_queries"] else math.nan,
        "prefix_queries": d["prefix_queries"],
    }


def cpu_use(metrics_dir: Path) -> dict:
    """Over the window: the machine's busy CPU fraction (all cores, from /proc/stat: 1 - (idle + iowait)
    / total), the load generator's CPU seconds per second (its share of that), and the 1-minute load
    average at the window's start and end (NaN where the scrape did not record it)."""
    try:
        a = json.loads((metrics_dir / "cpu-start.json").read_text())
        b = json.loads((metrics_dir / "cpu-end.json").read_text())
        ta = [int(x) for x in a["proc_stat_cpu"].split()[1:]]
        tb = [int(x) for x in b["proc_stat_cpu"].split()[1:]]
    except (OSError, ValueError, KeyError):
        return {"cpu_busy": math.nan, "loadgen_cpu": math.nan, "load_start": math.nan, "load_end": math.nan}
    total = sum(tb) - sum(ta)
    idle = (tb[3] + tb[4]) - (ta[3] + ta[4])
    span = b["time"] - a["time"]
    return {"cpu_busy": 1 - idle / total if total else math.nan,
            "loadgen_cpu": (b["loadgen_cpu_s"] - a["loadgen_cpu_s"]) / span if span > 0 else math.nan,
            "load_start": float((a.get("loadavg") or [math.nan])[0]),
            "load_end": float((b.get("loadavg") or [math.nan])[0])}  # fmt: skip


def append_csv(path: Path, rows: list[dict]) -> None:
    """Append rows (header on first write); flushed at once so an interrupted run keeps them."""
    if not rows:
        return
    new = not path.exists()
    columns = list(rows[0])
    if not new:
        with open(path, newline="") as f:
            columns = next(csv.reader(f), columns)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, columns, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
