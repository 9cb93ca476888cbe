"""Per-request sampling over a batch of logits.

Each row of the step's logits [B, V] is processed with its own request's parameters, in this
order (every stage is one batched tensor operation over the rows that use it; rows that do not use
a stage are left untouched by it):

  1. logprobs: log_softmax of the raw logits (what the model says, before any processing), for
     rows that asked for logprobs; the sampled token's value and the top-k are reported.
  2. repetition penalty r (HF/vLLM/CTRL form) over every token seen in the prompt or the output:
     l -> l / r if l > 0 else l * r.
  3. frequency and presence penalties (OpenAI form) over the output tokens only:
     l -> l - c * frequency_penalty - [c > 0] * presence_penalty, c the token's output count.
  4. logit_bias: l[t] += bias[t].
  5. grammar mask (constrained decoding, `handler.grammar.constrained`): tokens the row's grammar does not
     allow next get -inf. Filling the mask is per row (a grammar walk), applying it is batched.
  6. temperature 0: argmax (exact greedy). Otherwise l / T, then top_k (keep the k largest),
     top_p (keep the smallest nucleus with mass >= p), min_p (drop p_i < min_p * max p), and one
     token drawn with the request's own `torch.Generator` (seeded from `SamplingParams.seed`, or
     fresh entropy when none is given), so a seeded request draws the same tokens whatever else
     shares its batch. Drawing uses the exponential race (argmax of p / E with E ~ Exp(1)), which
     equals sampling from p; only the noise draw is per row, the rest is batched.

`RowState` is what a request carries between steps: its generator, its grammar matcher, its
output tokens (only when a penalty needs them) and the logprobs of its last token. The penalties'
token counts are built for all penalised rows at once by one padded scatter-add per step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from handler.grammar.constrained import allowed_tokens, consume, new_matcher
from handler.model.tensors import to_device

MAX_TOP_LOGPROBS = 20


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
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | Mapping[int, float] = field(default=())
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k
    # an llguidance grammar: a string (compiled in-process) or a handler.grammar.constrained.CompiledGrammar
    # (compiled and test-run in a worker process: what the replica serves with); None: free text
    grammar: Any = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))

    def validate(self, vocab_size: int | None = None) -> None:
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
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (-2.0 <= self.presence_penalty <= 2.0) or not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        for t, b in self.logit_bias:
            if vocab_size is not None and not (0 <= t < vocab_size):
                raise ValueError(f"logit_bias token {t} is not in the vocabulary [0, {vocab_size})")
            if not (-100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def counts_output(self) -> bool:
        """Does a penalty need the row's output-token counts?"""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own generator; None for greedy requests (they draw nothing)."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else random.SystemRandom().getrandbits(63))
    return g


class RowState:
    """One request's sampling state between steps.

    generator: its `torch.Generator` (None when greedy). matcher: its grammar matcher (None when
    free). output: the tokens generated so far (kept only when a penalty needs them); prompt: the
    prompt's tokens (kept only for the repetition penalty). logprobs: (logprob, [(token, logprob),
    ...]) of the last sampled token when the request asked for logprobs.
    """

    __slots__ = ("params", "generator", "matcher", "output", "prompt", "logprobs")

    def __init__(self, params: SamplingParams, prompt: list[int], device: torch.device, vocab_size: int,
                 tokenizer: Any = None):
        self.params = params
        self.generator = make_generator(params, device)
        self.matcher = None
        if params.grammar is not None:
            self.matcher = new_matcher(params.grammar, tokenizer, vocab_size)
        self.output: list[int] | None = [] if params.counts_output else None
        self.prompt: list[int] | None = list(prompt) if params.repetition_penalty != 1.0 else None
        self.logprobs: tuple[float, list[tuple[int, float]]] | None = None

    def grammar_error(self) -> str | None:
        """The error of a matcher that hit a parser limit (or was fed a token it refused), else None:
        the engine ends such a row with an error rather than let it finish with a broken document."""
        m = self.matcher
        if m is not None and m.is_error():
            return m.get_error() or "grammar matcher error"
        return None

    def accept(self, token: int, grammar: bool = True) -> None:
        """Advance past a sampled token: grammar state (unless the caller did) and output counts."""
        if grammar and self.matcher is not None:
            self.matcher.consume_token(token)
        if self.output is not None:
            self.output.append(token)


def _on(t: torch.Tensor, device) -> torch.Tensor:
    """A host-built tensor on `device` without a host sync (pinned, non-blocking on CUDA)."""
    return to_device(t, torch.device(device))


def _rows_tensor(rows: list[int], device) -> torch.Tensor:
    return _on(torch.tensor(rows, dtype=torch.long), device)


def _col(values: list[float], device) -> torch.Tensor:
    return _on(torch.tensor(values, dtype=torch.float32), device).unsqueeze(1)


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device results on the host with one wait for the stream (the step's only host sync)."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors]
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host


def token_counts(lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[len(lists), V] float: how often each token occurs in each list (one padded scatter-add)."""
    width = max((len(t) for t in lists), default=0)
    counts = torch.zeros(len(lists), vocab_size, device=device)
    if width:
        ids = _on(torch.tensor([t + [0] * (width - len(t)) for t in lists], dtype=torch.long), device)
        ones = _on(torch.tensor([[1.0] * len(t) + [0.0] * (width - len(t)) for t in lists]), device)
        counts.scatter_add_(1, ids, ones)
    return counts


def apply_penalties(x: torch.Tensor, params: list[SamplingParams], states: list[RowState]) -> None:
    """Stages 2 and 3 (repetition, frequency, presence) in place on the rows that use them."""
    rows = [i for i, p in enumerate(params) if p.counts_output]
    if not rows:
        return
    dev = x.device
    idx = _rows_tensor(rows, dev)
    sub = x.index_select(0, idx)
    counts = token_counts([states[i].output for i in rows], x.shape[1], dev)
    out_seen = counts > 0
    rep = [params[i].repetition_penalty for i in rows]
    if any(r != 1.0 for r in rep):
        seen = out_seen | (token_counts([states[i].prompt or [] for i in rows], x.shape[1], dev) > 0)
        r = _col(rep, dev)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    freq = _col([params[i].frequency_penalty for i in rows], dev)
    pres = _col([params[i].presence_penalty for i in rows], dev)
    sub = sub - counts * freq - out_seen.float() * pres
    x.index_copy_(0, idx, sub)


def apply_logit_bias(x: torch.Tensor, params: list[SamplingParams]) -> None:
    """Stage 4: one scatter-add of every row's biases."""
    entries = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if not entries:
        return
    rows, toks, bias = zip(*entries)
    dev = x.device
    x.index_put_((_rows_tensor(list(rows), dev), _rows_tensor(list(toks), dev)),
                 _on(torch.tensor(bias, dtype=x.dtype), dev), accumulate=True)


def apply_grammar(x: torch.Tensor, states: list[RowState]) -> None:
    """Stage 5: each constrained row's allowed-token bitmask, applied to all of them at once."""
    rows = [i for i, s in enumerate(states) if s.matcher is not None]
    if not rows:
        return
    allowed = _on(allowed_tokens([states[i].matcher for i in rows], x.shape[1]), x.device)
    idx = _rows_tensor(rows, x.device)
    x.index_copy_(0, idx, x.index_select(0, idx).masked_fill(~allowed, float("-inf")))


def filter_probs(probs: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Stage 6's filters on temperature-scaled probabilities [R, V]: zero what top_k, top_p and
    min_p drop (the most likely token always stays); rows whose filters are off are unchanged."""
    dev = probs.device
    V = probs.shape[1]
    if any(0 < k < V for k in top_k):
        on = [0 < k < V for k in top_k]
        k = _on(torch.tensor([k if o else 1 for k, o in zip(top_k, on)]), dev)
        kth = probs.topk(max(k for k, o in zip(top_k, on) if o), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        kth = kth.masked_fill(~_on(torch.tensor(on), dev).unsqueeze(1), 0.0)  # rows without top_k keep all
        probs = probs.masked_fill(probs < kth, 0.0)
    if any(p < 1.0 for p in top_p):
        tp = _col(top_p, dev)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= tp * sorted_p.sum(dim=-1, keepdim=True), 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    if any(m > 0.0 for m in min_p):
        mp = _col(min_p, dev)
        probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    states: list[RowState],
) -> list[int]:
    """One token per row of `logits` [B, V] with each row's params and state (see the module doc).

    Each `RowState` is advanced past its token (grammar, counts) and holds its token's logprobs."""
    dev = logits.device
    processed = any(p.counts_output or p.logit_bias for p in params) or any(s.matcher for s in states)
    x = logits.float().clone() if processed else logits.float()
    apply_penalties(x, params, states)
    apply_logit_bias(x, params)
    apply_grammar(x, states)
    out = x.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = _rows_tensor(rows, dev)
        temp = _col([params[i].temperature for i in rows], dev)
        probs = torch.softmax(x.index_select(0, idx) / temp, dim=-1)
        probs = filter_probs(probs, [params[i].top_k for i in rows], [params[i].top_p for i in rows],
                             [params[i].min_p for i in rows])
        noise = torch.stack(
            [torch.empty(probs.shape[1], device=dev).exponential_(generator=states[i].generator) for i in rows]
        )
        out[idx] = (probs / noise).argmax(dim=-1)
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    fetch = [out]
    if lp_rows:  # computed on the device from `out`, fetched with the tokens
        lp_idx = _rows_tensor(lp_rows, dev)
        logp = torch.log_softmax(logits.index_select(0, lp_idx).float(), dim=-1)
        kmax = max(params[i].logprobs for i in lp_rows)
        top_v, top_i = logp.topk(kmax, dim=-1) if kmax else (logp[:, :0], logp[:, :0].long())
        fetch += [logp.gather(1, out.index_select(0, lp_idx).unsqueeze(1)).squeeze(1), top_v, top_i]
    host = _to_host(fetch)
    tokens = host[0].tolist()
    if lp_rows:
        chosen, top_v, top_i = (t.tolist() for t in host[1:])
        for j, i in enumerate(lp_rows):
            k = params[i].logprobs
            states[i].logprobs = (chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
    grammar_rows = [(s.matcher, t) for s, t in zip(states, tokens) if s.matcher is not None]
    if grammar_rows:
        consume(grammar_rows)
    for s, t in zip(states, tokens):
        s.accept(t, grammar=False)
    return tokens

