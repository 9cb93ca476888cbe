"""The compose farm's seed step (service `seed`, once the registry answers): tenant `demo` and the
real model's demo adapters, uploaded through the registry as a training job uploads (signed archives
in S3) with aliases demo/<name>:prod, as `lorafarm up` seeds its farm.

The adapters come from the image (/opt/lorafarm/demo-adapters/demo.json, written at build by
`lorafarm.demo_adapters.write_demo_adapters`). Writes /farm/farm.json (volume `farm`, mode 0600: the
tenant's API key, the aliases, what each does and a prompt that shows it) and prints how to chat.
A second run reuses the tenant and its key (uploads of the same adapters change nothing).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from archives.basehash import read_trained_base
from lorafarm.registry_client import RegistryClient

REGISTRY = os.environ.get("LORAFARM_REGISTRY_URL", "http://registry:8100")
DEMOS = Path(os.environ.get("SEED_DEMO_ADAPTERS", "/opt/lorafarm/demo-adapters"))
FARM = Path(os.environ.get("SEED_FARM_JSON", "/farm/farm.json"))
BASE = "smollm2-135m-instruct"
TENANT = "demo"
ROUTER_ON_HOST = f"http://127.0.0.1:{os.environ.get('LORAFARM_ROUTER_PORT', '18000')}"


async def seed() -> dict:
    index = json.loads((DEMOS / "demo.json").read_text())
    before = json.loads(FARM.read_text()) if FARM.exists() else {}
    async with RegistryClient(REGISTRY) as reg:
        known = {t["tenant_id"] for t in await reg.list_tenants()}
        if TENANT in known and before.get("api_key"):
            api_key = before["api_key"]
        elif TENANT in known:
            api_key = (await reg.create_key(TENANT))["api_key"]
        else:
            api_key = (await reg.create_tenant(TENANT))["api_key"]
        aliases = {}
        for name, info in index.items():
            folder = DEMOS / info["path"]  # absolute where the folder is the one shipped in the package
            alias = f"{TENANT}/{name}:prod"
            adapter = await reg.upload_adapter(folder, TENANT, alias=alias, base_model=BASE,
                                               base_model_hash=read_trained_base(folder))
            aliases[alias] = {"adapter_id": adapter["adapter_id"], "weights_uri": adapter.get("weights_uri"),
                              "behaviour": info["behaviour"], "example_prompt": info["example_prompt"]}
            print(f"seed: {alias} -> {adapter['adapter_id']} ({info['behaviour']})", flush=True)
    return {"router_url": ROUTER_ON_HOST, "base_model": BASE, "tenant_id": TENANT, "api_key": api_key,
            "aliases": aliases}


def main() -> int:
    farm = asyncio.run(seed())
    tmp = FARM.with_suffix(".tmp")
    tmp.write_text(json.dumps(farm, indent=2) + "\n")
    tmp.chmod(0o600)
    tmp.replace(FARM)
    alias, info = next(iter(farm["aliases"].items()))
    body = json.dumps({"model": alias, "messages": [{"role": "user", "content": info["example_prompt"]}],
                       "temperature": 0, "max_tokens": 64})
    print(f"seed: tenant {TENANT}, API key {farm['api_key']} (also in /farm/farm.json, volume farm)\n"
          f"seed: try  curl -s {farm['router_url']}/v1/chat/completions -H 'Authorization: Bearer {farm['api_key']}' "
          f"-H 'Content-Type: application/json' -d '{body}'", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
