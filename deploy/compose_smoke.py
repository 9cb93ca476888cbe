"""The compose farm's smoke checks, run inside the farm's network by deploy/compose_smoke.sh
(`docker-compose run --rm tools python /deploy/compose_smoke.py STEP ...`).

Steps (state between them in /data/smoke.json on the `smoke` volume; each prints one JSON line
starting with `RESULT ` that the shell script collects):
  wait                  registry, router (every replica healthy) and Prometheus answer
  seed                  tenant `smoke`, canaries from /models/canaries uploaded through the registry,
                        aliases smoke/<canary>:prod, until the router lists them
  canary N              N chat completions (half streamed) through the router with the openai
                        client; every answer must be exactly its adapter's marker
  midstream             one long stream; prints `MIDSTREAM <replica id>` after 3 chunks (the shell
                        kills that replica's container then), then expects the router's error event
  failover RID          the router takes RID out; requests keep being served right by the other one
  rejoin RID            RID back in the router's health and serving (correct markers) again
  prometheus            every target up, the shipped alert rules loaded, the paged-attention gauge
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
CANARIES = Path("/models/canaries")
RULES = Path("/deploy/monitoring/alerts.rules.yaml")
BASE = "lorafarm-dev-tiny"
TENANT = "smoke"
REPLICAS = 3  # what the router counts: replicas r0, r1 and the embedding worker e0
MSG = [{"role": "user", "content": "hello"}]


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


def ask(c: OpenAI, alias: str, stream: bool) -> tuple[str, str]:
    """(answer, replica id) of one greedy request."""
    if stream:
        with c.chat.completions.with_streaming_response.create(
                model=alias, messages=MSG, max_tokens=24, temperature=0, stream=True) as raw:
            rid = raw.headers.get("x-replica-id", "?")
            text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
        return text, rid
    raw = c.chat.completions.with_raw_response.create(model=alias, messages=MSG, max_tokens=24, temperature=0)
    return raw.parse().choices[0].message.content or "", raw.headers.get("x-replica-id", "?")


def run_requests(n: int, concurrency: int = 4) -> dict:
    """n requests over every alias, half streamed; counts answers, wrong markers, errors, replicas."""
    st = state()
    aliases = sorted(st["markers"])
    c = client()
    jobs = [(aliases[i % len(aliases)], i % 2 == 1) for i in range(n)]

    def one(job):
        alias, stream = job
        try:
            text, rid = ask(c, alias, stream)
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}
        return {"ok": text == st["markers"][alias], "text": text, "want": st["markers"][alias], "rid": rid}

    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, jobs))
    by_replica: dict[str, int] = {}
    for o in out:
        if "rid" in o:
            by_replica[o["rid"]] = by_replica.get(o["rid"], 0) + 1
    wrong = [o for o in out if "ok" in o and not o["ok"]]
    errors = [o["error"] for o in out if "error" in o]
    return {"requests": n, "answered": n - len(errors), "wrong_markers": len(wrong), "errors": len(errors),
            "by_replica": by_replica, "wrong_examples": wrong[:3], "error_examples": errors[:3]}


# -- steps ---------------------------------------------------------------------------------------
def step_wait(timeout: float = 300.0) -> None:
    t0 = time.monotonic()
    wait_for(lambda: httpx.get(f"{REGISTRY}/health", timeout=5).status_code == 200, timeout, "the registry")
    wait_for(lambda: router_health().get("replicas_healthy") == REPLICAS, timeout, f"{REPLICAS} healthy replicas (r0, r1, e0)")
    wait_for(lambda: httpx.get(f"{PROMETHEUS}/-/ready", timeout=5).status_code == 200, timeout, "Prometheus")
    result(ok=True, step="wait", seconds=round(time.monotonic() - t0, 1), router=router_health())


def step_seed() -> None:
    from archives.basehash import base_model_hash
    from lorafarm.registry_client import RegistryClient

    markers = json.loads((CANARIES / "markers.json").read_text())
    trained_on = base_model_hash(f"/models/{BASE}")

    async def seed() -> dict:
        async with RegistryClient(REGISTRY) as reg:
            known = {t["tenant_id"] for t in await reg.list_tenants()}
            if TENANT in known:
                api_key = (await reg.create_key(TENANT))["api_key"]
            else:
                api_key = (await reg.create_tenant(TENANT))["api_key"]
            out = {}
            for name, info in sorted(markers.items()):
                alias = f"{TENANT}/{name}:prod"
                adapter = await reg.upload_adapter(CANARIES / info["path"], TENANT, alias=alias, base_model=BASE,
                                                   base_model_hash=trained_on)
                out[alias] = {"adapter_id": adapter["adapter_id"], "marker": info["marker"]}
            return {"api_key": api_key, "adapters": out}

    t0 = time.monotonic()
    seeded = asyncio.run(seed())
    st = {"api_key": seeded["api_key"], "markers": {a: v["marker"] for a, v in seeded["adapters"].items()}}
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(st))
    tmp.chmod(0o600)
    tmp.replace(STATE)

    def listed():
        r = httpx.get(f"{ROUTER}/v1/models", headers={"Authorization": f"Bearer {st['api_key']}"}, timeout=5)
        return r.status_code == 200 and set(st["markers"]) <= {m["id"] for m in r.json()["data"]}

    wait_for(listed, 60, "the router to list the canary aliases")
    result(ok=True, step="seed", tenant=TENANT, adapters={a: v["adapter_id"] for a, v in seeded["adapters"].items()},
           seconds=round(time.monotonic() - t0, 1))


def step_canary(n: int) -> None:
    t0 = time.monotonic()
    r = run_requests(n)
    ok = r["wrong_markers"] == 0 and r["errors"] == 0
    result(ok=ok, step="canary", seconds=round(time.monotonic() - t0, 1), **r)
    sys.exit(0 if ok else 1)


def step_midstream() -> None:
    st = state()
    alias = sorted(st["markers"])[0]
    body = {"model": alias, "messages": MSG, "max_tokens": 1800, "ignore_eos": True, "temperature": 0,
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


def step_failover(rid: str, n: int = 24) -> None:
    t0 = time.monotonic()
    # requests right after the kill: the router fails over before the first byte
    first = run_requests(n)
    wait_for(lambda: router_health().get("replicas_healthy") == REPLICAS - 1, 30, f"{rid} out of the router's health")
    taken_out_s = round(time.monotonic() - t0, 1)
    after = run_requests(n)
    ok = (first["wrong_markers"] == 0 and first["errors"] == 0 and after["wrong_markers"] == 0
          and after["errors"] == 0 and rid not in after["by_replica"])
    result(ok=ok, step="failover", killed=rid, right_after_kill=first, out_of_routing_after_s=taken_out_s,
           after_out_of_routing=after)
    sys.exit(0 if ok else 1)


def step_rejoin(rid: str) -> None:
    t0 = time.monotonic()
    wait_for(lambda: router_health().get("replicas_healthy") == REPLICAS, 240, f"{rid} back in the router's health")
    healthy_s = round(time.monotonic() - t0, 1)
    served = {}
    total = {"requests": 0, "wrong_markers": 0, "errors": 0}
    while time.monotonic() - t0 < 300:
        r = run_requests(16, concurrency=8)
        for k in total:
            total[k] += r[k]
        for k, v in r["by_replica"].items():
            served[k] = served.get(k, 0) + v
        if served.get(rid):
            break
    ok = bool(served.get(rid)) and total["wrong_markers"] == 0 and total["errors"] == 0
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
    paged = httpx.get(f"{PROMETHEUS}/api/v1/query", params={"query": "lorafarm_decode_attention_paged"},
                      timeout=5).json()["data"]["result"]
    paged = {s["metric"].get("instance"): float(s["value"][1]) for s in paged}
    alerts = [a["labels"]["alertname"] for a in
              httpx.get(f"{PROMETHEUS}/api/v1/alerts", timeout=5).json()["data"]["alerts"]]
    ok = want <= loaded and not unhealthy
    result(ok=ok, step="prometheus", targets={t["labels"]["instance"]: t["health"] for t in active},
           rules_in_file=len(want), rules_loaded=len(loaded), missing=sorted(want - loaded),
           unhealthy_rules=unhealthy, alerts_firing_or_pending=alerts, decode_attention_paged=paged)
    sys.exit(0 if ok else 1)


def main(argv: list[str]) -> None:
    step, args = argv[0], argv[1:]
    if step == "wait":
        step_wait()
    elif step == "seed":
        step_seed()
    elif step == "canary":
        step_canary(int(args[0]) if args else 40)
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
