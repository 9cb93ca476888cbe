"""Workload generator: a skewed adapter mix, realistic length distributions, Poisson arrivals.

A few customers send most requests (Zipf over adapters, exponent ~1.1 as in production traces);
prompt and output lengths are log-normal, clipped to the model's context. Seeded: the same
arguments give the same workload, so two runs (affinity vs random routing) replay identical traffic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lorafarm.dev.adapters import random_prompts


@dataclass(frozen=True)
class WorkItem:
    at: float  # seconds from the start
    model: str  # alias or adapter id
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    rate: float = 5.0  # requests per second (Poisson)
    duration: float = 30.0  # seconds
    zipf_s: float = 1.1
    prompt_words_median: int = 12
    max_tokens_median: int = 16
    max_tokens_cap: int = 64
    seed: int = 0


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def _lognormal_int(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def generate(models: list[str], spec: WorkloadSpec) -> list[WorkItem]:
    """Requests over `models` (most popular first), arriving as a Poisson process."""
    if not models:
        raise ValueError("no models to send requests to")
    rng = random.Random(spec.seed)
    weights = zipf_weights(len(models), spec.zipf_s)
    words = " ".join(random_prompts(seed=spec.seed, count=200)).split()
    items: list[WorkItem] = []
    t = 0.0
    while True:
        t += rng.expovariate(spec.rate)
        if t >= spec.duration:
            return items
        n_words = _lognormal_int(rng, spec.prompt_words_median, 0.6, 1, 400)
        prompt = " ".join(rng.choice(words) for _ in range(n_words))
        max_tokens = _lognormal_int(rng, spec.max_tokens_median, 0.5, 1, spec.max_tokens_cap)
        items.append(WorkItem(t, rng.choices(models, weights)[0], prompt, max_tokens))
