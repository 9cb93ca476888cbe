"""Deploy and rollback under load: an alias flipped mid-run.

Every response's marker must match the adapter id in its x-adapter-id header (the gateway resolved
one immutable id and the replica served exactly that one), and once the flip has been visible for
ROUTER_ALIAS_BOUND_S no request uses the old version.
"""

from __future__ import annotations

import asyncio
import time

import openai
from openai import AsyncOpenAI

from lorafarm.registry_client import RegistryClient
from tests.waiting import wait_until

ROUTER_ALIAS_BOUND_S = 3.0  # routing-table poll every 1 s, plus a request in flight


def test_alias_flip_and_rollback_under_load(farm, tenant, adapter_markers):
    alias = f"{tenant['tenant_id']}/flip:prod"
    aliases = tenant["aliases"]
    first = aliases[f"{tenant['tenant_id']}/c0000:prod"]
    second = aliases[f"{tenant['tenant_id']}/c0001:prod"]

    async def run():
        reg = RegistryClient(farm["registry_url"], farm["admin_token"])
        client = AsyncOpenAI(base_url=farm["router_url"] + "/v1", api_key=tenant["api_key"], max_retries=0, timeout=120)
        results: list[tuple[float, str, str]] = []
        try:
            await reg.set_alias(alias, first)

            async def routed() -> bool:  # the new alias answers before the load starts
                try:
                    await client.chat.completions.create(
                        model=alias, messages=[{"role": "user", "content": "routed?"}], max_tokens=1)
                except openai.NotFoundError:
                    return False
                return True

            await wait_until(routed, 60, interval=0.2, what=f"{alias} routed")
            stop = asyncio.Event()

            async def worker():
                while not stop.is_set():
                    raw = await client.chat.completions.with_raw_response.create(
                        model=alias, messages=[{"role": "user", "content": "deploy check"}], max_tokens=16, temperature=0
                    )
                    done = time.monotonic()
                    results.append((done, raw.headers["x-adapter-id"], raw.parse().choices[0].message.content))

            workers = [asyncio.create_task(worker()) for _ in range(8)]
            await asyncio.sleep(2.0)  # the subject: load on the first version for a while
            deploying_at = time.monotonic()  # a response done before this was routed before the deploy
            await reg.set_alias(alias, second)  # deploy
            flipped_at = time.monotonic()  # the router may apply it before this (it long-polls the table)
            await asyncio.sleep(2 * ROUTER_ALIAS_BOUND_S)  # the subject: load through the deploy and past
            rolling_at = time.monotonic()
            await reg.rollback_alias(alias)  # rollback
            rolled_at = time.monotonic()
            await asyncio.sleep(2 * ROUTER_ALIAS_BOUND_S)  # likewise through the rollback
            stop.set()
            await asyncio.gather(*workers)
            return results, (deploying_at, flipped_at, rolling_at, rolled_at)
        finally:
            await client.close()
            await reg.aclose()

    results, (deploying_at, flipped_at, rolling_at, rolled_at) = asyncio.run(run())
    assert len(results) > 20
    for _, aid, text in results:
        assert aid in (first, second)
        assert text == adapter_markers[aid]
    before = [aid for t, aid, _ in results if t < deploying_at]
    deployed = [aid for t, aid, _ in results if flipped_at + ROUTER_ALIAS_BOUND_S < t < rolling_at]
    rolled = [aid for t, aid, _ in results if t > rolled_at + ROUTER_ALIAS_BOUND_S]
    assert before and set(before) == {first}
    assert deployed and set(deployed) == {second}
    assert rolled and set(rolled) == {first}
