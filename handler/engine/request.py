"""One request's life in the engine, and what the engine reports about requests.

Owns `Request` (a request's tokens, its KV blocks and prefill progress, its prefix-cache chain, its
detokenisation offsets and its sampling state), what `Engine.add_request` refuses before anything
is queued (`checked_prompt`, `row_state`), `TokenEvent` (what a request's `on_event` receives) and
`EngineStats`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from handler.engine.errors import InvalidRequestError, RequestTooLongError
from handler.engine.sampling import RowState, SamplingParams
from handler.engine.speculate import NgramIndex


@dataclass
class TokenEvent:
    request_id: str
    token_id: int | None
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error" on the final event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    # the token's (logprob, [(token, logprob), ...top]) when the request asked for logprobs
    logprobs: tuple | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache at admission


@dataclass
class EngineStats:
    running: int  # admitted requests (prefilling or decoding)
    waiting: int  # queued, not yet admitted
    tokens_in_flight: int  # remaining work: unprefilled prompt tokens + tokens still to generate
    kv_cache_usage: float  # fraction of KV cache blocks reserved, 0..1
    # beyond the contract
    mounted_adapters: int = 0
    free_slots: dict = field(default_factory=dict)  # pool rank -> free slots
    steps: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    kv_cache_capacity_tokens: int = 0
    preemptions: int = 0  # requests preempted: preemptions_kv (by recompute) + preemptions_share (parked)
    attention: str = "gather"  # decode attention in use: "paged" (in place) or "gather"
    decode_step_c: int = 0  # decode steps run by the C decode step (`handler.model.decode_step`)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    prefix_cache_hits: int = 0  # of those, tokens found cached (not prefilled)
    prefix_cache_blocks: int = 0  # blocks holding a cached prefix block now (in use or not)
    prefix_cache_evictions: int = 0
    prefix_cache_deferred: int = 0  # admissions put off until a prefix block another request computes is cached
    speculative_drafted: int = 0  # draft tokens checked (handler.engine.speculate)
    speculative_accepted: int = 0  # of those, tokens taken
    scheduling: str = "fair"  # the admission policy: "fair" (handler.engine.fairness) or "fifo"
    preemptions_kv: int = 0  # preempted because the KV cache ran out
    preemptions_share: int = 0  # parked (KV kept) because another tenant waited below its share of rows
    tenants_active: int = 0  # tenants with requests waiting or admitted


class Request:
    __slots__ = (
        "id", "prompt", "params", "adapter_id", "slot", "on_event", "gen", "out", "blocks", "prefilled", "ctx",
        "cancelled", "text", "emitted", "prefix_off", "read_off", "arrival", "max_stop", "salt", "root", "hashes",
        "published", "cached", "admitted", "ngrams", "tenant", "weight", "charged_prompt", "charged_out",
        "decoded_at",
    )

    def __init__(self, rid: str, prompt: list[int], params: SamplingParams, adapter_id: str | None, slot: int,
                 on_event: Callable[[TokenEvent], None] | None, gen: RowState, salt: str | None = None,
                 tenant: str | None = None, weight: float = 1.0):
        self.id, self.prompt, self.params = rid, prompt, params
        self.adapter_id, self.slot, self.on_event, self.gen = adapter_id, slot, on_event, gen
        self.out: list[int] = []
        self.blocks: list[int] | None = None
        self.ctx = prompt  # the tokens to prefill: the prompt, or prompt + output after a preemption
        self.prefilled = 0
        self.cancelled = False
        self.text = ""  # all completion text decoded so far (before stop-string truncation)
        self.emitted = 0  # characters of `text` already sent
        self.prefix_off = 0
        self.read_off = 0
        self.arrival = time.monotonic()
        self.max_stop = max((len(s) for s in params.stop), default=0)
        self.salt = salt  # the prefix cache's tenant salt
        self.root: bytes | None = None  # the chain's root: base, adapter and tenant (prefix cache)
        self.hashes: list[bytes] | None = None  # chain hashes of ctx's full blocks (prefix cache)
        self.published = 0  # leading blocks of `blocks` already named in the prefix cache
        self.cached = 0  # prompt tokens taken from the prefix cache at first admission
        self.admitted = False
        self.ngrams: NgramIndex | None = None  # speculative drafts' lookup, made at its first drafted step
        self.tenant = tenant  # the fairness policy's client (handler.engine.fairness); None: anonymous
        self.weight = weight  # its tenant's weight
        self.charged_prompt = 0  # prompt positions charged to the tenant (a high-water mark: no recompute)
        self.charged_out = 0  # generated tokens charged to the tenant
        self.decoded_at = -1  # the last step that decoded it (contended steps rotate rows: least recent first)

    def remaining(self) -> int:
        return (len(self.ctx) - self.prefilled) + (self.params.max_tokens - len(self.out))


def checked_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_context: int) -> list[int]:
    """The prompt as ints, once params, ids and length are valid; InvalidRequestError (RequestTooLongError:
    prompt + max_tokens > max_context) otherwise."""
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise InvalidRequestError("prompt_ids is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
    total = len(prompt) + params.max_tokens
    if total > max_context:
        raise RequestTooLongError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds this engine's max_context of {max_context} tokens"
        )
    return prompt


def row_state(params: SamplingParams, prompt: list[int], device: torch.device, vocab_size: int, tokenizer) -> RowState:
    """The request's sampling state; InvalidRequestError for a seed torch refuses or a grammar that does
    not compile (made before any reference is taken, so that a refusal leaves nothing behind)."""
    try:
        return RowState(params, prompt, device, vocab_size, tokenizer)
    except (RuntimeError, OverflowError) as e:
        raise InvalidRequestError(f"invalid seed: {e}") from None
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
