"""Workload generator: a skewed adapter mix, realistic length distributions, open-loop arrivals.

- Adapter popularity is Zipf: the k-th most popular of n adapters gets weight k^-s / H(n, s)
  (s = 1.1 by default, as in production traces; S-LoRA and SGLang sweep 0.8-1.5).
- Prompt and output lengths are log-normal: length = exp(N(ln median, sigma^2)), clipped to
  [1, cap]; or they are replayed in order from a CSV trace in the public Azure LLM inference trace
  format (`TIMESTAMP,ContextTokens,GeneratedTokens`).
- Arrivals are a Poisson process at `rate` (exponential gaps of mean 1 / rate), or the trace's own
  timestamps scaled so their mean rate is `rate`. Open loop: arrival times are fixed before the run
  and never wait for answers, so a slow server sees a growing queue, not fewer requests.
- Shared system prompts (off by default: share 0): each adapter is one customer with one system
  prompt of its own, its length in words drawn once per adapter (log-normal, median
  `system_prompt_words_median`, clipped to [1, cap]) and its text seeded by (system prompt seed,
  adapter), so the same adapter always sends the same words, whatever `seed` draws the requests. A share `system_prompt_share` of the requests carries
  their adapter's system prompt (sent as the chat system message, before the user prompt); the
  others send the user prompt alone. The share is drawn from its own random stream, so arrivals,
  adapters and user prompts are the same whatever the share (share 0 is the workload as before).

Seeded: the same arguments give the same workload, so two runs (affinity vs random routing, prefix
cache on vs off) replay identical traffic.
"""

from __future__ import annotations

import csv
import functools
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from lorafarm.dev.adapters import random_prompts


@dataclass(frozen=True)
class WorkItem:
    at: float  # seconds from the start
    model: str  # alias or adapter id
    prompt: str
    max_tokens: int
    system: str = ""  # the adapter's shared system prompt, when this request carries it


@dataclass(frozen=True)
class WorkloadSpec:
    rate: float = 5.0  # requests per second (Poisson)
    duration: float = 30.0  # seconds
    zipf_s: float = 1.1
    prompt_words_median: int = 12
    prompt_words_sigma: float = 0.6
    prompt_words_cap: int = 400
    max_tokens_median: int = 16
    max_tokens_sigma: float = 0.5
    max_tokens_cap: int = 64
    seed: int = 0
    system_prompt_share: float = 0.0  # fraction of requests that carry their adapter's system prompt
    system_prompt_words_median: int = 200  # per adapter, log-normal
    system_prompt_words_sigma: float = 0.5
    system_prompt_words_cap: int = 400
    system_prompt_seed: int = 0  # the system prompts' own seed: a customer's prompt stays when `seed` changes


@dataclass(frozen=True)
class TraceRow:
    at: float  # seconds since the trace's first request
    context_tokens: int
    generated_tokens: int


# The workload's shape options, shared by `lorafarm loadtest` and the locustfile (which it passes them to).
WORKLOAD_OPTIONS = (
    ("--zipf", float, 1.1, "Zipf exponent of adapter popularity (default 1.1)"),
    ("--seed", int, 0, "workload seed: same seed, same requests (default 0)"),
    ("--prompt-median", float, 12, "log-normal prompt length in words: median (default 12)"),
    ("--prompt-sigma", float, 0.6, "log-normal prompt length: sigma of its log (default 0.6)"),
    ("--output-median", float, 16, "log-normal output tokens: median (default 16)"),
    ("--output-sigma", float, 0.5, "log-normal output tokens: sigma of its log (default 0.5)"),
    ("--output-cap", int, 64, "output tokens at most (default 64)"),
    ("--trace", str, "", "Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens): lengths and gaps"),
    ("--system-prompt-share", float, 0.0, "fraction of requests that carry their adapter's shared system prompt "
     "(default 0: none)"),
    ("--system-prompt-median", float, 200, "log-normal system prompt length in words, drawn once per adapter: "
     "median (default 200)"),
    ("--system-prompt-sigma", float, 0.5, "system prompt length: sigma of its log (default 0.5)"),
    ("--system-prompt-cap", int, 400, "system prompt words at most (default 400)"),
    ("--system-prompt-seed", int, 0, "seed of the adapters' system prompts, apart from --seed (default 0)"),
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_workload_arguments(group) -> None:
    for flag, kind, default, text in WORKLOAD_OPTIONS:
        group.add_argument(flag, type=kind, default=default, help=text)


def workload_options(args) -> dict:
    """{dest: value} of the shape options in parsed `args`."""
    return {_dest(flag): getattr(args, _dest(flag)) for flag, *_ in WORKLOAD_OPTIONS}


def workload_flags(options: dict) -> list[str]:
    """The command-line flags that give these options to another parser (the locustfile's)."""
    out = []
    for flag, *_ in WORKLOAD_OPTIONS:
        value = options.get(_dest(flag))
        if value not in (None, ""):
            out += [flag, str(value)]
    return out


def spec_from_options(options: dict, rate: float, duration: float) -> WorkloadSpec:
    o = options
    return WorkloadSpec(rate=rate, duration=duration, zipf_s=o["zipf"], seed=o["seed"],
                        prompt_words_median=o["prompt_median"], prompt_words_sigma=o["prompt_sigma"],
                        max_tokens_median=o["output_median"], max_tokens_sigma=o["output_sigma"],
                        max_tokens_cap=o["output_cap"],
                        system_prompt_share=o.get("system_prompt_share", 0.0),
                        system_prompt_words_median=o.get("system_prompt_median", 200),
                        system_prompt_words_sigma=o.get("system_prompt_sigma", 0.5),
                        system_prompt_words_cap=o.get("system_prompt_cap", 400),
                        system_prompt_seed=o.get("system_prompt_seed", 0))  # fmt: skip


def check_spec(spec: WorkloadSpec) -> None:
    """ValueError on shape options no workload can have."""
    if not 0.0 <= spec.system_prompt_share <= 1.0:
        raise ValueError(f"system prompt share {spec.system_prompt_share:g}: must be within 0..1")
    if spec.system_prompt_words_median <= 0 or spec.system_prompt_words_sigma < 0:
        raise ValueError("system prompt median must be positive and its sigma not negative")
    if spec.system_prompt_words_cap < 1:
        raise ValueError(f"system prompt cap {spec.system_prompt_words_cap}: must be at least 1")


def zipf_weights(n: int, s: float) -> list[float]:
    """P(rank k) = k^-s / sum_j j^-s for k = 1..n."""
    w = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def _timestamp(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return datetime.fromisoformat(value.strip().replace(" ", "T", 1)[:26]).timestamp()


def read_trace(path: str | Path) -> list[TraceRow]:
    """An Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens; timestamps as
    seconds or ISO dates), sorted by time, timestamps relative to the first row."""
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        fields = {name.lower(): name for name in reader.fieldnames or []}
        need = ("timestamp", "contexttokens", "generatedtokens")
        if not all(n in fields for n in need):
            raise ValueError(f"{path}: a trace needs the columns TIMESTAMP, ContextTokens, GeneratedTokens")
        for line in reader:
            rows.append((_timestamp(line[fields["timestamp"]]), int(line[fields["contexttokens"]]),
                         int(line[fields["generatedtokens"]])))  # fmt: skip
    if not rows:
        raise ValueError(f"{path}: the trace has no rows")
    rows.sort()
    t0 = rows[0][0]
    return [TraceRow(t - t0, c, g) for t, c, g in rows]


@functools.lru_cache(maxsize=8)
def _vocabulary(seed: int) -> tuple[str, ...]:
    return tuple(" ".join(random_prompts(seed=seed, count=200)).split())


def system_prompt(model: str, spec: WorkloadSpec) -> str:
    """`model`'s shared system prompt: the same text for the same (system_prompt_seed, model), whatever
    else the workload holds (its `seed` included). Its length in words is log-normal (spec's median and
    sigma), within [1, cap]."""
    s = spec.system_prompt_seed
    rng = random.Random(f"lorafarm-system-prompt:{s}:{model}")  # str seeds hash with sha512: stable
    n = _lognormal_int(rng, spec.system_prompt_words_median, spec.system_prompt_words_sigma, 1,
                       spec.system_prompt_words_cap)  # fmt: skip
    words = _vocabulary(s)
    head = f"You are the assistant of customer {model}."
    body = [rng.choice(words) for _ in range(max(0, n - len(head.split())))]
    return " ".join((head.split() + body)[:n])


def generate(models: list[str], spec: WorkloadSpec, trace: list[TraceRow] | None = None) -> list[WorkItem]:
    """Requests over `models` (most popular first) for `spec.duration` seconds.

    Without a trace: Poisson arrivals at spec.rate, log-normal lengths. With one: its rows in order
    (wrapping around), lengths from it (context tokens ~ prompt words, capped), gaps scaled so the
    mean rate is spec.rate. A share spec.system_prompt_share of the requests carries its adapter's
    system prompt (`system_prompt`), drawn from a stream of its own (the rest is the same at any share)."""
    if not models:
        raise ValueError("no models to send requests to")
    if spec.rate <= 0 or spec.duration <= 0:
        raise ValueError("rate and duration must be positive")
    check_spec(spec)
    rng = random.Random(spec.seed)
    share_rng = random.Random(f"lorafarm-system-share:{spec.seed}")
    systems: dict[str, str] = {}
    weights = zipf_weights(len(models), spec.zipf_s)
    words = _vocabulary(spec.seed)
    gaps: list[float] = []
    if trace:
        # gap before row j is its distance to row j-1; the first row (and each wrap) gets the mean gap
        span = trace[-1].at - trace[0].at
        mean = span / (len(trace) - 1) if len(trace) > 1 and span > 0 else 1.0 / spec.rate
        scale = (1.0 / spec.rate) / mean
        gaps = [mean * scale] + [(b.at - a.at) * scale for a, b in zip(trace, trace[1:])]
    items: list[WorkItem] = []
    t = 0.0
    i = 0
    while True:
        if trace:
            row = trace[i % len(trace)]
            t += gaps[i % len(trace)]
            n_words = max(1, min(spec.prompt_words_cap, row.context_tokens))
            max_tokens = max(1, min(spec.max_tokens_cap, row.generated_tokens))
        else:
            t += rng.expovariate(spec.rate)
            n_words = _lognormal_int(rng, spec.prompt_words_median, spec.prompt_words_sigma, 1, spec.prompt_words_cap)
            max_tokens = _lognormal_int(rng, spec.max_tokens_median, spec.max_tokens_sigma, 1, spec.max_tokens_cap)
        if t >= spec.duration:
            return items
        i += 1
        prompt = " ".join(rng.choice(words) for _ in range(n_words))
        model = rng.choices(models, weights)[0]
        system = ""
        if spec.system_prompt_share > 0 and share_rng.random() < spec.system_prompt_share:
            if model not in systems:
                systems[model] = system_prompt(model, spec)
            system = systems[model]
        items.append(WorkItem(t, model, prompt, max_tokens, system))
