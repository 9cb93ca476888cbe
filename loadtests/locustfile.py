"""The lorafarm locust suite: streamed OpenAI chat completions through the router.

Run headless by `lorafarm loadtest`, or by hand:

    locust -f loadtests/locustfile.py --headless -u 1 -r 1 --host http://127.0.0.1:8000 \\
        --api-key sk-... --models-file models.txt --arrival-rate 4 --duration 60 --csv var/lt

One `FarmClient` user is a dispatcher, not a simulated customer:
- `--mode open` (default): it sends the seeded workload of loadtests.workload at its arrival
  times (Poisson at --arrival-rate, Zipf over the models file, log-normal or trace lengths, a share
  --system-prompt-share of requests with their adapter's shared system prompt as the chat system
  message), each request in its own greenlet, so arrivals never wait for answers (open loop);
- `--mode closed --concurrency C --distinct K`: C greenlets send back to back over the first K
  models (the saturation throughput of K distinct adapters in flight).

Each request fires locust request events named by the tier the replica reported
(`x-adapter-tier`: gpu | ram | disk | remote | base) with request types TTFT, TPOT (time per
output token after the first), ITL (each gap between tokens) and E2E, so locust's own stats and
CSVs split by tier. Requests sent during the first --warmup seconds are labelled `warmup` and
kept out of those stats. Every request is also one row of --requests-csv (flushed per row, so an
interrupted run keeps what it measured; `cached_tokens` is the replica's
usage.prompt_tokens_details.cached_tokens, the prompt tokens its prefix cache served), and each
replica's /metrics is saved when the measured window starts and after the last answer
(--metrics-dir), for hit rates, loads and evictions, with the machine's load average.
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import gevent
import gevent.pool
from locust import HttpUser, constant, events, task
from urllib3 import PoolManager

from loadtests.runner import TokenTimes
from loadtests.runner import scrape as _scrape
from loadtests.workload import (
    add_workload_arguments,
    generate,
    read_trace,
    spec_from_options,
    system_prompt,
    workload_options,
)

REQUEST_COLUMNS = [
    "phase", "sent_s", "model", "tier", "replica", "adapter_id", "status", "error", "ttft_s", "tpot_s",
    "itl_max_s", "e2e_s", "output_tokens", "prompt_tokens", "prompt_words", "max_tokens", "system_words",
    "cached_tokens",
]  # fmt: skip


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    g = parser.add_argument_group("lorafarm")
    g.add_argument("--api-key", default=os.environ.get("LORAFARM_API_KEY", ""), help="tenant API key")
    g.add_argument("--models-file", default="", help="models to request, one a line, most popular first")
    g.add_argument("--mode", choices=["open", "closed"], default="open")
    g.add_argument("--arrival-rate", type=float, default=1.0, help="open loop: requests per second (Poisson)")
    g.add_argument("--duration", type=float, default=30.0, help="measured seconds (after the warm-up)")
    g.add_argument("--warmup", type=float, default=10.0, help="seconds sent first and not measured")
    add_workload_arguments(g)
    g.add_argument("--concurrency", type=int, default=32, help="closed loop: requests in flight")
    g.add_argument("--distinct", type=int, default=1, help="closed loop: distinct models in flight")
    g.add_argument("--requests-csv", default="", help="write one row per request here")
    g.add_argument("--metrics-dir", default="", help="save replicas' /metrics here (start/end of the window)")
    g.add_argument("--replica-urls", default="", help="comma-separated replica URLs to scrape")
    g.add_argument("--request-timeout", type=float, default=120.0)


class FarmClient(HttpUser):
    """The dispatcher (see the module docstring): one instance drives the whole run. HttpUser
    (requests) rather than FastHttpUser: its chunked reads hand over each SSE event as it
    arrives, where geventhttpclient's read(n) waits for n bytes and would blur the token times."""

    fixed_count = 1
    wait_time = constant(0)
    pool_manager = PoolManager(maxsize=1024)  # open loop: up to one kept connection per request in flight

    def on_start(self) -> None:
        o = self.environment.parsed_options
        self.o = o
        self.models = [m.strip() for m in Path(o.models_file).read_text().splitlines() if m.strip()]
        if not self.models:
            raise RuntimeError(f"--models-file {o.models_file!r} lists no models")
        self.replicas = [u for u in o.replica_urls.split(",") if u]
        self.metrics_dir = Path(o.metrics_dir) if o.metrics_dir else None
        self.rows = None
        if o.requests_csv:
            Path(o.requests_csv).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(o.requests_csv, "w", newline="")
            self.rows = csv.DictWriter(self._file, REQUEST_COLUMNS)
            self.rows.writeheader()
            self._file.flush()
        self.t0 = time.perf_counter()

    # -- one request ------------------------------------------------------------------------
    def _fire(self, kind: str, tier: str, seconds: float, length: int = 0, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=tier, response_time=1000.0 * seconds, response_length=length,
            exception=exc, context={},
        )  # fmt: skip

    def chat(self, model: str, prompt: str, max_tokens: int, phase: str, system: str = "") -> None:
        messages = [{"role": "system", "content": system}] if system else []
        body = {
            "model": model,
            "messages": [*messages, {"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # vLLM's extension: outputs follow the length distribution
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Authorization": f"Bearer {self.o.api_key}", "Accept-Encoding": "identity"}
        sent = time.perf_counter()
        row = {"phase": phase, "sent_s": round(sent - self.t0, 4), "model": model, "tier": "", "replica": "",
               "adapter_id": "", "status": 0, "error": "", "output_tokens": 0, "prompt_tokens": "",
               "prompt_words": len(prompt.split()), "max_tokens": max_tokens,
               "system_words": len(system.split()), "cached_tokens": ""}  # fmt: skip
        usage_tokens = None
        times = TokenTimes()
        chunks = 0
        try:
            with self.client.post("/v1/chat/completions", json=body, headers=headers, stream=True,
                                  catch_response=True, name=f"chat ({phase})",
                                  timeout=(10.0, self.o.request_timeout)) as resp:  # fmt: skip
                row["status"] = resp.status_code
                hdr = resp.headers or {}
                row["tier"] = hdr.get("x-adapter-tier", "")
                row["replica"] = hdr.get("x-replica-id", "")
                row["adapter_id"] = hdr.get("x-adapter-id", "")
                if resp.status_code != 200:
                    row["error"] = f"http_{resp.status_code}"
                    resp.failure(row["error"])
                else:
                    resp.success()
                    for line in resp.iter_lines(chunk_size=None):
                        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            row["error"] = f"stream_{event['error'].get('code') or event['error'].get('type') or 'error'}"
                            continue
                        if event.get("usage"):
                            usage = event["usage"]
                            row["prompt_tokens"] = usage.get("prompt_tokens", "")
                            usage_tokens = usage.get("completion_tokens")
                            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                            row["cached_tokens"] = "" if cached is None else cached
                        if any(c.get("delta", {}).get("content") or c.get("finish_reason")
                               for c in event.get("choices", [])):  # fmt: skip
                            times.tick()  # a token event (TokenTimes)
                            chunks += 1
        except Exception as e:  # connection refused, reset, timeout: counted as errors by kind
            row["error"] = row["error"] or f"conn_{type(e).__name__}"
        end = time.perf_counter()
        if not row["error"] and times.first is None:
            row["error"] = "no_tokens"
        tier = row["tier"] or "none"
        if not row["error"]:
            row["output_tokens"] = tokens = usage_tokens if usage_tokens is not None else chunks
            row.update({k: v for k, v in times.fields(sent, end, tokens).items() if v != ""})
        if phase == "measure":
            if row["error"]:
                self._fire("E2E", tier, end - sent, exc=RuntimeError(row["error"]))
            else:
                self._fire("TTFT", tier, times.first - sent)
                self._fire("E2E", tier, end - sent, row["output_tokens"])
                if row.get("tpot_s") is not None:
                    self._fire("TPOT", tier, row["tpot_s"])
                    for g in times.gaps:
                        self._fire("ITL", tier, g)
        if self.rows is not None:
            self.rows.writerow(row)
            self._file.flush()

    # -- the run ----------------------------------------------------------------------------
    @task
    def drive(self) -> None:
        o = self.o
        if o.mode == "open":
            self._open_loop()
        else:
            self._closed_loop()
        if self.metrics_dir:
            _scrape(self.replicas, self.metrics_dir, "end")
        if self.rows is not None:
            self._file.close()
            self.rows = None
        # the dispatcher is the whole test, and every request it sent has finished: stop at once (with
        # --stop-timeout left as is, the runner would wait that long for this task's sleep below)
        self.environment.stop_timeout = 0
        gevent.spawn(self.environment.runner.quit)
        gevent.sleep(3600)  # never returns: quit() stops this greenlet

    def _start_window(self) -> None:
        if self.metrics_dir:
            _scrape(self.replicas, self.metrics_dir, "start")

    def _open_loop(self) -> None:
        o = self.o
        trace = read_trace(o.trace) if o.trace else None
        items = generate(self.models, spec_from_options(workload_options(o), o.arrival_rate, o.warmup + o.duration), trace)
        pool = gevent.pool.Pool()
        started = o.warmup <= 0
        if started:
            self._start_window()
        for item in items:
            delay = item.at - (time.perf_counter() - self.t0)
            if not started and item.at >= o.warmup:
                if delay > 0:  # start the window at its boundary, not at the next arrival
                    gevent.sleep(max(0.0, o.warmup - (time.perf_counter() - self.t0)))
                self._start_window()
                started = True
                delay = item.at - (time.perf_counter() - self.t0)
            if delay > 0:
                gevent.sleep(delay)
            phase = "measure" if item.at >= o.warmup else "warmup"
            pool.spawn(self.chat, item.model, item.prompt, item.max_tokens, phase, item.system)
        pool.join()

    def _closed_loop(self) -> None:
        o = self.o
        models = self.models[: max(1, o.distinct)]
        spec = spec_from_options(workload_options(o), 1.0, 2000.0)
        items = generate(self.models, spec)  # lengths only: arrival times unused
        systems = {m: system_prompt(m, spec) for m in models} if spec.system_prompt_share > 0 else {}
        end = o.warmup + o.duration
        counter = iter(range(10**9))

        def worker() -> None:
            while True:
                n = next(counter)
                t = time.perf_counter() - self.t0
                if t >= end:
                    return
                item = items[n % len(items)]
                model = models[n % len(models)]
                # the item decided whether a system prompt goes along; the text is the chosen model's own
                self.chat(model, item.prompt, item.max_tokens, "measure" if t >= o.warmup else "warmup",
                          systems[model] if item.system else "")  # fmt: skip

        gevent.spawn_later(o.warmup, self._start_window)
        workers = [gevent.spawn(worker) for _ in range(o.concurrency)]
        gevent.joinall(workers)
