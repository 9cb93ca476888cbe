"""The compose farm's smoke checks, run inside the farm's network by deploy/compose_smoke.sh
(`docker-compose run --rm tools python /deploy/compose_smoke.py STEP ...`).

The farm serves the real model (SmolLM2-135M-Instruct) and its four demo adapters, seeded by the
`seed` service as tenant `demo` (/farm/farm.json). Every request is greedy (temperature 0), and an
answer counts as right when it shows its adapter's behaviour (`lorafarm.demo_adapters`: the support
prefix "ACME SUPPORT:", French, a JSON object, a pirate's "Arr").

Steps (state between them in /data/smoke.json on the `smoke` volume; each prints one JSON line
starting with `RESULT ` that the shell script collects):
  wait                  registry, router (every replica healthy) and Prometheus answer
  seed                  the seed service's tenant and aliases (/farm/farm.json), until the router lists them
  demo                  the base and each demo alias answer their example prompt (the base: "Paris" for the
                        capital of France; each alias: its behaviour), and a few held-out prompts (reported)
  canary N              N chat completions (half streamed) over the demo aliases through the router with the
                        openai client; every answer must show its adapter's behaviour
  midstream             one long stream; prints `MIDSTREAM <replica id>` after 3 chunks (the shell
                        kills that replica's container then), then expects the router's error event
  failover RID          the router takes RID out; requests keep being served right by the other one
  rejoin RID            RID back in the router's health and serving (right answers) again
  prometheus            every target up, the shipped alert rules loaded, the C decode step's steps
                        (lorafarm_decode_steps_c) above 0 on both replicas
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from openai import OpenAI

ROUTER = os.environ.get("SMOKE_ROUTER_URL", "http://router:8000")
REGISTRY = os.environ.get("LORAFARM_REGISTRY_URL", "http://registry:8100")
PROMETHEUS = os.environ.get("SMOKE_PROMETHEUS_URL", "http://prometheus:9090")
STATE = Path("/data/smoke.json")
FARM = Path("/farm/farm.json")
RULES = Path("/deploy/monitoring/alerts.rules.yaml")
REPLICAS = 3  # what the router counts: replicas r0, r1 and the embedding worker e0
MAX_TOKENS = 64  # enough for a whole answer (a JSON one must close)
BASE_PROMPT, BASE_WANT = "What is the capital of France?", "Paris"
HELDOUT = 3  # held-out prompts per alias in the demo step (reported, not required)


def result(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def fail(msg: str, **kw) -> None:
    result(ok=False, error=msg, **kw)
    sys.exit(1)


def wait_for(pred, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - keep polling, report the last error
            last = e
        time.sleep(interval)
    fail(f"timed out after {timeout:.0f} s waiting for {what}" + (f" (last error: {last})" if last else ""))


def router_health() -> dict:
    return httpx.get(f"{ROUTER}/health", timeout=5).json()


def state() -> dict:
    return json.loads(STATE.read_text())


def client(timeout: float = 60.0) -> OpenAI:
    return OpenAI(base_url=f"{ROUTER}/v1", api_key=state()["api_key"], max_retries=0, timeout=timeout)


def shows(alias: str, answer: str) -> bool:
    """The answer shows the behaviour of the alias's demo adapter (demo/<name>:prod)."""
    from lorafarm.demo_adapters import DEMO_ADAPTERS

    name = alias.split("/", 1)[1].split(":", 1)[0]
    return next(a for a in DEMO_ADAPTERS if a.name == name).shows(answer)


def ask(c: OpenAI, model: str, prompt: str, stream: bool) -> tuple[str, str]:
    """(answer, replica id) of one greedy request."""
    msgs = [{"role": "user", "content": prompt}]
    if stream:
        with c.chat.completions.with_streaming_response.create(
                model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True) as raw:
            rid = raw.headers.get("x-replica-id", "?")
            text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
        return text, rid
    raw = c.chat.completions.with_raw_response.create(model=model, messages=msgs, max_tokens=MAX_TOKENS,
                                                      temperature=0)
    return raw.parse().choices[0].message.content or "", raw.headers.get("x-replica-id", "?")


def run_requests(n: int, concurrency: int = 4) -> dict:
    """n requests over every demo alias (its example prompt), half streamed; counts answers, answers
    that do not show their adapter's behaviour, errors, replicas."""
    st = state()
    aliases = sorted(st["aliases"])
    c = client()
    jobs = [(aliases[i % len(aliases)], i % 2 == 1) for i in range(n)]

    def one(job):
        alias, stream = job
        try:
            text, rid = ask(c, alias, st["aliases"][alias]["example_prompt"], stream)
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}
        return {"ok": shows(alias, text), "alias": alias, "text": text, "rid": rid}

    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, jobs))
    by_replica: dict[str, int] = {}
    for o in out:
        if "rid" in o:
            by_replica[o["rid"]] = by_replica.get(o["rid"], 0) + 1
    wrong = [o for o in out if "ok" in o and not o["ok"]]
    errors = [o["error"] for o in out if "error" in o]
    return {"requests": n, "answered": n - len(errors), "wrong": len(wrong), "errors": len(errors),
            "by_replica": by_replica, "wrong_examples": wrong[:3], "error_examples": errors[:3]}


# -- steps ---------------------------------------------------------------------------------------
def step_wait(timeout: float = 300.0) -> None:
    t0 = time.monotonic()
    wait_for(lambda: httpx.get(f"{REGISTRY}/health", timeout=5).status_code == 200, timeout, "the registry")
    wait_for(lambda: router_health().get("replicas_healthy") == REPLICAS, timeout, f"{REPLICAS} healthy replicas (r0, r1, e0)")
    wait_for(lambda: httpx.get(f"{PROMETHEUS}/-/ready", timeout=5).status_code == 200, timeout, "Prometheus")
    result(ok=True, step="wait", seconds=round(time.monotonic() - t0, 1), router=router_health())


def step_seed() -> None:
    t0 = time.monotonic()
    farm = wait_for(lambda: json.loads(FARM.read_text()) if FARM.exists() else None, 120,
                    "the seed service's /farm/farm.json")
    st = {"api_key": farm["api_key"], "base_model": farm["base_model"], "aliases": farm["aliases"]}
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(st))
    tmp.chmod(0o600)
    tmp.replace(STATE)

    def listed():
        r = httpx.get(f"{ROUTER}/v1/models", headers={"Authorization": f"Bearer {st['api_key']}"}, timeout=5)
        return r.status_code == 200 and set(st["aliases"]) <= {m["id"] for m in r.json()["data"]}

    wait_for(listed, 60, "the router to list the demo aliases")
    # one object key prefix in S3 (s3://lorafarm/adapters/<tenant>/<id>.lar, not adapters/adapters/...)
    uris = {a: v.get("weights_uri") for a, v in st["aliases"].items()}
    single = all(u and u.startswith("s3://lorafarm/adapters/") and "/adapters/adapters/" not in u for u in uris.values())
    result(ok=single, step="seed", tenant=farm["tenant_id"], weights_uris=uris, seconds=round(time.monotonic() - t0, 1))
    sys.exit(0 if single else 1)


def step_demo() -> None:
    from lorafarm.demo_adapters import heldout_prompts

    t0 = time.monotonic()
    st = state()
    c = client(timeout=180)
    base_answer, base_rid = ask(c, st["base_model"], BASE_PROMPT, stream=False)
    answers = {st["base_model"]: {"prompt": BASE_PROMPT, "answer": base_answer, "replica": base_rid,
                                  "ok": BASE_WANT in base_answer}}
    heldout: dict[str, list[dict]] = {}
    prompts = heldout_prompts()
    for alias, info in sorted(st["aliases"].items()):
        text, rid = ask(c, alias, info["example_prompt"], stream=False)
        answers[alias] = {"prompt": info["example_prompt"], "answer": text, "replica": rid, "ok": shows(alias, text)}
        heldout[alias] = []
        for q in [p for p in prompts if p != info["example_prompt"]][:HELDOUT]:
            a, _ = ask(c, alias, q, stream=False)
            heldout[alias].append({"prompt": q, "answer": a, "ok": shows(alias, a)})
    ok = all(a["ok"] for a in answers.values())
    result(ok=ok, step="demo", seconds=round(time.monotonic() - t0, 1), answers=answers,
           heldout_shown={a: f"{sum(r['ok'] for r in rows)}/{len(rows)}" for a, rows in heldout.items()},
           heldout=heldout)
    sys.exit(0 if ok else 1)


def step_canary(n: int) -> None:
    t0 = time.monotonic()
    r = run_requests(n)
    ok = r["wrong"] == 0 and r["errors"] == 0
    result(ok=ok, step="canary", seconds=round(time.monotonic() - t0, 1), **r)
    sys.exit(0 if ok else 1)


def step_midstream() -> None:
    st = state()
    alias = sorted(st["aliases"])[0]
    body = {"model": alias, "messages": [{"role": "user", "content": st["aliases"][alias]["example_prompt"]}],
            "max_tokens": 1800, "ignore_eos": True, "temperature": 0,
            "stream": True}
    chunks = 0
    t0 = time.monotonic()
    with httpx.stream("POST", f"{ROUTER}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {st['api_key']}"}) as resp:
        if resp.status_code != 200:
            fail(f"stream answered {resp.status_code}")
        rid = resp.headers["x-replica-id"]
        rest: list[str] = []
        announced = False
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if not announced:
                if data != "[DONE]" and json.loads(data).get("choices"):
                    chunks += 1
                if chunks == 3:
                    print(f"MIDSTREAM {rid}", flush=True)  # the shell kills this replica's container now
                    announced = True
                continue
            rest.append(data)
    content_after = sum(1 for d in rest if d != "[DONE]" and json.loads(d).get("choices"))
    errors = [json.loads(d)["error"] for d in rest if d != "[DONE]" and "error" in json.loads(d)]
    finished = [json.loads(d)["choices"][0].get("finish_reason") for d in rest
                if d != "[DONE]" and json.loads(d).get("choices") and json.loads(d)["choices"][0].get("finish_reason")]
    ok = bool(errors) and errors[0].get("type") == "server_error" and bool(rest) and rest[-1] == "[DONE]"
    result(ok=ok, step="midstream", replica=rid, chunks_before_kill=chunks, chunks_after_kill=content_after,
           error_event=errors[0] if errors else None, finish_reason=finished[0] if finished else None,
           ended_with_done=bool(rest) and rest[-1] == "[DONE]", seconds=round(time.monotonic() - t0, 1))
    sys.exit(0 if ok else 1)


def step_failover(rid: str, n: int = 12) -> None:
    t0 = time.monotonic()
    # requests right after the kill: the router fails over before the first byte
    first = run_requests(n)
    wait_for(lambda: router_health().get("replicas_healthy") == REPLICAS - 1, 30, f"{rid} out of the router's health")
    taken_out_s = round(time.monotonic() - t0, 1)
    after = run_requests(n)
    ok = (first["wrong"] == 0 and first["errors"] == 0 and after["wrong"] == 0
          and after["errors"] == 0 and rid not in after["by_replica"])
    result(ok=ok, step="failover", killed=rid, right_after_kill=first, out_of_routing_after_s=taken_out_s,
           after_out_of_routing=after)
    sys.exit(0 if ok else 1)


def step_rejoin(rid: str) -> None:
    t0 = time.monotonic()
    wait_for(lambda: router_health().get("replicas_healthy") == REPLICAS, 240, f"{rid} back in the router's health")
    healthy_s = round(time.monotonic() - t0, 1)
    served = {}
    total = {"requests": 0, "wrong": 0, "errors": 0}
    while time.monotonic() - t0 < 300:
        r = run_requests(8, concurrency=8)
        for k in total:
            total[k] += r[k]
        for k, v in r["by_replica"].items():
            served[k] = served.get(k, 0) + v
        if served.get(rid):
            break
    ok = bool(served.get(rid)) and total["wrong"] == 0 and total["errors"] == 0
    result(ok=ok, step="rejoin", replica=rid, healthy_after_s=healthy_s,
           serving_after_s=round(time.monotonic() - t0, 1), by_replica=served, **total)
    sys.exit(0 if ok else 1)


def step_prometheus() -> None:
    import yaml

    def targets():
        active = httpx.get(f"{PROMETHEUS}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        return active if active and all(t["health"] == "up" for t in active) else None

    active = wait_for(targets, 90, "every Prometheus target up", interval=2)
    want = {r.get("alert") or r.get("record") for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    groups = httpx.get(f"{PROMETHEUS}/api/v1/rules", timeout=5).json()["data"]["groups"]
    loaded = {r["name"] for g in groups for r in g["rules"]}
    unhealthy = [r["name"] for g in groups for r in g["rules"] if r.get("health") not in ("ok", "unknown")]

    def query(q: str) -> dict[str, float]:
        res = httpx.get(f"{PROMETHEUS}/api/v1/query", params={"query": q}, timeout=5).json()["data"]["result"]
        return {s["metric"].get("instance"): float(s["value"][1]) for s in res}

    paged = query("lorafarm_decode_attention_paged")
    # the C decode step ran on both replicas (scraped every 5 s: wait for the latest counts)
    steps_c = wait_for(lambda: (lambda v: v if len(v) == 2 and all(x > 0 for x in v.values()) else None)(
        query('lorafarm_decode_steps_c{job="replica"}')), 30, "lorafarm_decode_steps_c > 0 on both replicas", interval=2)
    alerts = [a["labels"]["alertname"] for a in
              httpx.get(f"{PROMETHEUS}/api/v1/alerts", timeout=5).json()["data"]["alerts"]]
    ok = want <= loaded and not unhealthy
    result(ok=ok, step="prometheus", targets={t["labels"]["instance"]: t["health"] for t in active},
           rules_in_file=len(want), rules_loaded=len(loaded), missing=sorted(want - loaded),
           unhealthy_rules=unhealthy, alerts_firing_or_pending=alerts, decode_steps_c=steps_c,
           decode_attention_paged=paged)
    sys.exit(0 if ok else 1)


def main(argv: list[str]) -> None:
    step, args = argv[0], argv[1:]
    if step == "wait":
        step_wait()
    elif step == "seed":
        step_seed()
    elif step == "demo":
        step_demo()
    elif step == "canary":
        step_canary(int(args[0]) if args else 16)
    elif step == "midstream":
        step_midstream()
    elif step == "failover":
        step_failover(args[0])
    elif step == "rejoin":
        step_rejoin(args[0])
    elif step == "prometheus":
        step_prometheus()
    else:
        fail(f"unknown step {step}")


if __name__ == "__main__":
    main(sys.argv[1:])
