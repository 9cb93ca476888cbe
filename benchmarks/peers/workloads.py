"""The workloads and how one is timed against one server.

Every request is a streamed chat completion through the official `openai` AsyncOpenAI client:
max_tokens 64, temperature 0 (greedy), usage in the final chunk. TTFT = time to the first chunk
carrying a token (non-empty delta content); tokens = usage.completion_tokens; a batch's tokens/s =
its completion tokens / its wall time (first request sent to last stream closed).

W6 draws each request's adapter from a set of its own (adapters.zipf_dirs, 1,000 by default) by a
Zipf law: the adapter of popularity rank k with probability proportional to 1 / k**1.1, rank 1 the
set's first adapter. The sequence is seeded by the round, so every server meets the same one.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, replace

MAX_TOKENS = 64
ZIPF_EXPONENT = 1.1


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    adapters: bool  # each request on its own adapter (round robin over the adapters) or the base
    concurrency: int
    requests: int
    zipf_pool: int = 0  # > 0: adapters drawn by zipf_sequence from a set of this many (W6); 0: the main set

    def scaled(self, requests: int | None) -> "Workload":
        """The same workload with `requests` requests (concurrency capped to it): quick runs, smoke tests."""
        if not requests:
            return self
        return replace(self, concurrency=min(self.concurrency, requests), requests=requests)

    def pooled(self, adapters: int) -> "Workload":
        """A Zipf workload over `adapters` adapters (its title says how many)."""
        return replace(self, zipf_pool=adapters,
                       title=f"Zipf {ZIPF_EXPONENT} over {adapters:,} adapters, {self.concurrency} concurrent")


WORKLOADS = {w.name: w for w in [
    Workload("W1", "base, 32 concurrent", False, 32, 32),
    Workload("W2", "32 distinct adapters, 32 concurrent", True, 32, 32),
    Workload("W4", "single stream, distinct adapters", True, 1, 4),
    Workload("W5", "32 distinct adapters, 8 concurrent", True, 8, 32),
    Workload("W6", "Zipf 1.1 over 1,000 adapters, 8 concurrent", True, 8, 64, zipf_pool=1000),
]}


def zipf_sequence(names: list[str], count: int, seed: int, exponent: float = ZIPF_EXPONENT) -> list[str]:
    """`count` adapters drawn from `names` (popularity rank k = names[k - 1]) with probability
    proportional to 1 / k**exponent; the same seed gives the same sequence."""
    weights = [k ** -exponent for k in range(1, len(names) + 1)]
    return random.Random(seed).choices(names, weights=weights, k=count)


@dataclass
class Result:
    index: int
    adapter: str | None
    ok: bool
    error: str | None
    ttft_s: float | None
    total_s: float
    completion_tokens: int | None
    prompt_tokens: int | None
    text: str


async def one(client, model: str, extra_body: dict, prompt: str, index: int, adapter: str | None,
              max_tokens: int = MAX_TOKENS) -> Result:
    t0 = time.perf_counter()
    ttft, usage, parts, err = None, None, [], None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra_body or None)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
    except Exception as e:  # noqa: BLE001 - recorded per request, the batch goes on
        err = f"{type(e).__name__}: {e}"[:300]
    if err is None and usage is None:
        err = "no usage chunk"
    return Result(index, adapter, err is None, err, ttft, time.perf_counter() - t0,
                  usage.completion_tokens if usage else None, usage.prompt_tokens if usage else None, "".join(parts))


async def run_batch(server, workload: Workload, prompts: list[str], adapters: list[str],
                    max_tokens: int = MAX_TOKENS, timeout: float = 1800.0) -> tuple[float, list[Result]]:
    """All of a workload's requests against one server at its concurrency: (wall seconds, results).
    Request i goes to adapters[i % len(adapters)]: round robin over a set, or a drawn sequence (W6)."""
    import httpx
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    # a fresh connection per request (no keep-alive): llama-server closes idle keep-alive connections and a
    # reused one failed at once (APIConnectionError in 5 ms, 3 of 32 W5 requests); the same for every server
    http = DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
    client = AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=timeout,
                         http_client=http)
    sem = asyncio.Semaphore(workload.concurrency)

    async def bounded(i: int) -> Result:
        adapter = adapters[i % len(adapters)] if workload.adapters else None
        model, extra = server.request(adapter)
        async with sem:
            return await one(client, model, extra, prompts[i % len(prompts)], i, adapter, max_tokens)

    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(bounded(i) for i in range(workload.requests)))
    finally:
        await client.close()
    return time.perf_counter() - t0, list(results)
