"""Platform day one on the real farm (registry, router, two replicas as processes), with a tenant of
its own so the shared farm's demo tenant is untouched:

- `model` in responses (and stream chunks) echoes the requested alias; `x-adapter-id` is the id;
- `/v1/models` lists each adapter once (the alias, or the id of a version no alias points to),
  `GET /v1/models/{id}` answers aliases and ids;
- a version no alias points to any more is unloaded from the replicas once it is idle;
- every metric the Grafana dashboard and the alert rules query exists on the farm's /metrics, and
  the per-tenant counters count this tenant's requests and tokens;
- replica logs: structured access lines for requests, none for the 1 s state polls.
"""

from __future__ import annotations

import json

import httpx
import openai

from tests.deploy.monitoring import exported_metrics, queried_metrics
from tests.waiting import wait_until

MSG = [{"role": "user", "content": "hello"}]


async def _setup(farm, canaries, name: str):
    from archives.basehash import base_model_hash
    from lorafarm.registry_client import RegistryClient

    trained_on = base_model_hash(farm["_farm"].model_dir)
    async with RegistryClient(farm["registry_url"], farm["admin_token"]) as reg:
        key = (await reg.create_tenant(name))["api_key"]
        v1 = await reg.upload_adapter(canaries / "c0020", name, alias=f"{name}/bot:prod", base_model_hash=trained_on)
        v2 = await reg.upload_adapter(canaries / "c0021", name, base_model_hash=trained_on)
    return key, v1["adapter_id"], v2["adapter_id"]


def _held(farm) -> dict[str, set[str]]:
    out = {}
    for r in farm["replicas"]:
        st = httpx.get(f"{r['url']}/internal/replicas/{r['replica_id']}/state",
                       headers={"Authorization": f"Bearer {farm['admin_token']}"}, timeout=10).json()
        out[r["replica_id"]] = set(st["gpu_adapters"]) | set(st["ram_adapters"])
    return out


async def test_echo_catalog_retire_metrics_logs(farm, canaries):
    tenant = "platform"
    alias = f"{tenant}/bot:prod"
    key, v1, v2 = await _setup(farm, canaries, tenant)
    client = openai.AsyncOpenAI(base_url=farm["router_url"] + "/v1", api_key=key, max_retries=0, timeout=60)
    http = httpx.Client(base_url=farm["router_url"], headers={"Authorization": f"Bearer {key}"}, timeout=30)
    try:
        # A new alias is routable once the router's table has it (read-your-writes may make this immediate).
        async def ask(model, **kw):
            async def answered():
                try:
                    return await client.chat.completions.with_raw_response.create(
                        model=model, messages=MSG, max_tokens=4, temperature=0, **kw)
                except openai.NotFoundError:
                    return None

            return await wait_until(answered, 60, interval=0.5, what=f"{model} routable")

        raw = await ask(alias)
        assert raw.headers["x-adapter-id"] == v1 and raw.parse().model == alias
        stream = await client.chat.completions.create(model=alias, messages=MSG, max_tokens=4, stream=True)
        models = {c.model async for c in stream}
        assert models == {alias}
        assert (await ask(v2)).parse().model == v2  # by id: the id is the requested name

        listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert {alias, v2} <= set(listed) and v1 not in listed  # v1 once, as the alias
        assert listed[alias]["root"] == v1 and listed[v2]["parent"] == "lorafarm-dev-tiny"
        assert http.get(f"/v1/models/{alias}").json()["root"] == v1
        assert http.get(f"/v1/models/{v1}").json()["id"] == v1
        assert http.get(f"/v1/models/{v2}").json()["id"] == v2
        assert http.get("/v1/models/demo/c0000:prod").status_code == 404  # the demo tenant's alias

        # v1 is held by the replica that served it; deploy v2: v1 leaves every replica.
        assert any(v1 in held for held in _held(farm).values())
        from lorafarm.registry_client import RegistryClient

        async with RegistryClient(farm["registry_url"], farm["admin_token"]) as reg:
            await reg.set_alias(alias, v2)
        await wait_until(lambda: not any(v1 in held for held in _held(farm).values()), 60, interval=0.5,
                         what=f"{v1} unloaded")
        await wait_until(lambda: http.get(f"/v1/models/{alias}").json()["root"] == v2, 60, interval=0.5,
                         what="router sees the deploy")
        raw = await ask(alias)
        assert raw.headers["x-adapter-id"] == v2 and raw.parse().model == alias

        # Every metric the dashboard and the alert rules query is exported by the farm.
        exported = exported_metrics(httpx.get(farm["router_url"] + "/metrics").text)
        for r in farm["replicas"]:
            exported |= exported_metrics(httpx.get(r["url"] + "/metrics").text)
        # the canary probe's series come from its own process (`lorafarm probe run`), not the farm's
        from lorafarm.probe import ProbeMetrics

        exported |= exported_metrics(ProbeMetrics().exposition())
        missing = queried_metrics() - exported
        assert not missing, sorted(missing)
        text = httpx.get(farm["router_url"] + "/metrics").text
        counts = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                  if line.startswith("lorafarm_router_tenant_") and f'tenant="{tenant}"' in line}
        assert counts[f'lorafarm_router_tenant_requests_total{{status_class="2xx",tenant="{tenant}"}}'] >= 4
        assert counts[f'lorafarm_router_tenant_tokens_total{{kind="completion",tenant="{tenant}"}}'] >= 4
        assert counts[f'lorafarm_router_tenant_tokens_total{{kind="prompt",tenant="{tenant}"}}'] > 0
    finally:
        http.close()
        await client.close()

    # Replica logs: JSON access lines for the requests; the state polls (2/s) stay at debug level.
    logs = "".join(p.read_text(errors="replace") for p in farm["_farm"].logs_dir.glob("replica-*.log"))
    access = [json.loads(line[line.index("{", line.index("lorafarm.access")):]) for line in logs.splitlines()
              if "lorafarm.access" in line]
    assert any(a["path"] == "/v1/chat/completions" and a["status"] == 200 and a.get("adapter_id") == v2
               for a in access)
    assert not [a for a in access if a["path"].endswith("/state")]
    assert "HTTP Request:" not in logs and '"GET /internal/replicas' not in logs
