"""`make loadtest-real`: the seed's load test on the real model, ours beside vLLM CPU on its long-tail path.

    python -m loadtests.real run --model var/peers/smollm2-135m-instruct [--adapters 5000] [--systems ours,vllm]
                                 [--rates 0.5,1,2,3,4,6] [--warmup 20] [--window 60] [--out var/loadtest-real]
    python -m loadtests.real report --from var/loadtest-real --to docs      # docs/loadtests.md's section + PNGs

The fleet (`prepare_adapters`): N synthetic PEFT adapters (loadtests.synth, seeded) on q_proj and v_proj
(PEFT's default targets for Llama), ranks 8/16/32 in the shares 60/30/10 (RANK_CYCLE), stored float16,
written once under <out>/adapters/<name>; a few canaries among them at fixed popularity ranks (CANARY_RANKS):
synthetic adapters strong enough to change the base's answers, each with a prompt on which PEFT itself
answers a known text (its marker) by a safe logit margin, an answer neither the base nor another canary
gives (`make_canaries`; the dev canaries are trained for the dev model only, minutes each here). The one folder
is what both systems serve: ours uploads every adapter through its registry at start (each an alias),
vLLM resolves `<folder>/<model name>` on first use.

The traffic (`workload`): open-loop Poisson arrivals; a share BASE_SHARE of requests on the base model,
the rest Zipf(1.1) over the adapters in popularity order; prompt and output lengths log-normal (CHAT:
short chat turns, stated in the report), a share of requests carrying their adapter's shared system
prompt; outputs forced to their drawn length (`ignore_eos`) so both systems decode the same tokens. A
request that draws a canary asks it its prompt (greedy, no system prompt, CANARY_MAX_TOKENS tokens) and
must answer exactly its marker. Every request is a streamed chat completion through the official `openai` client
(AsyncOpenAI, one connection per request). Step k of the sweep draws its sequence with seed + k: ours
and vLLM meet the same arrivals at each rate.

The sweep (`sweep`): both servers started once (2 threads each), the one not measured paused (SIGSTOP,
as bench-peers does); rate by rate, the two alternate in ABBA order, each step a warm-up then a
measured window, then at most `drain` seconds for the window's requests to finish (those still open
are errors of kind `unfinished`). A system leaves the sweep after --stop-after (2) consecutive steps that
miss the SLO (p95 TTFT >= 1 s, or any error or wrong marker). Per step: requests, sent vs achieved rate, TTFT
p50/p95/p99 overall and per tier (ours: the replica's `x-adapter-tier` header: gpu = a device slot,
ram, disk, remote = the registry's store, base; vLLM names no tier: `first use` = the first request
naming that adapter since the server started, i.e. resolved from the folder and loaded, `repeat`
otherwise), TPOT p50/p95, errors by kind, ours' replica /metrics over the window (device hit rate,
loads and evictions per minute), the machine's CPU busy share and load average, and the measured
server's own CPU seconds per second. Goodput = the highest rate whose step met the SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import platform
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.runner import TokenTimes, append_csv, cache_rates, cpu_use, scrape, summarize
from loadtests.workload import WorkItem, WorkloadSpec, generate
from lorafarm.errors import CliError

RANK_CYCLE = (8, 8, 8, 8, 8, 8, 16, 16, 16, 32)  # 60% rank 8, 30% rank 16, 10% rank 32
TARGET_MODULES = ("q_proj", "v_proj")  # PEFT's default target modules for Llama models
ADAPTER_DTYPE = "float16"
CANARY_RANKS = (3, 40, 400)  # popularity ranks (0-based) of the canaries among the adapters
CANARY_MAX_TOKENS = 8  # a canary's answer: its first tokens (greedy) on its prompt
CANARY_B_STD = 0.12  # B of a canary: enough to change the base's answers, not so much they turn to noise
CANARY_MARGIN = 0.1  # logits each answer token leads the runner-up by (PEFT, float32): 100x their noise
CANARY_INDEX = 90000  # the canaries' synth seeds: (seed, CANARY_INDEX + i), apart from the fleet's
CANARY_CANDIDATES = 24  # prompts tried per canary
BASE_SHARE = 0.1  # requests on the base model
SLO_TTFT_MS = 1000.0
# short chat turns (log-normal, in words / tokens): a stated distribution, not a replayed trace
CHAT = dict(zipf_s=1.1, prompt_words_median=40, prompt_words_sigma=0.8, prompt_words_cap=400,
            max_tokens_median=32, max_tokens_sigma=0.6, max_tokens_cap=128, system_prompt_share=0.5,
            system_prompt_words_median=80, system_prompt_words_sigma=0.5, system_prompt_words_cap=300)  # fmt: skip
ROW_COLUMNS = ["system", "rate", "phase", "index", "sent_s", "model", "canary", "tier", "use", "error", "ttft_s",
               "tpot_s", "e2e_s", "itl_max_s", "output_tokens", "prompt_tokens", "cached_tokens", "max_tokens",
               "system_words", "marker_ok", "answer"]  # fmt: skip


# -- the fleet --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    folder: Path  # <folder>/<name>/ is a PEFT adapter
    names: list[str]  # popularity order (rank 1 first)
    markers: dict[str, str]  # canary name -> marker (its known answer)
    bytes: int
    prompts: dict[str, str] = field(default_factory=dict)  # canary name -> the prompt it answers its marker to

    @property
    def folders(self) -> list[Path]:
        return [self.folder / n for n in self.names]


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def prepare_adapters(model: Path, out: Path, count: int, canaries: int, seed: int = 0,
                     progress: bool = True) -> Fleet:
    """The fleet under out/adapters (written once; a rerun only checks it): count - canaries synthetic
    adapters and `canaries` canaries (`make_canaries`), the canaries at CANARY_RANKS of the popularity order."""
    from tqdm import tqdm

    from archives.basehash import read_base_config
    from loadtests.synth import SynthSpec, write_synth_adapter

    folder = out / "adapters"
    folder.mkdir(parents=True, exist_ok=True)
    served = str(model.resolve())  # vLLM's resolver wants the served model's name in the adapter's config
    config = read_base_config(model)
    n_synth = count - canaries
    names = [f"synth-{i:05d}" for i in range(n_synth)]
    total = 0
    for i in tqdm(range(n_synth), desc="synthetic adapters", unit="adapter", disable=not progress, mininterval=2):
        target = folder / names[i]
        if not (target / "adapter_model.safetensors").exists():
            tmp = folder / f".{names[i]}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            spec = SynthSpec(i, RANK_CYCLE[i % len(RANK_CYCLE)], TARGET_MODULES, seed)
            write_synth_adapter(config, spec, tmp, served, dtype=ADAPTER_DTYPE)
            os.replace(tmp, target)
        total += _folder_bytes(target)
    markers = make_canaries(model, folder, canaries, seed, progress) if canaries else {}
    for i, name in enumerate(sorted(markers)):
        total += _folder_bytes(folder / name)
        names.insert(min(CANARY_RANKS[i % len(CANARY_RANKS)] + i // len(CANARY_RANKS), len(names)), name)
    return Fleet(folder, names, {n: m["marker"] for n, m in markers.items()}, total,
                 {n: m["prompt"] for n, m in markers.items()})


def make_canaries(model: Path, folder: Path, count: int, seed: int = 0, progress: bool = True) -> dict[str, dict]:
    """`count` canaries in `folder`: synthetic adapters with a strong B (CANARY_B_STD, float32), each
    with a known answer. For each, PEFT itself (float32, greedy, the tokenizer's chat template) answers
    candidate prompts; the canary keeps the first prompt on which every generated token leads the
    runner-up by CANARY_MARGIN logits, no special token is generated, and the answer differs from the
    base's and from every other canary's on that prompt: a request served with the wrong weights (or
    none) answers something else. -> {name: {"marker", "prompt", "margin", "rank"}} (cached in
    folder/canaries.json for the same count and seed)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from archives.basehash import read_base_config
    from loadtests.synth import SynthSpec, write_synth_adapter
    from lorafarm.dev.adapters import ALL_MODULES, random_prompts

    index_file = folder / "canaries.json"
    key = {"count": count, "seed": seed, "b_std": CANARY_B_STD, "tokens": CANARY_MAX_TOKENS, "margin": CANARY_MARGIN}
    if index_file.exists():
        got = json.loads(index_file.read_text())
        if got.get("key") == key and all((folder / n / "adapter_config.json").exists() for n in got["canaries"]):
            return got["canaries"]
    served = str(model.resolve())
    config = read_base_config(model)
    names = [f"canary-{i:02d}" for i in range(count)]
    for i, name in enumerate(names):
        shutil.rmtree(folder / name, ignore_errors=True)
        spec = SynthSpec(CANARY_INDEX + i, RANK_CYCLE[(3 * i) % len(RANK_CYCLE)] * 2, tuple(ALL_MODULES), seed)
        write_synth_adapter(config, spec, folder / name, served, dtype="float32", b_std=CANARY_B_STD)
    torch.set_num_threads(1)  # on a busy box two spinning OpenMP threads are slower than one (dev canaries)
    tok = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    special = set(tok.all_special_ids)
    prompts = random_prompts(seed=seed + CANARY_INDEX, count=CANARY_CANDIDATES)

    def greedy(m, prompt: str) -> tuple[list[int], float]:
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)  # fmt: skip
        ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        out, margin = [], math.inf
        with torch.no_grad():
            step = m(input_ids=torch.tensor([ids]), use_cache=True)
            for _ in range(CANARY_MAX_TOKENS):
                top = torch.topk(step.logits[0, -1], 2)
                margin = min(margin, float(top.values[0] - top.values[1]))
                nxt = int(top.indices[0])
                out.append(nxt)
                if nxt == tok.eos_token_id or len(out) == CANARY_MAX_TOKENS:
                    break
                step = m(input_ids=torch.tensor([[nxt]]), past_key_values=step.past_key_values, use_cache=True)
        return out, margin

    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(base, str(folder / names[0]), adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(str(folder / name), adapter_name=name)
    peft_model.eval()
    answers: dict[tuple[str, str], tuple[list[int], float]] = {}

    def answer(who: str, prompt: str) -> tuple[list[int], float]:
        if (who, prompt) not in answers:
            if who == "base":
                with peft_model.disable_adapter():
                    answers[who, prompt] = greedy(peft_model, prompt)
            else:
                peft_model.set_adapter(who)
                answers[who, prompt] = greedy(peft_model, prompt)
        return answers[who, prompt]

    out: dict[str, dict] = {}
    for name in tqdm(names, desc="canaries (PEFT reference answers)", unit="canary", disable=not progress):
        for prompt in prompts:
            ids, margin = answer(name, prompt)
            text = tok.decode([i for i in ids if i != tok.eos_token_id], skip_special_tokens=True).strip()
            if margin < CANARY_MARGIN or not text or any(i in special and i != tok.eos_token_id for i in ids):
                continue
            others = [w for w in ["base", *names] if w != name]
            if any(tok.decode(answer(w, prompt)[0], skip_special_tokens=True).strip() == text for w in others):
                continue
            rank = json.loads((folder / name / "adapter_config.json").read_text())["r"]
            out[name] = {"marker": text, "prompt": prompt, "margin": round(margin, 3), "rank": rank}
            break
        else:
            raise CliError(f"canary {name}: no candidate prompt of {len(prompts)} gave an answer with a margin of "
                           f"{CANARY_MARGIN} logits that no other adapter gives; raise CANARY_CANDIDATES")
    index_file.write_text(json.dumps({"key": key, "canaries": out}, indent=1) + "\n")
    return out


# -- the traffic ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    at: float
    adapter: str | None  # None: the base model
    prompt: str
    max_tokens: int
    system: str
    marker: str = ""  # a canary's expected answer

    @property
    def canary(self) -> bool:
        return bool(self.marker)


def workload(fleet: Fleet, rate: float, duration: float, seed: int, base_share: float = BASE_SHARE,
             chat: dict | None = None) -> list[Request]:
    """The seeded arrival sequence of one step (the same for every system): generate()'s Poisson
    arrivals, Zipf adapters and log-normal lengths over the fleet, then a share `base_share` moved to
    the base model (its own random stream) and canary draws turned into marker checks."""
    spec = WorkloadSpec(rate=rate, duration=duration, seed=seed, **(chat or CHAT))
    items: list[WorkItem] = generate(fleet.names, spec)
    base_rng = random.Random(f"lorafarm-real-base:{seed}")
    out = []
    for item in items:
        if base_rng.random() < base_share:
            out.append(Request(item.at, None, item.prompt, item.max_tokens, item.system))
        elif item.model in fleet.markers:
            out.append(Request(item.at, item.model, fleet.prompts[item.model], CANARY_MAX_TOKENS, "",
                               fleet.markers[item.model]))  # fmt: skip
        else:
            out.append(Request(item.at, item.model, item.prompt, item.max_tokens, item.system))
    return out


# -- one step against one server ----------------------------------------------------------------


def _error_kind(e: BaseException) -> str:
    import openai

    if isinstance(e, openai.APIStatusError):
        return f"http_{e.status_code}"
    if isinstance(e, openai.APITimeoutError):
        return "timeout"
    if isinstance(e, openai.APIConnectionError):
        return "connection"
    if isinstance(e, openai.APIError):
        return "stream_error"
    return type(e).__name__


async def _one(client, server, req: Request, row: dict, t0: float) -> None:
    model, extra = server.request(req.adapter)
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}]
    sent = time.perf_counter()
    row["sent_s"] = round(sent - t0, 4)
    times = TokenTimes()
    parts: list[str] = []
    usage = None
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=req.max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={**extra, "ignore_eos": not req.canary})
        if row["system"] == "ours":
            row["tier"] = raw.headers.get("x-adapter-tier", "") or ("base" if req.adapter is None else "")
        async for chunk in raw.parse():
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                times.tick()  # a token event (TokenTimes)
                parts.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                usage = chunk.usage
    except asyncio.CancelledError:
        row["error"] = "unfinished"
        raise
    except Exception as e:  # noqa: BLE001 - recorded per request by kind, the step goes on
        row["error"] = _error_kind(e)
    end = time.perf_counter()
    if not row["error"] and times.first is None:
        row["error"] = "no_tokens"
    if row["error"]:
        return
    tokens = usage.completion_tokens if usage else len(parts)
    row.update(times.fields(sent, end, tokens), output_tokens=tokens, prompt_tokens=usage.prompt_tokens if usage else "")
    cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None) if usage else None
    row["cached_tokens"] = "" if cached is None else cached
    if req.canary:
        row["marker_ok"] = int("".join(parts).strip() == req.marker)
        if not row["marker_ok"]:
            row["answer"] = "".join(parts)[:200]


async def drive(server, requests: list[Request], *, system: str, rate: float, warmup: float, window: float,
                drain: float, seen: set[str], metrics_dir: Path, replica_urls: list[str],
                progress: bool = True, timeout: float = 300.0) -> list[dict]:
    """Send `requests` at their times (open loop) and return one row per request; the replicas'
    /metrics and the machine's CPU are saved when the measured window opens and when it is over."""
    import httpx
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient
    from tqdm import tqdm

    http = DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
    client = AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=timeout,
                         http_client=http)
    rows: list[dict] = []
    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()
    started = False
    bar = tqdm(total=len(requests), desc=f"{system} {rate:g} req/s", unit="req", disable=not progress, leave=True)
    try:
        for i, req in enumerate(requests):
            if not started and req.at >= warmup:
                await asyncio.sleep(max(0.0, t0 + warmup - time.perf_counter()))
                await asyncio.to_thread(scrape, replica_urls, metrics_dir, "start")
                started = True
            await asyncio.sleep(max(0.0, t0 + req.at - time.perf_counter()))
            use = "base" if req.adapter is None else ("repeat" if req.adapter in seen else "first use")
            if req.adapter is not None:
                seen.add(req.adapter)
            row = {c: "" for c in ROW_COLUMNS} | {
                "system": system, "rate": rate, "phase": "measure" if req.at >= warmup else "warmup", "index": i,
                "model": req.adapter or "base", "canary": int(req.canary), "use": use,
                "tier": use if system != "ours" else "", "max_tokens": req.max_tokens,
                "system_words": len(req.system.split())}  # fmt: skip
            rows.append(row)
            task = asyncio.create_task(_one(client, server, req, row, t0))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        if not started:
            await asyncio.sleep(max(0.0, t0 + warmup - time.perf_counter()))
            await asyncio.to_thread(scrape, replica_urls, metrics_dir, "start")
        deadline = t0 + warmup + window + drain
        pending = [t for t in tasks if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=max(0.1, deadline - time.perf_counter()))
            for t in still:
                t.cancel()
            if still:
                await asyncio.wait(still, timeout=10)
        await asyncio.to_thread(scrape, replica_urls, metrics_dir, "end")
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
        await client.close()
    return rows


def _tree_cpu_s(server) -> float:
    import psutil

    total = 0.0
    for p in server._tree():
        try:
            c = p.cpu_times()
            total += c.user + c.system
        except psutil.NoSuchProcess:
            pass
    return total


def step_figures(rows: list[dict], *, system: str, rate: float, window: float, metrics_dir: Path,
                 server_cpu: float, wall: float) -> list[dict]:
    """One row per group (all, then each tier) of a step's measured requests, with the step's
    machine, cache and canary figures on the `all` row."""
    groups = summarize(rows, window)
    measured = [r for r in rows if r["phase"] == "measure"]
    canaries = [r for r in measured if r["canary"] == 1 and not r["error"]]
    extra = {**cache_rates(metrics_dir), **cpu_use(metrics_dir), **replica_profile(metrics_dir),
             "sent_rate": len(measured) / window,
             "achieved_rate": sum(1 for r in measured if not r["error"]) / window,
             "canary_requests": len(canaries), "wrong_markers": sum(1 for r in canaries if r["marker_ok"] == 0),
             "server_cpu": server_cpu / wall if wall > 0 else math.nan}  # fmt: skip
    out = []
    for g in groups:
        row = {"system": system, "rate": rate, **g}
        if g["group"] == "all":
            row.update(extra)
            row["slo_met"] = int(meets_slo(row))
        out.append(row)
    return out


def replica_profile(metrics_dir: Path) -> dict:
    """Where ours' time went over the window, from the replica's /metrics (summed over replicas):
    mean TTFT as the replica saw it, mean queue time (arrival to the engine: adapter load + waiting for a
    row), mean adapter load time into a slot, prompt and generated tokens per second."""
    from loadtests.runner import _total, parse_metrics

    d = {k: 0.0 for k in ("ttft_sum", "ttft_n", "queue_sum", "queue_n", "load_sum", "load_n", "prompt", "gen")}
    span = 0.0
    for start in sorted(metrics_dir.glob("replica*-start.prom")):
        end = start.with_name(start.name.replace("-start", "-end"))
        if not end.exists():
            continue
        t0, a = parse_metrics(start.read_text())
        t1, b = parse_metrics(end.read_text())
        span = max(span, (t1 or 0) - (t0 or 0))
        for key, name in [("ttft_sum", "lorafarm_time_to_first_token_seconds_sum"),
                          ("ttft_n", "lorafarm_time_to_first_token_seconds_count"),
                          ("queue_sum", "lorafarm_request_queue_time_seconds_sum"),
                          ("queue_n", "lorafarm_request_queue_time_seconds_count"),
                          ("load_sum", "lorafarm_adapter_load_seconds_sum"),
                          ("load_n", "lorafarm_adapter_load_seconds_count"),
                          ("prompt", "lorafarm_prompt_tokens"), ("gen", "lorafarm_generation_tokens")]:
            d[key] += _total(b, name) - _total(a, name)

    def ratio(x: float, n: float, scale: float = 1000.0) -> float:
        return scale * x / n if n else math.nan

    return {"replica_ttft_mean_ms": ratio(d["ttft_sum"], d["ttft_n"]),
            "replica_queue_mean_ms": ratio(d["queue_sum"], d["queue_n"]),
            "slot_load_mean_ms": ratio(d["load_sum"], d["load_n"]), "slot_loads": d["load_n"],
            "prompt_tokens_per_s": ratio(d["prompt"], span, 1.0), "generated_tokens_per_s": ratio(d["gen"], span, 1.0)}


def meets_slo(row: dict) -> bool:
    p95 = float(row["ttft_p95_ms"])
    return (not math.isnan(p95) and p95 < SLO_TTFT_MS and int(row["errors"]) == 0 and int(row["requests"]) > 0
            and int(row.get("wrong_markers") or 0) == 0)


# -- the sweep --------------------------------------------------------------------------------


def build_servers(args, fleet: Fleet) -> dict:
    from benchmarks.peers import install as peers_install
    from benchmarks.peers import servers

    built = {}
    logs = args.out / "logs"
    for system in args.systems:
        if system == "ours":
            state = args.out / "ours-state"
            built[system] = servers.ours(peers_install.ours(), args.model, fleet.folders, state, args.threads,
                                         args.ours_replica_flags, args.ours_router_flags, upload=True,
                                         progress=not args.quiet)
        elif system == "vllm":
            got = peers_install.install("vllm", args.root)
            built[system] = servers.vllm_longtail(got, args.model, fleet.folder, fleet.names, logs, args.threads,
                                                  rank=max(RANK_CYCLE), max_loras=args.vllm_max_loras,
                                                  cpu_loras=args.vllm_cpu_loras)
        else:
            raise CliError(f"--systems: unknown system {system!r} (ours, vllm)")
    return built


def _replica_urls(server) -> list[str]:
    farm_json = Path(server.log).parent / "farm.json"
    if server.peer != "ours" or not farm_json.exists():
        return []
    return [r["url"] for r in json.loads(farm_json.read_text()).get("replicas", []) if r.get("url")]


def _say(msg: str) -> None:
    print(f"loadtest-real: {msg}", file=sys.stderr, flush=True)


def sweep(args) -> Path:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_prep = time.perf_counter()
    fleet = prepare_adapters(args.model, out, args.adapters, args.canaries, args.seed, progress=not args.quiet)
    prep_s = time.perf_counter() - t_prep
    _say(f"{len(fleet.names)} adapters in {fleet.folder} ({fleet.bytes / 1e9:.2f} GB); canaries "
         f"{', '.join(f'{n} at rank {fleet.names.index(n) + 1}' for n in fleet.markers) or 'none'}")
    steps_csv, rows_dir = out / "steps.csv", out / "requests"
    if steps_csv.exists():
        steps_csv.unlink()
    rows_dir.mkdir(exist_ok=True)
    built = build_servers(args, fleet)
    meta = {"command": " ".join([os.path.basename(sys.executable), "-m", "loadtests.real", *sys.argv[1:]]),
            "started_unix": time.time(), "load_at_start": list(os.getloadavg()), "cpus": os.cpu_count(),
            "platform": platform.platform(), "model": str(args.model), "adapters": len(fleet.names),
            "adapter_bytes": fleet.bytes, "adapter_shape": {"ranks": sorted(set(RANK_CYCLE)),
            "rank_shares": {r: RANK_CYCLE.count(r) / len(RANK_CYCLE) for r in sorted(set(RANK_CYCLE))},
            "targets": list(TARGET_MODULES), "dtype": ADAPTER_DTYPE}, "prepare_s": prep_s,
            "canaries": {n: {"marker": m, "prompt": fleet.prompts[n], "popularity_rank": fleet.names.index(n) + 1}
                         for n, m in fleet.markers.items()},
            "base_share": args.base_share, "chat": CHAT, "seed": args.seed, "rates": args.rates,
            "warmup_s": args.warmup, "window_s": args.window, "drain_s": args.drain, "threads": args.threads,
            "slo_ttft_ms": SLO_TTFT_MS, "systems": args.systems, "servers": {}, "steps": []}  # fmt: skip
    failed: set[str] = set()
    seen: dict[str, set[str]] = {s: set() for s in args.systems}
    missed = {s: 0 for s in args.systems}  # consecutive steps that missed the SLO
    try:
        for system, server in built.items():  # one at a time: the other is paused while one starts
            _say(f"starting {system}: {' '.join(server.command[:6])} ...")
            t = time.perf_counter()
            server.launch().wait_ready(args.startup_timeout)
            _say(f"{system} ready in {time.perf_counter() - t:.0f} s")
            server.pause()
            meta["servers"][system] = server.describe()
            (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        for k, rate in enumerate(args.rates):
            requests = workload(fleet, rate, args.warmup + args.window, args.seed + k, args.base_share)
            order = list(built) if k % 2 == 0 else list(reversed(built))
            for system in order:
                if system in failed:
                    continue
                server = built[system]
                server.resume(timeout=args.startup_timeout)
                metrics_dir = out / "metrics" / f"{system}-{rate:g}"
                cpu0, w0 = _tree_cpu_s(server), time.perf_counter()
                try:
                    rows = asyncio.run(drive(server, requests, system=system, rate=rate, warmup=args.warmup,
                                             window=args.window, drain=args.drain, seen=seen[system],
                                             metrics_dir=metrics_dir, replica_urls=_replica_urls(server),
                                             progress=not args.quiet))  # fmt: skip
                finally:
                    cpu1, w1 = _tree_cpu_s(server), time.perf_counter()
                    server.pause()
                with open(rows_dir / f"{system}-{rate:g}.csv", "w", newline="") as f:
                    w = csv.DictWriter(f, ROW_COLUMNS)
                    w.writeheader()
                    w.writerows(rows)
                figures = step_figures(rows, system=system, rate=rate, window=args.window, metrics_dir=metrics_dir,
                                       server_cpu=cpu1 - cpu0, wall=w1 - w0)
                append_csv(steps_csv, figures)
                top = figures[0]
                meta["steps"].append({"system": system, "rate": rate, "order": order.index(system),
                                      "slo_met": top["slo_met"], "finished_unix": time.time()})
                (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
                _say(f"{system} {rate:g} req/s: p95 TTFT {top['ttft_p95_ms']:.0f} ms, errors {top['errors']} "
                     f"({top['errors_by_kind'] or 'none'}), wrong markers {top['wrong_markers']}, "
                     f"load {top['load_end']:.1f}: SLO {'met' if top['slo_met'] else 'missed'}")
                missed[system] = 0 if top["slo_met"] else missed[system] + 1
                if missed[system] >= args.stop_after and not args.keep_going:
                    failed.add(system)
            if failed >= set(built):
                break
    finally:
        for server in built.values():
            server.stop()
        meta["finished_unix"] = time.time()
        meta["load_at_end"] = list(os.getloadavg())
        (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return steps_csv


def _floats(value: str) -> list[float]:
    try:
        out = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated numbers") from None
    if not out or any(v <= 0 or math.isinf(v) for v in out):
        raise argparse.ArgumentTypeError(f"{value!r}: positive numbers")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.real", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the sweep (writes --out, never docs/)")
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--adapters", type=int, default=5000)
    r.add_argument("--canaries", type=int, default=3)
    r.add_argument("--systems", default="ours,vllm")
    r.add_argument("--rates", type=_floats, default=[0.5, 1, 2, 3, 4, 6])
    r.add_argument("--warmup", type=float, default=20.0)
    r.add_argument("--window", type=float, default=60.0)
    r.add_argument("--drain", type=float, default=30.0, help="seconds after the window for its requests to end")
    r.add_argument("--base-share", type=float, default=BASE_SHARE)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--ours-replica-flags", default="", help="default: none (the replica's defaults)")
    r.add_argument("--ours-router-flags", default="")
    r.add_argument("--vllm-max-loras", type=int, default=8)
    r.add_argument("--vllm-cpu-loras", type=int, default=256)
    r.add_argument("--root", type=Path, default=Path("var/peers"), help="where bench-peers installs vLLM")
    r.add_argument("--startup-timeout", type=float, default=1800.0)
    r.add_argument("--out", type=Path, default=Path("var/loadtest-real"))
    r.add_argument("--keep-going", action="store_true", help="every rate for every system, SLO met or not")
    r.add_argument("--stop-after", type=int, default=2,
                   help="a system leaves the sweep after this many consecutive steps that miss the SLO (default 2)")
    r.add_argument("--quiet", action="store_true")
    d = sub.add_parser("report", help="docs/loadtests.md's section and PNGs from a run")
    d.add_argument("--from", dest="src", type=Path, default=Path("var/loadtest-real"))
    d.add_argument("--to", type=Path, default=Path("docs"))
    d.add_argument("--no-scale", action="store_true", help="docs/loadtests.md only, not docs/scale.md's section")
    args = p.parse_args(argv)
    if args.cmd == "run":  # Ctrl-C or SIGTERM stop every server it started (SIGINT too when a shell started
        # it in the background, which ignores SIGINT); a paused server is resumed to stop (Server.stop)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, lambda *_: signal.default_int_handler(signal.SIGINT, None))
    try:
        if args.cmd == "run":
            args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
            if args.adapters < max(1, args.canaries) or args.canaries < 0:
                raise CliError("--adapters must be at least 1 and at least --canaries")
            if not (args.model / "config.json").is_file():
                raise CliError(f"--model {args.model}: no config.json there")
            print(sweep(args))
        else:
            from loadtests.real_report import write_docs

            print(write_docs(args.src, args.to, scale=not args.no_scale))
    except CliError as e:
        print(f"loadtest-real: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loadtest-real: interrupted; every server stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
