"""Nothing lost, no wrong answer: steady load of canary requests (streamed and not) while an alias
flips between two adapters, adapters are force-evicted and a replica is SIGKILLed and restarted.

Every request must end as a complete answer whose text is the marker of the adapter the router
says served it (x-adapter-id, checked at admission and logged per request by router and replica),
or as an explicit error (an HTTP error or an error event); never a hang, a silent drop or another
adapter's marker. Our counts must match the router's request counter.

CI runs 60 s with one replica restart; `make soak` runs LORAFARM_SOAK_S=600 with a restart about
every 90 s and writes the summary to $LORAFARM_SOAK_OUT (var/soak.json)."""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import random
import signal
import time
from pathlib import Path

import httpx
import openai
from openai import AsyncOpenAI

from tests.reliability.conftest import admin, reg_call, restart_replica, restored, wait_routed

SOAK_S = float(os.environ.get("LORAFARM_SOAK_S", "60"))
RESTART_EVERY_S = float(os.environ.get("LORAFARM_SOAK_RESTART_S", "90"))
CONCURRENCY = int(os.environ.get("LORAFARM_SOAK_CONCURRENCY", "6"))
FLIP = "demo/churn:prod"
MSG = [{"role": "user", "content": "soak"}]


def _router_counts(rfarm) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for line in httpx.get(rfarm["router_url"] + "/metrics", timeout=10).text.splitlines():
        if line.startswith("lorafarm_router_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            status = labels.split('status="', 1)[1].split('"', 1)[0]
            out[status] += float(value)
    return out


async def _one(c: AsyncOpenAI, model: str, stream: bool) -> tuple[str, str | None]:
    """-> (text, adapter id the router resolved); raises on any error."""
    if not stream:
        raw = await c.chat.completions.with_raw_response.create(model=model, messages=MSG, max_tokens=24,
                                                                temperature=0)
        r = raw.parse()
        assert r.choices[0].finish_reason in ("stop", "length")
        return r.choices[0].message.content, raw.headers.get("x-adapter-id")
    async with c.chat.completions.with_streaming_response.create(
        model=model, messages=MSG, max_tokens=24, temperature=0, stream=True
    ) as resp:
        parts, finish = [], None
        async for chunk in await resp.parse():
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        assert finish in ("stop", "length"), "stream ended without a finish reason"
        return "".join(parts), resp.headers.get("x-adapter-id")


def test_soak_with_churn(rfarm, rtenant, markers):
    aliases = dict(rtenant["aliases"])
    by_id = {aid: markers[a] for a, aid in aliases.items()}
    flip_targets = [aliases[a] for a in sorted(aliases)[:2]]
    reg_call(rfarm, lambda reg: reg.set_alias(FLIP, flip_targets[0]))
    models = sorted(aliases) + [FLIP, FLIP]
    before = _router_counts(rfarm)
    outcomes: collections.Counter = collections.Counter()
    wrong: list[tuple] = []
    lost: list[tuple] = []  # (seconds into the soak, model, cause): what a failure shows
    faults: collections.Counter = collections.Counter()
    fault_times: list[tuple] = []
    rng = random.Random(12)

    async def worker(k: int, stop: float) -> None:
        c = AsyncOpenAI(base_url=rfarm["router_url"] + "/v1", api_key=rtenant["api_key"], max_retries=0,
                        timeout=60.0)
        try:
            while time.monotonic() < stop:
                model = rng.choice(models)
                try:
                    text, served = await _one(c, model, stream=rng.random() < 0.5)
                except openai.APIStatusError as e:
                    outcomes[f"http_{e.status_code}_{(e.body or {}).get('code') if isinstance(e.body, dict) else ''}"] += 1
                    continue
                except openai.APITimeoutError:
                    outcomes["lost_timeout"] += 1
                    lost.append((round(time.monotonic() - started, 2), model, "timeout"))
                    continue
                except openai.APIConnectionError as e:
                    outcomes["lost_connection"] += 1
                    lost.append((round(time.monotonic() - started, 2), model, repr(e.__cause__)))
                    continue
                except openai.APIError as e:  # an error event in a stream: explicit
                    outcomes[f"stream_error_{getattr(e, 'code', None)}"] += 1
                    continue
                except AssertionError as e:
                    outcomes["incomplete"] += 1
                    wrong.append((model, "incomplete", str(e)))
                    continue
                expected_id = aliases.get(model)
                ok_id = served in flip_targets if model == FLIP else served == expected_id
                if ok_id and text == by_id.get(served):
                    outcomes["ok"] += 1
                else:
                    outcomes["wrong_marker"] += 1
                    wrong.append((model, served, text))
        finally:
            await c.close()

    async def churn(stop: float) -> None:
        i = 0
        next_restart = time.monotonic() + min(RESTART_EVERY_S, SOAK_S / 3)
        async with httpx.AsyncClient(timeout=30) as http:
            while time.monotonic() < stop:
                await asyncio.sleep(1.0)  # the churn's cadence over the soak (the subject), not a wait
                i += 1
                await asyncio.to_thread(reg_call, rfarm, lambda reg: reg.set_alias(FLIP, flip_targets[i % 2]))
                faults["alias_flips"] += 1
                if i % 4 == 0:  # a forced eviction of a random adapter on a random replica
                    r = rng.choice(rfarm["replicas"])
                    aid = rng.choice(sorted(by_id))
                    try:
                        resp = await http.post(
                            f"{r['url']}/internal/replicas/{r['replica_id']}/adapters/{aid}/unload", headers=admin(rfarm))
                        faults[f"evictions_{resp.status_code}"] += 1
                    except httpx.HTTPError:
                        faults["evictions_unreachable"] += 1
                if time.monotonic() >= next_restart and time.monotonic() < stop - 5:
                    victim = rng.randrange(len(rfarm["replicas"]))
                    os.kill(rfarm["_farm"].procs[f"replica-r{victim}"].pid, signal.SIGKILL)
                    faults["replica_sigkill"] += 1
                    fault_times.append((round(time.monotonic() - started, 2), f"sigkill r{victim}"))
                    await asyncio.to_thread(restart_replica, rfarm, victim)
                    faults["replica_restarted"] += 1
                    next_restart = time.monotonic() + RESTART_EVERY_S

    started = time.monotonic()
    gc_pauses: list[float] = []  # this process's own collections: a long one stalls its clients mid-request
    gc_began = [0.0]

    def gc_timer(phase: str, info: dict) -> None:
        if phase == "start":
            gc_began[0] = time.perf_counter()
        else:
            gc_pauses.append(time.perf_counter() - gc_began[0])

    async def main() -> None:
        stop = time.monotonic() + SOAK_S
        await asyncio.gather(churn(stop), *(worker(k, stop) for k in range(CONCURRENCY)))

    gc.callbacks.append(gc_timer)
    try:
        with restored(rfarm):  # a restart that failed half-way is finished here
            asyncio.run(main())
    finally:
        gc.callbacks.remove(gc_timer)
    elapsed = time.monotonic() - started
    wait_routed(rfarm, 30, what="farm healthy")
    after = _router_counts(rfarm)
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
    sent = sum(outcomes.values())
    summary = {"seconds": round(elapsed, 1), "concurrency": CONCURRENCY, "requests": sent,
               "outcomes": dict(outcomes), "faults": dict(faults), "router_counts": delta,
               "wrong": wrong[:10], "lost": lost[:10], "faults_at": fault_times,
               "gc_longest_pause_s": round(max(gc_pauses, default=0.0), 3)}
    print("soak:", json.dumps(summary))
    if os.environ.get("LORAFARM_SOAK_OUT"):
        Path(os.environ["LORAFARM_SOAK_OUT"]).parent.mkdir(parents=True, exist_ok=True)
        Path(os.environ["LORAFARM_SOAK_OUT"]).write_text(json.dumps(summary, indent=2) + "\n")
    assert outcomes["wrong_marker"] == 0 and not wrong, wrong[:5]
    assert not any(k.startswith("lost") for k in outcomes), (outcomes, lost[:10], fault_times)  # nothing hung or dropped
    assert faults["replica_restarted"] >= 1 and faults["alias_flips"] >= 5
    if faults["replica_sigkill"] == 1:  # one death is never poison, however many copies of a body it held
        assert not outcomes.get("http_400_poison_request"), outcomes
    # accepted = completed + ended with an explicit error, and the router counted the same
    assert sum(delta.values()) == sent, (delta, outcomes)
    assert delta.get("200", 0) == outcomes["ok"], (delta, outcomes)
    assert outcomes["ok"] > sent / 2
