"""Issue 35's acceptance benchmark: a hostile tenant's attacks against a victim tenant on one real
replica, on the dev model and on the real model (SmolLM2-135M-Instruct). Results as JSON in
var/fairness/ (untracked); docs/fairness.md and its plots are rendered only when asked:

    python -m benchmarks.fairness [--models dev,real] [--out var/fairness] [--baseline-s 15] [--attack-s 20] ...
    python -m benchmarks.fairness --report-from var/fairness --to docs      # docs/fairness.md, docs/fairness/*.png

(`make bench-fairness`, `make bench-fairness-docs`.)

Per model, two `lorafarm replica` processes on 127.0.0.1 (standalone, the product's defaults but
`--slots 1 --prefetch-interval-s 0`): one with `--scheduling fair` (the default), one with
`--scheduling fifo` (the engine as it was: "today"). Requests go straight to a replica with the
headers the router sets (`x-lorafarm-tenant`); no router, no registry. The attacker runs in its own
process (its client work does not delay the victim's client); the victim and a /metrics sampler
(`lorafarm_tenant_generation_tokens_total` and friends every --sample-s) in this one.

Each attack has three phases: baseline (the victim alone), attack (the attacker started, --warm-s
to establish it, then the victim measured), tail (the victim stops, the attacker goes on alone: the
idle share it gets back). In attacks 1 and 2 the victim sends at a steady rate (--victim-rate: an
open loop, at most --victim-outstanding in flight); in 3 and 4, where each request is a compile on
one of two grammar workers, one request at a time (at most --victim-schema-rate per second). Every
request of a phase is waited for. Then the attacker hangs up and the replica settles
(nothing running, no tenant queue) before the next attack.

  1       4 concurrent `n=16, max_tokens=600` requests (looped, ignore_eos) vs the victim's short
          streamed chats (8 tokens): the victim's TTFT.
  2       a loop of ~900 KB prompts (--huge-loops 1) vs the victim's 18 KB requests (over the 16 KiB
          inline limit: prepared on the prep threads): the victim's whole request time.
  3       ~140 concurrent distinct slow-to-refuse schemas (`^(a{1000}){N}$`, each a compile that ran
          to --grammar-timeout-s before the lexer-fuel bound, ~0.2 s now; a 429 retried after its
          Retry-After) vs the victim's new-schema
          requests: whole request time and the victim's 429s.
  4       the attacker keeps 8 slow schemas queued, then sends the schema the victim is about to
          use, then the victim sends it: the victim's whole request time.
  1-fifo  attack 1 on the fifo replica (today's engine), for comparison.

"Tenant alone": attack 1's load from one tenant with nobody else, on the fair and the fifo replica
in turn (--alone-rounds rounds, interleaved so load drift on a shared box hits both), generated
tokens/s after --warm-s. Targets (issue 35): victim p95 during each attack <= 2x its baseline of
the same run; a tenant alone >= 0.9x its throughput today (fifo).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TENANT_HEADER = "x-lorafarm-tenant"
VICTIM, ATTACKER, ALONE = "victim", "attacker", "alone"
P95_TARGET = 2.0  # victim p95 during an attack / its baseline p95, at most
ALONE_TARGET = 0.9  # a tenant alone: fair tokens/s / fifo tokens/s, at least

ATTACKS = {
    "1": {"title": "batch hog: concurrent n=16, max_tokens=600 requests, looped", "victim": "stream",
          "attacker": "n16", "metric": "TTFT of short streamed chats", "scheduling": "fair"},
    "2": {"title": "a loop of ~900 KB prompts (prep queue)", "victim": "large", "attacker": "huge",
          "metric": "time of 18 KB requests", "scheduling": "fair"},
    "3": {"title": "flood of distinct slow-to-refuse schemas (grammar queue)", "victim": "schema",
          "attacker": "flood", "metric": "time of new-schema requests", "scheduling": "fair"},
    "4": {"title": "slow schemas queued, then the victim's schema (in-flight sharing)", "victim": "shared",
          "attacker": "queue", "metric": "time of requests for the schema the attacker sent first",
          "scheduling": "fair"},
    "1-fifo": {"title": "attack 1 with --scheduling fifo (today's engine)", "victim": "stream", "attacker": "n16",
               "metric": "TTFT of short streamed chats", "scheduling": "fifo"},
}
ORDER = ["1", "2", "3", "4", "1-fifo"]
MODELS = {"dev": "dev-tiny", "real": "smollm2-135m-instruct"}


# ---------------------------------------------------------------------------------------------- utils

def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank, rounded) of xs; None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str, names: set[str]) -> dict[str, list[tuple[dict, float]]]:
    """{name: [(labels, value)]} of the samples named in `names` (Prometheus text format)."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        series, _, value = line.rpartition(" ")
        base, _, rest = series.partition("{")
        if base not in names:
            continue
        labels = {}
        for kv in rest.rstrip("}").split(","):
            if "=" in kv:
                k, v = kv.split("=", 1)
                labels[k.strip()] = v.strip().strip('"')
        try:
            out.setdefault(base, []).append((labels, float(value)))
        except ValueError:
            pass
    return out


SAMPLED = {"lorafarm_tenant_generation_tokens_total", "lorafarm_tenant_prompt_tokens_total",
           "lorafarm_num_requests_running", "lorafarm_num_requests_waiting", "lorafarm_tenant_queue_waiting",
           "lorafarm_tenant_queue_running", "lorafarm_grammar_workers_alive", "lorafarm_tenant_preemptions_total"}


def snapshot(text: str) -> dict:
    m = parse_metrics(text, SAMPLED)
    one = lambda name: sum(v for _, v in m.get(name, []))  # noqa: E731
    return {
        "gen": {lab["tenant"]: v for lab, v in m.get("lorafarm_tenant_generation_tokens_total", [])},
        "prompt": {lab["tenant"]: v for lab, v in m.get("lorafarm_tenant_prompt_tokens_total", [])},
        "running": one("lorafarm_num_requests_running"), "waiting": one("lorafarm_num_requests_waiting"),
        "queued": {f'{kind}:{lab.get("queue")}/{lab.get("tenant")}': v
                   for kind in ("waiting", "running") for lab, v in m.get(f"lorafarm_tenant_queue_{kind}", []) if v},
        "grammar_workers": one("lorafarm_grammar_workers_alive"),
        "preempted_share": sum(v for lab, v in m.get("lorafarm_tenant_preemptions_total", [])
                               if lab.get("reason") == "share"),
    }


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ------------------------------------------------------------------------------------- the bodies

def chat(model: str, content: str, max_tokens: int, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **kw}


def schema_format(schema: dict, name: str = "s") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def slow_schema(n: int) -> dict:
    """The issue's flood: a tiny schema whose compile ran until the replica's grammar timeout (now
    refused by llguidance's lexer fuel, handler.grammar.constrained.INITIAL_LEXER_FUEL)."""
    return schema_format({"type": "string", "pattern": "^(a{1000}){%d}$" % n})


def victim_schema(tag: str) -> dict:
    return schema_format({"type": "object", "properties": {f"f_{tag}": {"type": "integer"}}, "required": [f"f_{tag}"]})


def attacker_body(kind: str, model: str, j: int, k: int, counter, opts: dict) -> bytes:
    if kind == "n16":
        body = chat(model, f"write a long story, part {j}-{k}", opts["n16_max_tokens"], n=opts["n16_n"],
                    temperature=0.8, ignore_eos=True)
    elif kind == "huge":
        return opts["_huge"]
    elif kind in ("flood", "queue"):
        body = chat(model, "a user record", 8, response_format=slow_schema(opts["slow_base"] + next(counter)))
    else:
        raise ValueError(kind)
    return json.dumps(body).encode()


# --------------------------------------------------------------------- the attacker (own process)

def _attacker_main(url: str, model: str, kind: str, conc: int, opts: dict, tenant: str, stop, ready, out) -> None:
    """Child process: `conc` loops of `kind` requests as `tenant` until `stop`; puts its records
    [(t0, t1, status, code, completion_tokens)] (monotonic clock: system-wide) on `out`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it
    if kind == "huge":
        opts = {**opts, "_huge": json.dumps(chat(model, "lorem ipsum " * (opts["huge_bytes"] // 12), 8)).encode()}
    records: list = []

    async def run() -> None:
        import itertools

        counter = itertools.count()
        limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=60), limits=limits) as c:
            async def slot(j: int) -> None:
                k = 0
                while not stop.is_set():
                    body = attacker_body(kind, model, j, k, counter, opts)
                    t0 = time.monotonic()
                    code, toks = "", 0
                    try:
                        r = await c.post(f"{url}/v1/chat/completions", content=body,
                                         headers={TENANT_HEADER: tenant, "content-type": "application/json"})
                        status = r.status_code
                        try:
                            js = r.json()
                            code = (js.get("error") or {}).get("code") or ""
                            toks = (js.get("usage") or {}).get("completion_tokens") or 0
                        except ValueError:
                            pass
                    except httpx.HTTPError as e:
                        status, code = 0, type(e).__name__
                    records.append((t0, time.monotonic(), status, code, toks))
                    k += 1
                    if status == 429:  # honour the Retry-After (1 s) as a client library would
                        await asyncio.sleep(float(r.headers.get("retry-after", "1") or 1))
                    elif status != 200 and status != 400:
                        await asyncio.sleep(0.2)

            tasks = [asyncio.create_task(slot(j)) for j in range(conc)]
            await asyncio.sleep(0.3)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            for t in tasks:  # hang up: the replica sees the client go away
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(run())
    finally:
        ready.set()
        out.put(records)


class Attacker:
    def __init__(self, url: str, model: str, kind: str, conc: int, opts: dict, tenant: str = ATTACKER):
        ctx = mp.get_context("spawn")
        self.stop_evt, self.ready, self.out = ctx.Event(), ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=_attacker_main, daemon=True,
                                args=(url, model, kind, conc, opts, tenant, self.stop_evt, self.ready, self.out))
        self.records: list = []

    async def start(self) -> None:
        self.proc.start()
        await asyncio.to_thread(self.ready.wait, 120)

    async def stop(self) -> list:
        self.stop_evt.set()
        try:
            self.records = await asyncio.to_thread(self.out.get, True, 120)
        except queue_mod.Empty:
            self.records = []
        await asyncio.to_thread(self.proc.join, 30)
        if self.proc.is_alive():
            self.proc.kill()
        return self.records


# ----------------------------------------------------------------------------------- the replica

class Replica:
    """`python -m lorafarm replica` on 127.0.0.1, standalone."""

    def __init__(self, base: Path, model_name: str, scheduling: str, tmp: Path, extra: list[str], label: str = ""):
        self.model_label = label
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = ["--id", f"fair-{scheduling}", "--base", str(base), "--port", str(self.port),
                      "--model-name", model_name, "--disk-dir", str(tmp / f"disk-{scheduling}"), "--slots", "1",
                      "--prefetch-interval-s", "0", "--log-level", "warning", "--scheduling", scheduling, *extra]
        self.logfile = tmp / f"replica-{scheduling}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LORAFARM_ADMIN_TOKEN": ""}
        env.pop("LORAFARM_REGISTRY_URL", None)
        self._log = open(self.logfile, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "lorafarm", "replica", *self.flags], cwd=REPO, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica exited ({self.proc.returncode}): {self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica not healthy in {timeout:.0f} s: {self.log()}")
            time.sleep(0.3)

    def log(self) -> str:
        return self.logfile.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


# ----------------------------------------------------------------------------- measuring a replica

class Sampler:
    """/metrics every `every` s: per-tenant token counters, queue depths."""

    def __init__(self, client: httpx.AsyncClient, url: str, every: float):
        self.client, self.url, self.every = client, url, every
        self.samples: list[tuple[float, dict]] = []
        self._task: asyncio.Task | None = None

    async def one(self) -> dict | None:
        try:
            r = await self.client.get(f"{self.url}/metrics", timeout=30)
            snap = snapshot(r.text)
        except httpx.HTTPError:
            return None
        self.samples.append((time.monotonic(), snap))
        return snap

    async def _loop(self) -> None:
        while True:
            t = time.monotonic()
            await self.one()
            await asyncio.sleep(max(0.0, self.every - (time.monotonic() - t)))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def counter_at(self, t: float, key: str, tenant: str) -> float | None:
        """The counter interpolated at monotonic time t."""
        pts = [(ts, s[key].get(tenant, 0.0)) for ts, s in self.samples]
        if not pts:
            return None
        if t <= pts[0][0]:
            return pts[0][1]
        for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
            if t0 <= t <= t1:
                return v0 + (v1 - v0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
        return pts[-1][1]

    def rate(self, t0: float, t1: float, key: str, tenant: str) -> float | None:
        a, b = self.counter_at(t0, key, tenant), self.counter_at(t1, key, tenant)
        return None if a is None or b is None or t1 <= t0 else (b - a) / (t1 - t0)


class Victim:
    """The victim tenant's requests (`run`: at a steady rate)."""

    def __init__(self, client: httpx.AsyncClient, url: str, model: str, kind: str, nonce: str, opts: dict):
        self.client, self.url, self.model, self.kind, self.nonce, self.opts = client, url, model, kind, nonce, opts
        self.samples: list[dict] = []
        self.side: list[tuple] = []  # attack 4: the attacker's copies sent from here (t0, t1, status, code, tokens)
        self._pending: list[asyncio.Task] = []
        self.i = 0

    async def one(self, phase: str, attacking: bool) -> None:
        self.i += 1
        tag = f"{self.nonce}_{self.i}"
        if self.kind == "stream":
            body = chat(self.model, f"where is my parcel {self.i}", self.opts["victim_tokens"], stream=True,
                        ignore_eos=True)
        elif self.kind == "large":
            body = chat(self.model, f"a short question {self.i}", self.opts["victim_tokens"], user="u" * 18000)
        elif self.kind in ("schema", "shared"):
            body = chat(self.model, "a user record", self.opts["victim_tokens"], response_format=victim_schema(tag))
        else:
            raise ValueError(self.kind)
        side = None
        if self.kind == "shared":
            if attacking:  # the attacker sends the victim's schema first, behind its own queue
                side = asyncio.create_task(self._attacker_copy(body))
            await asyncio.sleep(self.opts["share_lead_s"])  # in both phases: the same pace
        t0 = time.monotonic()
        status, code, ttft = 0, "", None
        try:
            if self.kind == "stream":
                async with self.client.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                                              headers={TENANT_HEADER: VICTIM}) as r:
                    status = r.status_code
                    async for line in r.aiter_lines():
                        if ttft is None and line.startswith("data: {"):
                            ch = json.loads(line[6:]).get("choices") or []
                            if ch and (ch[0].get("delta") or {}).get("content"):
                                ttft = time.monotonic() - t0
                    if status != 200:
                        code = "http"
            else:
                r = await self.client.post(f"{self.url}/v1/chat/completions", json=body,
                                           headers={TENANT_HEADER: VICTIM})
                status = r.status_code
                if status != 200:
                    try:
                        code = r.json()["error"]["code"] or ""
                    except (ValueError, KeyError, TypeError):
                        code = "http"
        except httpx.HTTPError as e:
            code = type(e).__name__
        except asyncio.CancelledError:  # still waiting at the phase's end + --victim-grace-s
            t1 = time.monotonic()
            if ttft is not None:  # its first token came: a whole TTFT sample
                self.samples.append({"phase": phase, "t0": t0, "t1": t1, "status": 200, "code": "",
                                     "latency": ttft, "total": t1 - t0})
            else:  # censored: its latency is at least this
                self.samples.append({"phase": phase, "t0": t0, "t1": t1, "status": 0, "code": "unfinished",
                                     "latency": None, "at_least": t1 - t0, "total": t1 - t0})
            if side is not None:
                self._pending.append(side)
            raise
        t1 = time.monotonic()
        lat = (ttft if ttft is not None else t1 - t0) if self.kind == "stream" else t1 - t0  # no text: its end
        self.samples.append({"phase": phase, "t0": t0, "t1": t1, "status": status, "code": code,
                             "latency": lat if status == 200 and lat is not None else None, "total": t1 - t0})
        if side is not None:
            self._pending.append(side)

    async def _attacker_copy(self, body: dict) -> None:
        t0 = time.monotonic()
        try:
            r = await self.client.post(f"{self.url}/v1/chat/completions", json=body,
                                       headers={TENANT_HEADER: ATTACKER}, timeout=900)
            status, code = r.status_code, ""
            if status != 200:
                try:
                    code = r.json()["error"]["code"] or ""
                except (ValueError, KeyError, TypeError):
                    code = "http"
        except (httpx.HTTPError, asyncio.CancelledError):
            status, code = 0, "hung up"
        self.side.append((t0, time.monotonic(), status, code, 0))

    async def run(self, phase: str, seconds: float, attacking: bool) -> None:
        """Requests at a steady rate (an open loop: a slow answer does not slow the arrivals), at most
        `victim_outstanding` in flight; then the phase's requests are waited for, --victim-grace-s at
        most (those still waiting then are cancelled and counted as unfinished, latency at least)."""
        start = now = time.monotonic()
        end, gap, k = start + seconds, 1.0 / self.opts["victim_rate"], 0
        inflight: set[asyncio.Task] = set()
        while now < end:
            if len(inflight) >= self.opts["victim_outstanding"]:  # arrivals wait (until the phase's end)
                _, inflight = await asyncio.wait(inflight, timeout=end - now, return_when=asyncio.FIRST_COMPLETED)
                now = time.monotonic()
                k = max(k, int((now - start) / gap))  # the arrivals missed meanwhile are skipped, not burst
                continue
            inflight.add(asyncio.create_task(self.one(phase, attacking)))
            k += 1
            await asyncio.sleep(max(0.0, start + k * gap - time.monotonic()))
            inflight = {t for t in inflight if not t.done()}
            now = time.monotonic()
        if inflight:
            _, late = await asyncio.wait(inflight, timeout=self.opts["victim_grace_s"])
            for t in late:
                t.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)

    async def hang_up(self) -> None:
        for t in self._pending:
            t.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        self._pending = []


def summarise_victim(samples: list[dict], phase: str) -> dict:
    mine = [s for s in samples if s["phase"] == phase]
    lat = [s["latency"] for s in mine if s["latency"] is not None]
    censored = [s["at_least"] for s in mine if s.get("at_least") is not None]
    both = lat + censored  # an unfinished request counts with its wait so far: the quantiles are lower bounds
    statuses: dict[str, int] = {}
    for s in mine:
        key = (s["code"] or "error") if not s["status"] else str(s["status"]) + (f" {s['code']}" if s["code"] else "")
        statuses[key] = statuses.get(key, 0) + 1
    return {"n": len(mine), "ok": len(lat), "unfinished": len(censored), "p50": pct(both, 0.5),
            "p95": pct(both, 0.95), "max": max(both) if both else None, "statuses": statuses,
            "refused_429": sum(1 for s in mine if s["status"] == 429)}


def summarise_attacker(records: list, t0: float, t1: float, sampler: Sampler, tenant: str = ATTACKER) -> dict:
    done = [r for r in records if t0 <= r[1] <= t1]
    statuses: dict[str, int] = {}
    for r in done:
        key = str(r[2]) + (f" {r[3]}" if r[3] else "")
        statuses[key] = statuses.get(key, 0) + 1
    span = max(t1 - t0, 1e-9)
    answered = sum(1 for r in done if r[2] not in (0, 429))
    return {"seconds": round(span, 2), "completed": len(done), "answered": answered,
            "answered_per_s": answered / span, "refused_429": sum(1 for r in done if r[2] == 429),
            "statuses": statuses, "gen_tokens_per_s": sampler.rate(t0, t1, "gen", tenant),
            "prompt_tokens_per_s": sampler.rate(t0, t1, "prompt", tenant)}


async def settle(sampler: Sampler, workers: int, timeout: float) -> float:
    """Wait until nothing runs or waits on the replica (engine, prep, grammar) and every grammar
    worker is back; the seconds it took."""
    t0 = time.monotonic()
    quiet = 0
    while time.monotonic() - t0 < timeout:
        s = await sampler.one()
        if s is not None and not s["running"] and not s["waiting"] and not s["queued"] \
                and s["grammar_workers"] >= workers:
            quiet += 1
            if quiet >= 2:
                return time.monotonic() - t0
        else:
            quiet = 0
        await asyncio.sleep(0.25)
    return time.monotonic() - t0


class Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="phase", file=sys.stderr, dynamic_ncols=True)

    def phase(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)
        else:
            print(f"[fairness] {text}", file=sys.stderr, flush=True)

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def attacker_conc(kind: str, a) -> int:
    return {"n16": a.n16_requests, "huge": a.huge_loops, "flood": a.flood, "queue": a.queue_depth}[kind]


def attacker_opts(a, slow_base: int) -> dict:
    return {"n16_n": a.n16_n, "n16_max_tokens": a.n16_max_tokens, "huge_bytes": a.huge_kb * 1000,
            "slow_base": slow_base}


async def run_attack(aid: str, rep: Replica, model_name: str, a, prog: Progress, nonce: str, slow_base: int) -> dict:
    spec = ATTACKS[aid]
    engine_bound = spec["victim"] in ("stream", "large")
    opts = {"victim_tokens": a.victim_tokens if spec["victim"] == "stream" else a.victim_tokens_other,
            "share_lead_s": a.share_lead_s,
            "victim_rate": a.victim_rate if engine_bound else a.victim_schema_rate,
            "victim_outstanding": a.victim_outstanding if engine_bound else 1, "victim_grace_s": a.victim_grace_s}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.victim_timeout_s, connect=60), limits=limits) as client:
        sampler = Sampler(client, rep.url, a.sample_s)
        victim = Victim(client, rep.url, model_name, spec["victim"], f"{nonce}{aid.replace('-', '')}", opts)
        load0 = os.getloadavg()[0]
        sampler.start()
        # a short warm-up of the victim's path (first compile, first prefill), not measured
        await victim.run("warmup", min(2.0, a.baseline_s / 4), attacking=False)
        phases = []
        prog.phase(f"{rep.model_label} attack {aid}: baseline")
        b0 = time.monotonic()
        await victim.run("baseline", a.baseline_s, attacking=False)
        b1 = time.monotonic()
        phases.append({"name": "baseline", "t0": b0, "t1": b1})
        prog.step()
        prog.phase(f"{rep.model_label} attack {aid}: attack")
        kind = spec["attacker"]
        attacker = Attacker(rep.url, model_name, kind, attacker_conc(kind, a), attacker_opts(a, slow_base))
        w0 = time.monotonic()
        await attacker.start()
        await asyncio.sleep(a.warm_s)
        a0 = time.monotonic()
        phases.append({"name": "attack warm-up", "t0": w0, "t1": a0})
        await victim.run("attack", a.attack_s, attacking=True)
        a1 = time.monotonic()
        phases.append({"name": "attack", "t0": a0, "t1": a1})
        prog.step()
        prog.phase(f"{rep.model_label} attack {aid}: attacker alone")
        await asyncio.sleep(a.tail_s)
        c1 = time.monotonic()
        phases.append({"name": "attacker alone", "t0": a1, "t1": c1})
        records = await attacker.stop()
        await victim.hang_up()
        h1 = time.monotonic()
        prog.step()
        prog.phase(f"{rep.model_label} attack {aid}: settling")
        settle_s = await settle(sampler, a.grammar_workers, a.settle_timeout_s)
        await sampler.stop()
    records = sorted(records + victim.side)
    base, att = summarise_victim(victim.samples, "baseline"), summarise_victim(victim.samples, "attack")
    ratio = att["p95"] / base["p95"] if base["p95"] and att["p95"] is not None else None
    during = summarise_attacker(records, a0, a1, sampler)
    alone = summarise_attacker(records, a1, c1, sampler)
    rel = lambda t: round(t - b0, 3)  # noqa: E731  (seconds from the baseline's start; the warm-up is before 0)
    res = {
        "id": aid, **spec, "replica_flags": rep.flags,
        "victim_baseline": base, "victim_attack": att, "p95_ratio": ratio,
        "target_met": (ratio is not None and ratio <= P95_TARGET and att["n"] == att["ok"]),
        "attacker_attack": during, "attacker_alone": alone, "settle_s": round(settle_s, 2),
        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "phases": [{"name": p["name"], "t0": rel(p["t0"]), "t1": rel(p["t1"])} for p in phases],
        "hung_up_at": rel(h1),
        "victim_requests": [[rel(s["t0"]), rel(s["t1"]), s["status"], s["code"],
                             None if s["latency"] is None else round(s["latency"], 4), s["phase"]]
                            for s in victim.samples],
        "attacker_requests": [[rel(r[0]), rel(r[1]), r[2], r[3], r[4]] for r in records],
        "metrics": [[rel(t), s["gen"], s["prompt"], s["running"], s["waiting"], s["queued"], s["preempted_share"]]
                    for t, s in sampler.samples],
    }
    ok = "met" if res["target_met"] else "NOT met"
    prog.write(f"{rep.model_label} attack {aid}: victim p50/p95 {_f(base['p50'])}/{_f(base['p95'])} s -> "
               f"{_f(att['p50'])}/{_f(att['p95'])} s (x{_f(ratio, 2)}, {ok}); victim 429s {att['refused_429']}; "
               f"attacker {_attacker_line(during)} during, {_attacker_line(alone)} alone; settled in {settle_s:.1f} s")
    return res


def _f(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _attacker_line(s: dict) -> str:
    if s.get("gen_tokens_per_s") and s["gen_tokens_per_s"] > 1:
        return f"{s['gen_tokens_per_s']:.0f} tok/s"
    return f"{s['answered_per_s']:.2f} answers/s ({s['refused_429']} x 429)"


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) a process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


async def run_alone(reps: dict[str, Replica], model_name: str, a, prog: Progress) -> dict:
    """Attack 1's load from one tenant alone, on the fair and the fifo replica in turn (ABBA order,
    so a drift of the box's load hits both alike): generated tokens/s, and per CPU-second of the
    replica process (what the load of other processes cannot move)."""
    rounds = []
    async with httpx.AsyncClient(timeout=60) as client:
        for sched, rep in sorted(reps.items()) if a.alone_warmup_s > 0 else ():  # a first pass on each, unmeasured
            prog.phase(f"{rep.model_label} tenant alone: warming {sched}")
            sampler = Sampler(client, rep.url, a.sample_s)
            attacker = Attacker(rep.url, model_name, "n16", a.n16_requests, attacker_opts(a, 0), tenant=ALONE)
            await attacker.start()
            await asyncio.sleep(a.alone_warmup_s)
            await attacker.stop()
            await settle(sampler, a.grammar_workers, a.settle_timeout_s)
        for r in range(a.alone_rounds):
            for sched in ("fair", "fifo") if r % 2 == 0 else ("fifo", "fair"):
                rep = reps[sched]
                prog.phase(f"{rep.model_label} tenant alone: {sched} round {r + 1}")
                sampler = Sampler(client, rep.url, a.sample_s)
                sampler.start()
                attacker = Attacker(rep.url, model_name, "n16", a.n16_requests, attacker_opts(a, 0), tenant=ALONE)
                await attacker.start()
                await asyncio.sleep(a.warm_s)
                await sampler.one()
                t0, c0 = time.monotonic(), cpu_seconds(rep.proc.pid)
                await asyncio.sleep(a.alone_s)
                await sampler.one()
                t1, c1 = time.monotonic(), cpu_seconds(rep.proc.pid)
                await attacker.stop()
                await settle(sampler, a.grammar_workers, a.settle_timeout_s)
                await sampler.stop()
                tps = sampler.rate(t0, t1, "gen", ALONE)
                cpu = c1 - c0 if c0 is not None and c1 is not None else None
                per_cpu = tps * (t1 - t0) / cpu if tps is not None and cpu else None
                inside = [x for t, x in sampler.samples if t0 <= t <= t1]
                rows = statistics.mean(x["running"] for x in inside) if inside else None
                rounds.append({"scheduling": sched, "round": r + 1, "seconds": round(t1 - t0, 2),
                               "gen_tokens_per_s": tps, "replica_cpu_s": cpu, "gen_tokens_per_cpu_s": per_cpu,
                               "mean_running": rows, "loadavg": round(os.getloadavg()[0], 2)})
                prog.write(f"{rep.model_label} tenant alone, {sched} round {r + 1}: {_f(tps, 1)} tok/s, "
                           f"{_f(per_cpu, 1)} tok per replica CPU-s")
                prog.step()
    out: dict = {"rounds": rounds}
    for key, name in (("gen_tokens_per_s", "tokens_per_s"), ("gen_tokens_per_cpu_s", "tokens_per_cpu_s")):
        for s in ("fair", "fifo"):
            xs = [x[key] for x in rounds if x["scheduling"] == s and x[key] is not None]
            out[f"{s}_{name}"] = statistics.median(xs) if xs else None
        pairs = [(f[key], o[key]) for f in rounds for o in rounds
                 if f["scheduling"] == "fair" and o["scheduling"] == "fifo" and f["round"] == o["round"]
                 and f[key] and o[key]]
        out[f"ratio_{name}"] = statistics.median(x / y for x, y in pairs) if pairs else None
    out["ratio"] = out["ratio_tokens_per_s"]  # the median of each round's fair / fifo
    out["target_met"] = out["ratio"] is not None and out["ratio"] >= ALONE_TARGET
    return out


def model_base(which: str, a) -> Path:
    if which == "dev":
        if a.dev_base:
            return Path(a.dev_base)
        sys.path.insert(0, str(REPO))
        from tests.conftest import _dev_model

        return _dev_model("tiny")
    base = Path(a.real_base)
    if not (base / "config.json").is_file():
        raise SystemExit(f"--real-base {base}: no model there; make it with "
                         f"`.venv/bin/lorafarm realmodel --out {base}` (or `make bench-fairness`)")
    return base


async def run_model(which: str, a, prog: Progress) -> dict:
    base = model_base(which, a)
    model_name = MODELS[which]
    started = dt.datetime.now(dt.timezone.utc)
    load0 = os.getloadavg()
    attacks = [x for x in ORDER if x in a.attacks]
    need = {ATTACKS[x]["scheduling"] for x in attacks} | ({"fair", "fifo"} if a.alone_rounds else set())
    tmp = Path(tempfile.mkdtemp(prefix=f"fairness-{which}-"))
    extra = a.replica_args.split() if a.replica_args else []
    reps: dict[str, Replica] = {}
    nonce = f"{random.randrange(16**6):06x}"
    try:
        prog.phase(f"{which}: starting {len(need)} replica(s)")
        for sched in sorted(need, key=lambda x: a.replica_order.split(",").index(x)):
            reps[sched] = Replica(base, model_name, sched, tmp, extra, label=which)
        for rep in reps.values():
            await asyncio.to_thread(rep.wait_healthy)
        alone = await run_alone(reps, model_name, a, prog) if a.alone_rounds else None
        results = []
        for i, aid in enumerate(attacks):
            rep = reps[ATTACKS[aid]["scheduling"]]
            res = await run_attack(aid, rep, model_name, a, prog, nonce, slow_base=300 + 1000 * i)
            res["replica_alive"] = rep.proc.poll() is None
            results.append(res)
            if not res["replica_alive"]:
                raise RuntimeError(f"the replica died during attack {aid}: {rep.log()}")
    finally:
        for rep in reps.values():
            rep.stop()
    return {
        "model": which, "model_name": model_name, "base": str(base),
        "started": started.isoformat(timespec="seconds"),
        "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_before": [round(x, 2) for x in load0], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(), "git": git_rev(), "command": " ".join(["python -m benchmarks.fairness", *a.argv]),
        "settings": {k: v for k, v in vars(a).items() if k not in ("argv", "report_from", "to")},
        "replica_flags": next(iter(reps.values())).flags if reps else [],
        "attacks": results, "alone": alone,
    }


async def run_all(a) -> list[Path]:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    phases = 0
    for _ in models:
        phases += 3 * len([x for x in ORDER if x in a.attacks]) + 2 * a.alone_rounds
    prog = Progress(phases, enabled=not a.no_progress)
    written = []
    try:
        for which in models:
            res = await run_model(which, a, prog)
            res["tag"] = a.tag or None
            path = out / (f"{which}-{a.tag}.json" if a.tag else f"{which}.json")
            path.write_text(json.dumps(res, indent=1) + "\n")
            written.append(path)
            prog.write(f"{which}: results in {path}")
    finally:
        prog.close()
    return written


# ------------------------------------------------------------------------------------- the report

def _fmt_s(x) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _attacker_cell(att: dict, aid: str) -> str:
    d, al = att["attacker_attack"], att["attacker_alone"]
    if ATTACKS.get(aid, {}).get("attacker") == "n16":
        gd, ga = d.get("gen_tokens_per_s"), al.get("gen_tokens_per_s")
        share = f" ({gd / ga:.0%} of alone)" if gd and ga else ""
        return f"{_f(gd, 0)} tok/s during, {_f(ga, 0)} alone{share}"
    cell = f"{d['answered_per_s']:.2f}/s answered during, {al['answered_per_s']:.2f}/s alone"
    if d["refused_429"] or al["refused_429"]:
        cell += f"; its own 429s: {d['refused_429'] + al['refused_429']}"
    return cell


def _plot(res: dict, att: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)
    colors = {VICTIM: "tab:blue", ATTACKER: "tab:red"}
    ms = att["metrics"]
    ax = axes[0]
    for tenant in (VICTIM, ATTACKER):
        xs, ys = [], []
        for (t0, g0, *_), (t1, g1, *_) in zip(ms, ms[1:]):
            if t1 > t0:
                xs.append(t1)
                ys.append(max(0.0, (g1.get(tenant, 0) - g0.get(tenant, 0)) / (t1 - t0)))
        if any(ys):
            ax.plot(xs, ys, color=colors[tenant], label=tenant, lw=1.2)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("generated tokens/s\n(replica /metrics)")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[1]
    end = max([p["t1"] for p in att["phases"]] + [att.get("hung_up_at", 0)])
    lo = int(math.floor(min(p["t0"] for p in att["phases"])))
    bins = max(1, int(math.ceil(end)) - lo)

    def per_second(rows, pred):
        counts = [0] * (bins + 1)
        for r in rows:
            if pred(r) and lo <= r[1] <= lo + bins:
                counts[int(r[1] - lo)] += 1
        return counts

    xs = [lo + i + 0.5 for i in range(bins + 1)]
    ax.step(xs, per_second(att["victim_requests"], lambda r: r[2] == 200), where="mid", color=colors[VICTIM],
            label="victim answered")
    vict429 = per_second(att["victim_requests"], lambda r: r[2] == 429)
    if any(vict429):
        ax.step(xs, vict429, where="mid", color="tab:purple", label="victim 429")
    ax.step(xs, per_second(att["attacker_requests"], lambda r: r[2] not in (0, 429)), where="mid",
            color=colors[ATTACKER], label="attacker answered")
    att429 = per_second(att["attacker_requests"], lambda r: r[2] == 429)
    if any(att429):
        ax.step(xs, att429, where="mid", color="tab:orange", label="attacker 429", alpha=0.7)
    ax.set_yscale("symlog", linthresh=5)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("requests finished / s\n(client)")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    pts = [(r[0], r[4]) for r in att["victim_requests"] if r[4] is not None and r[5] != "warmup"]
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, color=colors[VICTIM])
        ax.set_yscale("log")
    ax.set_ylabel(f"victim {'TTFT' if att['victim'] == 'stream' else 'request time'} (s)")
    ax.set_xlabel("seconds")
    shades = {"baseline": "#e8f0ff", "attack warm-up": "#fff1e0", "attack": "#ffe0e0", "attacker alone": "#f0f0f0"}
    short = {"attack warm-up": "warm", "attacker alone": "alone"}
    for axx in axes:
        for p in att["phases"]:
            axx.axvspan(p["t0"], p["t1"], color=shades.get(p["name"], "#ffffff"), zorder=0)
        axx.set_xlim(min(p["t0"] for p in att["phases"]) - 1, end + 1)
    for p in att["phases"]:
        axes[0].text((p["t0"] + p["t1"]) / 2, 1.02, short.get(p["name"], p["name"]),
                     transform=axes[0].get_xaxis_transform(), ha="center", fontsize=7)
    fig.suptitle(f"{res['model']} model ({res['model_name']}), attack {att['id']}: {att['title']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def describe(st: dict) -> list[str]:
    """The attacks' table, from a run's settings."""
    g = lambda k, d: st.get(k, d)  # noqa: E731
    return [
        "| attack | the attacker | the victim |", "|---|---|---|",
        f"| 1 | {g('n16_requests', 4)} concurrent `n={g('n16_n', 16)}, max_tokens={g('n16_max_tokens', 600)}` "
        "chats (`ignore_eos`; twice the 32-row batch), each loop sending the next when one ends | "
        f"short streamed chats ({g('victim_tokens', 8)} tokens) at {g('victim_rate', 3):g}/s: their TTFT |",
        f"| 2 | {g('huge_loops', 1)} loop(s) of ~{g('huge_kb', 900)} KB prompts (past the context: 400) | "
        f"18 KB requests (over the 16 KiB inline limit: parsed and tokenized on the prep threads; "
        f"{g('victim_tokens_other', 4)} tokens) at {g('victim_rate', 3):g}/s: their time |",
        f"| 3 | {g('flood', 140)} concurrent distinct slow-to-refuse schemas "
        "`{\"type\":\"string\",\"pattern\":\"^(a{1000}){N}$\"}` (a compile that ran to the replica's "
        "`--grammar-timeout-s`, 4 s, before its lexer-fuel bound; now a 400 after ~0.2 s of a worker); a 429 is "
        "retried after its `Retry-After` (1 s) | requests with "
        "a new schema each (a compile each), one at a time: their time, and the victim's 429s |",
        f"| 4 | {g('queue_depth', 8)} slow schemas kept in flight (its own worker slot and queue), then the "
        f"schema the victim is about to use | that schema, {g('share_lead_s', 0.3):g} s after the attacker's, "
        "one at a time: its time |",
        "| 1-fifo | attack 1 against the `--scheduling fifo` replica | as 1 |", ""]


def render(src: Path, to: Path) -> Path:
    order = lambda p: (list(MODELS).index(p.stem.split("-")[0]) if p.stem.split("-")[0] in MODELS else 99,  # noqa: E731
                       p.stem)
    files = sorted(src.glob("*.json"), key=order)
    runs = []
    for f in files:
        try:
            js = json.loads(f.read_text())
        except ValueError:
            continue
        if isinstance(js, dict) and "attacks" in js and "model" in js:
            runs.append(js)
    if not runs:
        raise SystemExit(f"--report-from {src}: no results (run `python -m benchmarks.fairness --out {src}` first)")
    plots = to / "fairness"
    plots.mkdir(parents=True, exist_ok=True)
    L = ["# Fair share per tenant: the attack benchmark", "",
         "<!-- generated by `python -m benchmarks.fairness --report-from var/fairness --to docs` "
         "(make bench-fairness-docs); edit benchmarks/fairness.py, not this file -->", "",
         "Issue 35's acceptance benchmark: a hostile tenant (`attacker`) against an ordinary one (`victim`) on "
         "one real replica. Each attack has three phases: the victim alone (baseline), the attacker started "
         "and the victim measured (attack), the victim stopped and the attacker alone (the idle share it gets "
         "back); then the attacker hangs up and the replica settles before the next attack. The victim's "
         "p95 during the attack is compared with its baseline of the same run (the box is shared: load "
         "drifts between runs, never within the comparison).", "",
         "How it is driven: `benchmarks/fairness.py` starts `lorafarm replica` processes on 127.0.0.1, "
         "standalone (no registry), with the product's defaults except `--slots 1 --prefetch-interval-s 0` "
         "(no adapters are used), one with `--scheduling fair` (the default) and one with `--scheduling fifo` "
         "(the engine as it was: \"today\"). **Requests go straight to the replica, no router in between**, "
         "with the header the router sets from the API key (`x-lorafarm-tenant`). The attacker runs in its own "
         "process; the victim and a sampler of the replica's `/metrics` (`lorafarm_tenant_generation_tokens_total` "
         "per tenant, every 0.5 s) in the benchmark's. Only the engine has a fifo switch: attacks 2-4 exercise "
         "the prep and grammar queues, which are fair in both replicas.", "",
         *describe(runs[0]["settings"]),
         f"Targets: victim p95 during each attack <= {P95_TARGET:g}x its baseline p95 (and no victim request "
         f"refused); a tenant alone (attack 1's load, nobody else) >= {ALONE_TARGET:g}x its tokens/s today "
         "(fifo), fair and fifo rounds interleaved. The other targets of the acceptance (poison refusals after "
         "crashes, the killer body) are tests, not this benchmark (tests/reliability/test_poison.py).", "",
         "Run: `make bench-fairness` (both models, ~15 min on a 2-core box; results in `var/fairness/`, "
         "untracked), then `make bench-fairness-docs` to rewrite this page and `docs/fairness/`.", ""]
    for run in runs:
        la0, la1 = run["loadavg_before"], run["loadavg_after"]
        title = f"## {run['model']} model: {run['model_name']}"
        if run.get("tag"):
            title += f" ({run['tag']}{': tenant alone only' if not run['attacks'] else ''})"
        L += [title, "",
              f"{run['started'][:16].replace('T', ' ')} UTC to {run['finished'][11:16]}, {run['cpus']} CPUs, "
              f"load average {la0[0]:.2f} / {la0[1]:.2f} / {la0[2]:.2f} before and {la1[0]:.2f} / {la1[1]:.2f} / "
              f"{la1[2]:.2f} after, commit {run['git']}.", "",
              f"Command: `{run['command']}`", "",
              f"Replica: `lorafarm replica {' '.join(_short_flags(run['replica_flags']))}`", ""]
        if run["attacks"]:
            L += ["| attack | victim measures | baseline p50 / p95 | during p50 / p95 | p95 ratio | target <= "
                  f"{P95_TARGET:g}x | victim requests (baseline, during) | victim not answered | attacker "
                  "throughput |", "|---|---|---|---|---|---|---|---|---|"]
        for att in run["attacks"]:
            b, d = att["victim_baseline"], att["victim_attack"]
            refused = d["n"] - d["ok"]
            refused_cell = "0" if not refused else ", ".join(f"{v} x {k}" for k, v in d["statuses"].items()
                                                            if not k.startswith("200"))
            ge = ">= " if d.get("unfinished") else ""  # unfinished requests: lower bounds
            verdict = "met" if att["target_met"] else "**not met**"
            if att.get("scheduling") == "fifo":
                verdict = "not met (today)" if not att["target_met"] else "met (today)"
            L.append(f"| {att['id']}: {att['title']} | {att['metric']} | {_fmt_s(b['p50'])} / {_fmt_s(b['p95'])} | "
                     f"{ge}{_fmt_s(d['p50'])} / {ge}{_fmt_s(d['p95'])} | "
                     f"{'-' if att['p95_ratio'] is None else ge + format(att['p95_ratio'], '.2f') + 'x'} | "
                     f"{verdict} | {b['n']}, {d['n']} | {refused_cell} | {_attacker_cell(att, att['id'])} |")
        L.append("")
        al = run.get("alone")
        if al:
            L += [f"Tenant alone: attack 1's load from one tenant, nobody else, {len(al['rounds']) // 2} rounds on "
                  "each replica in ABBA order (fair, fifo, fifo, fair, ...), generated tokens/s after the warm-up, "
                  "and the same tokens per CPU-second of the replica process (which the other processes on the "
                  "box cannot move). The ratio is the median of each round's fair / fifo.", "",
                  "| scheduling | rounds: tok/s | median tok/s | rounds: tok per replica CPU-s | median | "
                  f"ratio fair / fifo (tok/s; per CPU-s) | target >= {ALONE_TARGET:g} |",
                  "|---|---|---|---|---|---|---|"]
            for s in ("fair", "fifo"):
                mine = [x for x in al["rounds"] if x["scheduling"] == s]
                rs = ", ".join(_f(x["gen_tokens_per_s"], 0) for x in mine)
                rc = ", ".join(_f(x.get("gen_tokens_per_cpu_s"), 0) for x in mine)
                ratio = met = ""
                if s == "fair":
                    ratio = f"{_f(al.get('ratio'), 3)}; {_f(al.get('ratio_tokens_per_cpu_s'), 3)}"
                    met = "met" if al["target_met"] else "**not met**"
                L.append(f"| {s} | {rs} | {_f(al.get(f'{s}_tokens_per_s'), 0)} | {rc} | "
                         f"{_f(al.get(f'{s}_tokens_per_cpu_s'), 0)} | {ratio} | {met} |")
            L.append("")
        extra = []
        for att in run["attacks"]:
            ds = att["victim_attack"]
            la = att.get("loadavg_1m") or [None, None]
            line = (f"- attack {att['id']}: 1-min load average {_f(la[0], 1)} at its start, "
                    f"{_f(la[1], 1)} at its end; the victim's statuses during it {ds['statuses']}, "
                    f"the attacker's {att['attacker_attack']['statuses']}; the replica settled "
                    f"{att['settle_s']:.1f} s after the attacker hung up")
            alone_tps = att["attacker_alone"].get("gen_tokens_per_s")
            if att["attacker"] == "n16" and alone_tps:
                step = 32 / alone_tps  # a full batch (the replica's default --max-batch 32) per decode step
                line += (f"; the attacker alone decodes {alone_tps:.0f} tokens/s, so one 32-row decode step "
                         f"takes ~{step * 1000:.0f} ms: the victim's p95 during the attack is "
                         f"{(ds['p95'] or 0) / step:.1f} steps")
            extra.append(line + ".")
        if extra:
            L += ["Details:", "", *extra, ""]
        for att in run["attacks"]:
            name = f"{run['model']}{'-' + run['tag'] if run.get('tag') else ''}-attack{att['id']}.png"
            _plot(run, att, plots / name)
            L += [f"![{run['model']} attack {att['id']}](fairness/{name})", ""]
    L += ["Each plot: generated tokens per second per tenant from the replica's counters (top), requests "
          "finished per second per tenant as the clients saw them (middle), and each victim request's "
          "latency (bottom), over the phases of the attack (shaded).", ""]
    notes = plots / "notes.md"  # hand-written reading of the figures, kept across renders
    if notes.is_file():
        L += ["## Reading the figures", "", notes.read_text().strip(), ""]
    doc = to / "fairness.md"
    doc.write_text("\n".join(L))
    return doc


def _short_flags(flags: list[str]) -> list[str]:
    """The replica's flags without the per-run paths and port."""
    out, skip = [], False
    for i, f in enumerate(flags):
        if skip:
            skip = False
            continue
        if f in ("--port", "--disk-dir", "--id"):
            skip = True
            continue
        if f == "--base":
            out += [f, Path(flags[i + 1]).name]
            skip = True
            continue
        out.append(f)
    return out


# ------------------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fairness", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report-from", default=None, metavar="DIR",
                    help="render DIR's results into --to (docs/fairness.md, docs/fairness/*.png) and exit")
    ap.add_argument("--to", default=str(REPO / "docs"), help="docs folder for --report-from (default docs)")
    ap.add_argument("--models", default="dev,real", help="dev, real or both (default dev,real)")
    ap.add_argument("--dev-base", default=None, help="dev model folder (default: generated, tests.conftest)")
    ap.add_argument("--real-base", default=str(REPO / "var/peers/smollm2-135m-instruct"),
                    help="real model folder (`lorafarm realmodel --out DIR`; default var/peers/smollm2-135m-instruct)")
    ap.add_argument("--out", default=str(REPO / "var/fairness"), help="results folder (default var/fairness)")
    ap.add_argument("--attacks", default=",".join(ORDER), help=f"which (default {','.join(ORDER)})")
    ap.add_argument("--baseline-s", type=float, default=15.0, help="victim alone, per attack (default 15)")
    ap.add_argument("--attack-s", type=float, default=20.0, help="victim measured under attack (default 20)")
    ap.add_argument("--warm-s", type=float, default=3.0,
                    help="attack established before the victim is measured; also the tenant-alone warm-up (default 3)")
    ap.add_argument("--tail-s", type=float, default=8.0, help="attacker alone after the attack (default 8)")
    ap.add_argument("--alone-s", type=float, default=8.0, help="tenant-alone window per round (default 8)")
    ap.add_argument("--alone-warmup-s", type=float, default=5.0,
                    help="tenant alone: an unmeasured first pass on each replica (first batches; 0: none; default 5)")
    ap.add_argument("--alone-rounds", type=int, default=4,
                    help="tenant-alone rounds per scheduling, ABBA order (0: skip; default 4)")
    ap.add_argument("--sample-s", type=float, default=0.5, help="/metrics sampling period (default 0.5)")
    ap.add_argument("--settle-timeout-s", type=float, default=180.0)
    ap.add_argument("--victim-tokens", type=int, default=8)
    ap.add_argument("--victim-tokens-other", type=int, default=4,
                    help="max_tokens of the victim's requests in attacks 2-4 (default 4)")
    ap.add_argument("--victim-rate", type=float, default=3.0,
                    help="attacks 1 and 2: victim requests per second (an open loop; default 3)")
    ap.add_argument("--victim-outstanding", type=int, default=8,
                    help="attacks 1 and 2: victim requests in flight at most (arrivals wait above; default 8)")
    ap.add_argument("--victim-schema-rate", type=float, default=4.0,
                    help="attacks 3 and 4: victim requests per second at most, one at a time (each a new "
                         "compile: a closed loop, so the victim never queues behind itself; default 4)")
    ap.add_argument("--victim-timeout-s", type=float, default=300.0)
    ap.add_argument("--victim-grace-s", type=float, default=60.0,
                    help="after a phase, its victim requests still waiting are waited for this long, then counted "
                         "unfinished with their wait so far (a lower bound; default 60)")
    ap.add_argument("--share-lead-s", type=float, default=0.3,
                    help="attack 4: the attacker's copy of the victim's schema goes this long before the victim's")
    ap.add_argument("--n16-requests", type=int, default=4)
    ap.add_argument("--n16-n", type=int, default=16)
    ap.add_argument("--n16-max-tokens", type=int, default=600)
    ap.add_argument("--huge-kb", type=int, default=900)
    ap.add_argument("--huge-loops", type=int, default=1, help="attack 2: concurrent loops of huge prompts (default 1)")
    ap.add_argument("--flood", type=int, default=140, help="attack 3: concurrent slow schemas (default 140)")
    ap.add_argument("--queue-depth", type=int, default=8, help="attack 4: slow schemas kept queued (default 8)")
    ap.add_argument("--grammar-workers", type=int, default=2, help="the replica's (default 2; for settling)")
    ap.add_argument("--replica-order", default="fair,fifo", choices=["fair,fifo", "fifo,fair"],
                    help="which replica starts first (default fair,fifo)")
    ap.add_argument("--replica-args", default="", help="extra flags for both replicas, one string")
    ap.add_argument("--tag", default="", help="results as MODEL-TAG.json (a separate section of the report), "
                    "e.g. a longer tenant-alone run: --attacks '' --alone-rounds 8 --tag alone")
    ap.add_argument("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    a.argv = argv
    if a.report_from:
        doc = render(Path(a.report_from), Path(a.to))
        print(f"wrote {doc} and {Path(a.to) / 'fairness'}/*.png")
        return 0
    a.attacks = [x.strip() for x in a.attacks.split(",") if x.strip()]
    bad = [x for x in a.attacks if x not in ATTACKS]
    if bad:
        raise SystemExit(f"--attacks: unknown {bad} (known: {', '.join(ORDER)})")
    written = asyncio.run(run_all(a))
    print("\n".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
