"""A replica started with `--batch-invariant` (through the router, as a client sees it): every canary
request's answer and the logprob of every token are bitwise the same when it is sent alone and when
it runs concurrently with 23 others (other canaries and base-model requests)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from lorafarm.dev.adapters import random_prompts
from tests.e2e.conftest import running, seeded_farm

ADAPTERS = 8


def test_batch_invariant_replica_same_bits_alone_and_concurrent(tmp_path, dev_model):
    from tests.conftest import CANARY_DIR, make_canaries

    index = make_canaries(dev_model, ADAPTERS)
    farm = seeded_farm(tmp_path, dev_model, CANARY_DIR, replicas=1, adapters=ADAPTERS)
    farm.replica_args = ["--batch-invariant"]
    with running(farm) as info:
        tenant = info["tenants"][0]
        aliases = sorted(tenant["aliases"])
        prompts = random_prompts(seed=7, count=3)
        jobs = [(a, p) for a in aliases for p in prompts[:2]] + [("lorafarm-dev-tiny", p) for p in prompts] * 3
        client = httpx.Client(base_url=info["router_url"], headers={"authorization": f"Bearer {tenant['api_key']}"},
                              timeout=300)

        def ask(job):
            model, prompt = job
            r = client.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
                "temperature": 0, "logprobs": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]

        alone = [ask(j) for j in jobs]
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = list(pool.map(ask, jobs))
        diff = [(j, a, b) for j, a, b in zip(jobs, alone, together) if a != b]
        assert diff == [], diff[:3]
        for (model, _), (text, _) in zip(jobs, alone):
            if model in info["markers"]:
                assert text == info["markers"][model]
    assert len(index) == ADAPTERS
