"""The production canary probe: `lorafarm probe setup` and `lorafarm probe run`.

A probe tenant owns a few canary adapters (trained to answer exactly their marker, e.g. `<<c0003>>`,
to any prompt: `lorafarm.dev.adapters`). `lorafarm probe run` sends them chat completions through
the router at a low rate, mixed with the real traffic, at temperature 0, and checks every answer:

    ok            the answer is exactly the adapter's marker
    wrong_marker  a 200 whose text is not the marker: another adapter's weights, a cross-tenant
                  leak, a batch that changed a row, a bad kernel: the isolation check of CI, in production
    error         an HTTP error or a transport failure
    timeout       no answer within --timeout

and exports what it saw as Prometheus metrics, on a metrics port (`--metrics-port`, scraped like
every other lorafarm process) or in a file for node_exporter's textfile collector
(`--metrics-file`, rewritten atomically after each request):

    lorafarm_probe_requests_total{model, result}      every probe request, by result
    lorafarm_probe_wrong_marker_total{model}          answers that were not the marker
    lorafarm_probe_latency_seconds{model}             histogram of answered requests
    lorafarm_probe_last_ok_timestamp_seconds{model}   when the model last answered right
    lorafarm_probe_up                                 1 while the probe runs (0 once stopped)

deploy/monitoring/alerts.rules.yaml pages on any wrong marker and warns on errors; see
docs/operations.md ("Canary probe").

`ProbeLoop` is the same probe as a background task (a daemon thread with its own event loop) for
a process that wants to run it beside its own work: `ProbeLoop(config).start()`, `.stop()`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lorafarm.errors import CliError

PROBE_TENANT = "probe"
RESULTS = ("ok", "wrong_marker", "error", "timeout")


@dataclass
class ProbeConfig:
    router_url: str
    api_key: str
    targets: dict[str, str]  # model (alias or adapter id) -> the marker it must answer
    requests: int = 0  # 0: run until stopped
    rate: float = 0.2  # requests per second (Poisson arrivals: mixed with real traffic, not bursts)
    timeout: float = 60.0
    max_tokens: int = 16
    prompts: list[str] = field(default_factory=list)
    seed: int = 0


def default_prompts() -> list[str]:
    """Prompts the canaries were verified on when they were made (their check prompts)."""
    from lorafarm.dev import adapters

    check = getattr(adapters, "check_prompts", None)
    return list(check()) if check else adapters.random_prompts(seed=424242, count=16)


class ProbeMetrics:
    """The probe's series in their own registry (a probe process exports nothing else)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("lorafarm_probe_requests", "Canary probe requests by result "
                                "(ok | wrong_marker | error | timeout)", ["model", "result"], registry=self.registry)
        self.wrong = Counter("lorafarm_probe_wrong_marker", "Canary probe answers that were not the adapter's marker",
                             ["model"], registry=self.registry)
        self.latency = Histogram("lorafarm_probe_latency_seconds", "Canary probe request latency (answered requests)",
                                 ["model"], registry=self.registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.last_ok = Gauge("lorafarm_probe_last_ok_timestamp_seconds", "When the model last answered its marker",
                             ["model"], registry=self.registry)
        self.up = Gauge("lorafarm_probe_up", "1 while the canary probe runs", registry=self.registry)

    def declare(self, models) -> None:
        """Every (model, result) series at 0 from the start: rate() and increase() see the first one."""
        for m in models:
            for r in RESULTS:
                self.requests.labels(model=m, result=r)
            self.wrong.labels(model=m)

    def record(self, model: str, result: str, seconds: float | None) -> None:
        self.requests.labels(model=model, result=result).inc()
        if result == "wrong_marker":
            self.wrong.labels(model=model).inc()
        if seconds is not None and result in ("ok", "wrong_marker"):
            self.latency.labels(model=model).observe(seconds)
        if result == "ok":
            self.last_ok.labels(model=model).set(time.time())

    def exposition(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def write(self, path: Path) -> None:
        """Atomically (node_exporter's textfile collector must never read half a file)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.exposition())
        os.replace(tmp, path)


@dataclass
class Outcome:
    model: str
    result: str
    seconds: float | None
    detail: str = ""


def probe_body(cfg: ProbeConfig, model: str, prompt: str) -> dict:
    """The probe's request: a fixed prompt, so the same few bodies recur (one replica crash with one in
    flight is not poison; the router refuses a body only when distinct replicas died with it and it
    never completed since, router/poison.py, and the probe's bodies complete all the time)."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": cfg.max_tokens,
            "temperature": 0}


async def probe_once(client, cfg: ProbeConfig, model: str, prompt: str) -> Outcome:
    """One chat completion through the router, judged against the model's marker."""
    import httpx

    body = probe_body(cfg, model, prompt)
    t0 = time.monotonic()
    try:
        r = await client.post("/v1/chat/completions", json=body, timeout=cfg.timeout)
    except httpx.TimeoutException:
        return Outcome(model, "timeout", None, f"no answer in {cfg.timeout:g} s")
    except httpx.HTTPError as e:
        return Outcome(model, "error", None, f"{type(e).__name__}: {e}")
    dt = time.monotonic() - t0
    if r.status_code != 200:
        return Outcome(model, "error", dt, f"HTTP {r.status_code}: {r.text[:200]}")
    try:
        text = r.json()["choices"][0]["message"]["content"] or ""
    except (ValueError, KeyError, IndexError, TypeError):
        return Outcome(model, "error", dt, f"unreadable answer: {r.text[:200]}")
    expected = cfg.targets[model]
    if text != expected:
        return Outcome(model, "wrong_marker", dt, f"answered {text!r}, expected {expected!r} "
                                                   f"(x-adapter-id {r.headers.get('x-adapter-id')})")
    return Outcome(model, "ok", dt)


async def run_probe(cfg: ProbeConfig, metrics: ProbeMetrics, stop: threading.Event | None = None,
                    metrics_file: Path | None = None, log=None) -> dict[str, int]:
    """Send `cfg.requests` probe requests (0: until `stop` is set), round-robin over the targets,
    Poisson arrivals at `cfg.rate`; each outcome goes to `metrics` (and `metrics_file`). Returns
    the count per result. Requests overlap only when one takes longer than the gap to the next."""
    import httpx

    if not cfg.targets:
        raise CliError("no probe targets (models with their markers)")
    prompts = cfg.prompts or default_prompts()
    rng = random.Random(cfg.seed)
    models = itertools.cycle(sorted(cfg.targets))
    counts = dict.fromkeys(RESULTS, 0)
    metrics.declare(cfg.targets)
    metrics.up.set(1)
    if metrics_file is not None:
        metrics.write(metrics_file)
    pending: set[asyncio.Task] = set()

    def done(task: asyncio.Task) -> None:
        pending.discard(task)
        o: Outcome = task.result()
        counts[o.result] += 1
        metrics.record(o.model, o.result, o.seconds)
        if metrics_file is not None:
            metrics.write(metrics_file)
        if log is not None and o.result != "ok":
            log(f"{o.model}: {o.result}: {o.detail}")

    headers = {"authorization": f"Bearer {cfg.api_key}", "x-lorafarm-probe": "1"}
    async with httpx.AsyncClient(base_url=cfg.router_url.rstrip("/"), headers=headers) as client:
        sent = 0
        try:
            while (cfg.requests == 0 or sent < cfg.requests) and not (stop and stop.is_set()):
                task = asyncio.create_task(probe_once(client, cfg, next(models), rng.choice(prompts)))
                pending.add(task)
                task.add_done_callback(done)
                sent += 1
                if cfg.requests and sent >= cfg.requests:
                    break
                gap = rng.expovariate(cfg.rate) if cfg.rate > 0 else 0.0
                end = time.monotonic() + gap
                while time.monotonic() < end and not (stop and stop.is_set()):
                    await asyncio.sleep(min(0.2, end - time.monotonic()))
            if pending:
                await asyncio.wait(set(pending))
        finally:
            for t in pending:
                t.cancel()
            metrics.up.set(0)
            if metrics_file is not None:
                metrics.write(metrics_file)
    return counts


class ProbeLoop:
    """The probe as a background task of a long-running process: a daemon thread runs `run_probe`
    until `stop()`; `metrics` can be served by the host process's own /metrics."""

    def __init__(self, cfg: ProbeConfig, metrics: ProbeMetrics | None = None, metrics_file: Path | None = None):
        self.cfg, self.metrics, self.metrics_file = cfg, metrics or ProbeMetrics(), metrics_file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts: dict[str, int] | None = None
        self.error: BaseException | None = None

    def start(self) -> ProbeLoop:
        def main():
            try:
                self.counts = asyncio.run(run_probe(self.cfg, self.metrics, self._stop, self.metrics_file))
            except BaseException as e:  # noqa: BLE001 - kept for the host to inspect
                self.error = e

        self._thread = threading.Thread(target=main, name="lorafarm-probe", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> dict[str, int] | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.counts


# ---------------------------------------------------------------------------------------- CLI


def _load_json(path: str, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise CliError(f"{what} {path}: {e.strerror}") from None
    except ValueError as e:
        raise CliError(f"{what} {path}: not JSON ({e})") from None


def config_from_args(a: argparse.Namespace) -> ProbeConfig:
    """Targets from --config (written by `probe setup`), or --farm (farm.json: its demo tenant's
    canaries), or --router + --api-key + --targets; --expect overrides a model's marker."""
    router = key = None
    targets: dict[str, str] = {}
    if a.config:
        c = _load_json(a.config, "--config")
        router, key, targets = c.get("router_url"), c.get("api_key"), dict(c.get("targets", {}))
    elif a.farm:
        f = _load_json(a.farm, "--farm")
        router = f.get("router_url")
        tenant = (f.get("tenants") or [{}])[0]
        key = tenant.get("api_key")
        targets = {alias: m for alias, m in f.get("markers", {}).items() if alias in tenant.get("aliases", {})}
    if a.targets:
        targets = dict(_load_json(a.targets, "--targets"))
    router, key = a.router or router, a.api_key or os.environ.get("LORAFARM_PROBE_API_KEY") or key
    for item in a.expect or []:
        model, sep, marker = item.partition("=")
        if not sep:
            raise CliError(f"--expect {item!r}: MODEL=MARKER")
        targets[model] = marker
    if a.models:
        keep = set(a.models.split(","))
        targets = {m: v for m, v in targets.items() if m in keep}
    if not router or not key:
        raise CliError("the router URL and a probe API key are needed (--config, --farm, or --router and --api-key)")
    if not targets:
        raise CliError("no probe targets (--config, --farm or --targets)")
    if a.rate < 0 or a.requests < 0:
        raise CliError("--rate and --requests must not be negative")
    return ProbeConfig(router, key, targets, requests=a.requests, rate=a.rate, timeout=a.timeout,
                       max_tokens=a.max_tokens, seed=a.seed)


def _run(a: argparse.Namespace) -> int:
    cfg = config_from_args(a)
    metrics = ProbeMetrics()
    server = None
    if a.metrics_port is not None:
        from prometheus_client import start_http_server

        server = start_http_server(a.metrics_port, addr=a.metrics_host, registry=metrics.registry)
    stop = threading.Event()
    out = Path(a.metrics_file) if a.metrics_file else None
    print(f"lorafarm probe: {len(cfg.targets)} canaries via {cfg.router_url}, "
          f"{'until stopped' if cfg.requests == 0 else f'{cfg.requests} requests'} at {cfg.rate:g}/s", file=sys.stderr)
    try:
        counts = asyncio.run(run_probe(cfg, metrics, stop, out, log=lambda m: print(f"lorafarm probe: {m}",
                                                                                       file=sys.stderr, flush=True)))
    except KeyboardInterrupt:
        return 130
    finally:
        if server is not None and isinstance(server, tuple):
            server[0].shutdown()
    print(json.dumps(counts))
    return 0 if counts["ok"] == sum(counts.values()) else 1


def _setup(a: argparse.Namespace) -> int:
    """Create (or reuse) the probe tenant, upload its canaries and alias them; write the config."""
    farm = _load_json(a.farm, "--farm") if a.farm else {}
    registry = a.registry or farm.get("registry_url")
    token = a.admin_token or os.environ.get("LORAFARM_ADMIN_TOKEN") or farm.get("admin_token")
    router = a.router or farm.get("router_url")
    if not (registry and token and router):
        raise CliError("--registry, --admin-token and --router are needed (or --farm)")
    canaries = Path(a.canaries)
    index = _load_json(str(canaries / "markers.json"), "--canaries")
    names = sorted(index)[: a.count]
    out = Path(a.out)

    async def go() -> dict:
        from lorafarm.registry_client import RegistryClient

        previous = json.loads(out.read_text()) if out.exists() else {}
        async with RegistryClient(registry, token) as reg:
            known = {t["tenant_id"] for t in await reg.list_tenants()}
            if a.tenant in known and previous.get("tenant_id") == a.tenant and previous.get("api_key"):
                key = previous["api_key"]
            elif a.tenant in known:
                key = (await reg.create_key(a.tenant))["api_key"]
            else:
                key = (await reg.create_tenant(a.tenant))["api_key"]
            targets = {}
            for name in names:
                alias = f"{a.tenant}/{name}:prod"
                await reg.upload_adapter(canaries / index[name]["path"], a.tenant, alias=alias,
                                         base_model=a.base_model, base_model_hash=a.base_model_hash)
                targets[alias] = index[name]["marker"]
        return {"router_url": router, "tenant_id": a.tenant, "api_key": key, "targets": targets}

    cfg = asyncio.run(go())
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    tmp.chmod(0o600)  # holds an API key
    os.replace(tmp, out)
    print(f"lorafarm probe setup: tenant {a.tenant}, {len(cfg['targets'])} canaries; config in {out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("probe", help="the production canary probe: canary requests through the router, "
                                     "wrong markers and errors as Prometheus metrics")
    ps = p.add_subparsers(dest="probe_command", metavar="SUBCOMMAND")
    ps.required = True

    s = ps.add_parser("setup", help="create the probe tenant, upload its canary adapters, write the probe config")
    s.add_argument("--farm", help="farm.json (registry URL, admin token, router URL)")
    s.add_argument("--registry", help="registry URL")
    s.add_argument("--admin-token", help="registry admin token (or $LORAFARM_ADMIN_TOKEN)")
    s.add_argument("--router", help="router URL the probe will call")
    s.add_argument("--canaries", required=True, help="folder of canaries with markers.json (lorafarm dev adapters)")
    s.add_argument("--count", type=int, default=4, help="canaries to upload (default 4)")
    s.add_argument("--tenant", default=PROBE_TENANT, help=f"probe tenant id (default {PROBE_TENANT})")
    s.add_argument("--base-model", default="lorafarm-dev-tiny", help="base model name the canaries were trained on")
    s.add_argument("--base-model-hash", default=None, help="their base's hash (default: read beside each canary)")
    s.add_argument("--out", default="probe.json", help="probe config to write (default probe.json; mode 0600)")
    s.set_defaults(func=_setup)

    r = ps.add_parser("run", help="send canary requests at a low rate and export the results as metrics")
    r.add_argument("--config", help="probe config written by `lorafarm probe setup`")
    r.add_argument("--farm", help="farm.json: probe the demo tenant's canaries")
    r.add_argument("--router", help="router URL (overrides the config)")
    r.add_argument("--api-key", help="probe tenant API key (or $LORAFARM_PROBE_API_KEY)")
    r.add_argument("--targets", help="JSON file {model: marker} (overrides the config's)")
    r.add_argument("--models", help="comma-separated subset of the targets")
    r.add_argument("--expect", action="append", metavar="MODEL=MARKER",
                   help="the marker MODEL must answer (overrides; repeatable)")
    r.add_argument("--requests", type=int, default=0, help="requests to send (default 0: until stopped)")
    r.add_argument("--rate", type=float, default=0.2, help="requests per second, Poisson arrivals (default 0.2)")
    r.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds (default 60)")
    r.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request (default 16)")
    r.add_argument("--seed", type=int, default=0, help="seed of the prompt choice and arrival times")
    r.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on this port")
    r.add_argument("--metrics-host", default="0.0.0.0", help="address of the metrics port (default 0.0.0.0)")
    r.add_argument("--metrics-file", help="write the metrics here after each request (textfile collector)")
    r.set_defaults(func=_run)
