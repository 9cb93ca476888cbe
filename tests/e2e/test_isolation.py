"""Canary isolation through the whole stack: every answer carries its own adapter's marker.

The seed's failure mode "wrong adapter applied" (a slot-index bug gives one customer another
customer's weights) shows up here as a foreign marker: that is the isolation criterion. Every answer
must also equal the adapter's answer alone, which is exactly its marker: each canary was verified
when it was trained (lorafarm.dev.adapters.check_prompts holds these prompts) to answer that in
PEFT itself with a logit margin, on any CPU. `make isolation` runs 10,000 requests.
"""

from __future__ import annotations

import asyncio
import os
import random

from openai import AsyncOpenAI

from lorafarm.dev.adapters import random_prompts

REQUESTS = int(os.environ.get("LORAFARM_ISOLATION_REQUESTS", "1000"))
CONCURRENCY = 32


def test_isolation_mixed_canaries_through_router(farm, tenant, adapter_markers):
    aliases = sorted(tenant["aliases"])
    assert len(aliases) >= 16
    rng = random.Random(7)
    prompts = random_prompts(seed=99, count=64)
    jobs = [(rng.choice(aliases), rng.choice(prompts), rng.random() < 0.5) for _ in range(REQUESTS)]

    async def run() -> list[tuple[str, str, str, str]]:
        client = AsyncOpenAI(base_url=farm["router_url"] + "/v1", api_key=tenant["api_key"], max_retries=0, timeout=120)
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(alias: str, prompt: str, stream: bool):
            async with sem:
                messages = [{"role": "user", "content": prompt}]
                if stream:
                    raw = await client.chat.completions.with_raw_response.create(
                        model=alias, messages=messages, max_tokens=16, temperature=0, stream=True
                    )
                    text = ""
                    async for chunk in raw.parse():
                        if chunk.choices:
                            text += chunk.choices[0].delta.content or ""
                else:
                    raw = await client.chat.completions.with_raw_response.create(
                        model=alias, messages=messages, max_tokens=16, temperature=0
                    )
                    text = raw.parse().choices[0].message.content
                return alias, raw.headers["x-adapter-id"], raw.headers["x-adapter-tier"], text

        try:
            return await asyncio.gather(*(one(*job) for job in jobs))
        finally:
            await client.close()

    results = asyncio.run(run())
    markers = set(adapter_markers.values())
    leaked = [
        (alias, aid, text)
        for alias, aid, _, text in results
        if aid != tenant["aliases"][alias] or any(m in text for m in markers - {adapter_markers[aid]})
    ]
    wrong = [(alias, aid, text) for alias, aid, _, text in results if text != adapter_markers[aid]]
    tiers = {}
    for _, _, tier, _ in results:
        tiers[tier] = tiers.get(tier, 0) + 1
    print(f"isolation: {len(results)} requests, {len(leaked)} foreign markers, {len(wrong)} changed, tiers {tiers}")
    assert len(results) == REQUESTS
    assert leaked == [], "answers served with another adapter's weights"
    assert wrong == [], "answers that differ from the adapter's answer alone"
    assert set(tiers) <= {"gpu", "ram", "disk", "remote"}
