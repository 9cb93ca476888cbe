"""Per-request sampling over a batch of logits.

Temperature 0 is exact greedy (argmax of the raw logits). Otherwise logits are divided by the
row's temperature, restricted to the top-p nucleus, and a token is drawn with the request's own
`torch.Generator` (seeded from `SamplingParams.seed`, or from fresh entropy when none is given),
so a seeded request draws the same tokens whatever else shares its batch. Drawing uses the
exponential race (argmax of p / E with E ~ Exp(1)), which equals sampling from p; only the noise
draw is per row (each row has its own generator), the rest is batched.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] | list[str] | str | None = None
    seed: int | None = None
    # beyond the contract, defaults keep it compatible
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> None:
        """Raise ValueError for values no request may carry."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature or self.temperature == float("inf"):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own generator; None for greedy requests (they draw nothing)."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else random.SystemRandom().getrandbits(63))
    return g


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of `logits` [B, V] (float32) with each row's params and generator."""
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temp = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=torch.float32)
        probs = torch.softmax(logits.index_select(0, idx).float() / temp.unsqueeze(1), dim=-1)
        top_p = [params[i].top_p for i in rows]
        if any(p < 1.0 for p in top_p):
            tp = torch.tensor(top_p, device=logits.device, dtype=torch.float32).unsqueeze(1)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
            sorted_p = sorted_p.masked_fill(before >= tp, 0.0)  # the top token always stays
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        noise = torch.stack(
            [torch.empty(probs.shape[1], device=logits.device).exponential_(generator=generators[i]) for i in rows]
        )
        out[idx] = (probs / noise).argmax(dim=-1)
    return out.tolist()
