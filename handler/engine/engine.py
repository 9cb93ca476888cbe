"""The replica engine: continuous batching over one base model with many LoRA adapters.

    engine = Engine(model_dir, device=None, dtype=torch.float32, kv_cache_bytes=..., max_batch=32,
                    rank_pools={8: 8, 16: 8, 32: 8, 64: 4}, max_prefill_tokens=2048)
    engine.mount_adapter("ad-...", weights, rank=16, alpha=32, target_modules=[...])
    engine.add_request("req-1", prompt_ids, SamplingParams(max_tokens=64), "ad-...", on_event)
    engine.start()            # or call engine.step() yourself

Scheduling, once per `step()`:
  1. Admission, first come first served, by what fits now: the head of the waiting queue joins the
     batch when the batch has a free row and the KV cache has the blocks of its prompt (not prompt
     + max_tokens: clients ask for large max_tokens and stop early). A request that does not fit
     waits (it is never failed for a full cache); nothing behind it overtakes it.
     KV blocks grow with the sequence: before the forward pass every decode row gets the block its
     next token needs, oldest request first. When the pool is empty the youngest admitted request
     is preempted by recompute: its blocks are freed, and it goes back to the head of the queue
     with prompt + generated tokens as the text to prefill again; the prefill's last logits give
     its next token, so greedy (and seeded) output equals an unpreempted run's. The oldest request
     can always take the whole cache (prompt + max_tokens <= max_context <= the cache), so
     something always advances. `kv_reserve="max_tokens"` keeps the old policy (reserve prompt
     + max_tokens at admission, never preempt) for comparison.
  2. One forward pass over the flat tokens of: prefill chunks of admitted requests, at most
     `max_prefill_tokens` in all (a long prompt is split across steps), and one decode token for
     every running request. The base products run once for all tokens; adapter deltas are the
     batched multi-LoRA products of `handler.model.lora`. A decode-only step on the C decode step with
     few rows also checks n-gram draft tokens of greedy requests (`handler.engine.speculate`): a request
     can take more than one token from a step, always the tokens plain decoding gives.
  3. Sampling per request, events, and finished or cancelled requests leave the batch and free
     their cache blocks at once.

Prefix cache (`prefix_cache=True`; `handler.model.prefix_cache`): at admission a request takes the
longest run of cached full blocks whose chain hash (base, adapter id, the request's `cache_salt`,
and every token up to the block's end) equals its own, and prefills from there; the full blocks it
writes are published when its prefill step ends, and outlive it in an LRU until their space is
needed. `cached_tokens` on its events says how many prompt tokens it did not compute. A request
whose next block is one an earlier admitted request is still computing (a burst on one system
prompt) is not admitted until that block is published, a step later, instead of computing it in the
same step (`prefix_cache_deferred`); the continuations that follow are attended in context-length
buckets, one call each, not one call per request.

Thread safety: `add_request`, `cancel`, `mount_adapter`, `unmount_adapter`, `stats` and the
lookups may be called from any thread while another thread runs `step()` (or after `start()`).
`on_event` callbacks run on the engine thread (a cancellation's final event runs on the thread
that completed it) and must not block.

Every event carries the running usage: `prompt_tokens` and `completion_tokens` (generated tokens,
the final EOS included). `finish_reason` is "stop" (EOS, stop token or stop string), "length"
(max_tokens), "cancelled" or "error". `text` is the new detokenized text of the step (possibly
empty while a multi-byte character or a possible stop-string prefix is held back); stop strings
are not part of the text.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from handler.model.kvcache import KVCache
from handler.model.prefix_cache import chain_hashes, chain_root
from handler.model.lora import InvalidAdapterWeightsError, ModelLoRA, SlotImage, read_peft_adapter
from handler.model.merge import MergedAdapter, merge_adapter
from handler.model import paged_attention
from handler.model.runner import Runner, StepBuffers, bucket_rows, build_step_batch, to_device
from handler.model.decode_step import MAX_ROWS as DECODE_STEP_ROWS
from handler.model.decode_step import DecodeStep
from handler.model.decode_step import why_not as decode_step_why_not
from handler.model.paged_attention import DecodeTables
from handler.engine.sampling import RowState, SamplingParams, sample
from handler.engine.config import DEFAULT_RANK_POOLS, EngineConfig
from handler.engine.speculate import SPECULATE_MAX_ROWS, SPECULATE_TOKENS, NgramIndex, accepted, can_draft

log = logging.getLogger(__name__)

__all__ = [
    "Engine",
    "EngineStats",
    "SamplingParams",
    "TokenEvent",
    "MergedAdapter",
    "EngineError",
    "NoFreeSlotError",
    "AdapterInUseError",
    "UnknownAdapterError",
    "InvalidAdapterError",
    "InvalidRequestError",
    "RequestTooLongError",
    "DEFAULT_RANK_POOLS",
    "EngineConfig",
]

C_PREFILL_TOKENS = 16  # steps with prefill of at most this many rows in all run on the C decode step (Engine._c_step_takes)


# ------------------------------------------------------------------------------------------ errors


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class NoFreeSlotError(EngineError):
    """The rank pool an adapter needs has no free slot (unmount an idle adapter first)."""


class AdapterInUseError(EngineError):
    """The adapter still has waiting or running requests."""


class UnknownAdapterError(EngineError, LookupError):
    """The adapter is not mounted on this engine."""


class InvalidAdapterError(EngineError, ValueError):
    """Adapter weights that do not fit the base model, the declared rank, or any rank pool."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine can never serve as given (bad ids, params, duplicate request id)."""


class RequestTooLongError(InvalidRequestError):
    """prompt + max_tokens exceeds the engine's max_context."""


# ------------------------------------------------------------------------------------------ events


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
    preemptions: int = 0  # requests preempted (by recompute) because the KV cache ran out
    attention: str = "gather"  # decode attention in use: "paged" (in place) or "gather"
    decode_step_c: int = 0  # decode steps run by the C decode step (`handler.model.decode_step`)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    prefix_cache_hits: int = 0  # of those, tokens found cached (not prefilled)
    prefix_cache_blocks: int = 0  # blocks holding a cached prefix block now (in use or not)
    prefix_cache_evictions: int = 0
    prefix_cache_deferred: int = 0  # admissions put off until a prefix block another request computes is cached
    speculative_drafted: int = 0  # draft tokens checked (handler.engine.speculate)
    speculative_accepted: int = 0  # of those, tokens taken


@dataclass
class _Mounted:
    slot: int
    rank: int
    pool_rank: int
    refs: int = 0


class _Request:
    __slots__ = (
        "id", "prompt", "params", "adapter_id", "slot", "on_event", "gen", "out", "blocks", "prefilled", "ctx",
        "cancelled", "text", "emitted", "prefix_off", "read_off", "arrival", "max_stop", "salt", "root", "hashes",
        "published", "cached", "admitted", "ngrams",
    )

    def __init__(self, rid, prompt, params, adapter_id, slot, on_event, gen, salt=None):
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

    def remaining(self) -> int:
        return (len(self.ctx) - self.prefilled) + (self.params.max_tokens - len(self.out))


# ------------------------------------------------------------------------------------------ engine


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, **overrides):
        """Load the model and preallocate the KV cache and the adapter slot stacks.

        kv_cache_bytes: the KV cache budget; None sizes it for max_batch requests of
        min(max_position_embeddings, 2048) tokens, capped at 2 GiB.
        merged_adapter: merged mode: fold this adapter into the weights; the engine then serves only
        that adapter id (no slots, no LoRA path).
        kv_reserve: "demand" (blocks as sequences grow, preemption when the cache runs out) or
        "max_tokens" (reserve prompt + max_tokens at admission; the pre-paging policy, kept for
        comparison).
        attention: decode attention, "paged" (in place on the cache, `handler.model.paged_attention`),
        "gather" (each bucket's blocks copied out, then SDPA) or "auto": a fixed rule of device and
        shapes (`paged_attention.prefers_paged`), paged only where the probe also finds it compiles
        and is correct; nothing is timed at construction. With batch_invariant, "auto" gathers.
        compile: torch.compile the layer pieces for decode-only steps, padded to batch buckets
        (`Runner.compile`; CUDA graphs on CUDA). Steps with prefill stay eager.
        batch_invariant: a row's arithmetic independent of the batch (docs/architecture.md, "Answers
        independent of load"): every product on at least `model.INVARIANT_MIN_ROWS` rows, the LoRA
        delta per token ("invariant" kernel), attention one call per sequence (decode gathered),
        prompts prefilled in chunks at fixed offsets (multiples of max_prefill_tokens). Excludes
        compile and attention "paged".
        prefix_cache: reuse the KV blocks of identical prompt prefixes (module docstring), keyed by
        `cache_key` (the base model's identity; default the model folder), the adapter id and the
        request's `cache_salt`.
        decode_step: steps of 1-64 decode rows through the C decode step (`handler.model.decode_step`): None
        (default) where it applies and attention is "auto" without compile or batch_invariant, True
        required (ValueError where it cannot apply), False never.
        speculate: draft tokens per request and step (`handler.engine.speculate`: n-gram drafts of greedy
        requests, checked in the same C decode step; 0: off). Drafts are added only to decode-only
        C steps whose rows, drafts included, stay within speculate_max_rows: a few rows cost about
        one, more do not.
        """
        cfg = (config or EngineConfig()).replace(**overrides) if overrides or config is None else config
        self.engine_config = cfg
        device, kv_cache_bytes, max_batch = cfg.device, cfg.kv_cache_bytes, cfg.max_batch
        rank_pools, max_prefill_tokens, max_context, block_size = (cfg.rank_pools, cfg.max_prefill_tokens,
                                                                   cfg.max_context, cfg.block_size)
        merged_adapter, kv_reserve, attention, compile = cfg.merged_adapter, cfg.kv_reserve, cfg.attention, cfg.compile
        batch_invariant, prefix_cache, cache_key, decode_step = (cfg.batch_invariant, cfg.prefix_cache,
                                                                 cfg.cache_key, cfg.decode_step)
        speculate, speculate_max_rows = cfg.speculate, cfg.speculate_max_rows
        if attention not in ("auto", "paged", "gather"):
            raise ValueError(f"attention must be 'auto', 'paged' or 'gather', not {attention!r}")
        if kv_reserve not in ("demand", "max_tokens"):
            raise ValueError(f"kv_reserve must be 'demand' or 'max_tokens', not {kv_reserve!r}")
        self.kv_reserve = kv_reserve
        if max_batch < 1 or max_prefill_tokens < 1 or block_size < 1:
            raise ValueError("max_batch, max_prefill_tokens and block_size must be positive")
        self.model_dir = Path(model_dir)
        dtype = cfg.resolved_dtype(torch.device(device) if device else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"))
        self.runner = Runner(self.model_dir, dtype=dtype, device=device)
        self.device, self.dtype = self.runner.device, dtype
        self.config = self.runner.config
        self.hf_config = self.runner.hf_config
        self.max_batch, self.max_prefill_tokens = int(max_batch), int(max_prefill_tokens)

        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self._backend = getattr(self.tokenizer, "backend_tokenizer", None)
        eos = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        gen_cfg = self.model_dir / "generation_config.json"
        if gen_cfg.exists():
            import json

            g = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos.update(g if isinstance(g, list) else ([g] if g is not None else []))
        self.eos_token_ids = frozenset(eos)

        self.merged_adapter_id: str | None = None
        self.lora: ModelLoRA | None = None
        if merged_adapter is not None:
            w = merged_adapter.weights
            if isinstance(w, (str, Path)):
                w = read_peft_adapter(w).weights
            try:
                merge_adapter(self.runner, w, merged_adapter.rank, merged_adapter.alpha,
                              merged_adapter.target_modules, merged_adapter.use_rslora)
            except InvalidAdapterWeightsError as e:
                raise InvalidAdapterError(str(e)) from None
            self.merged_adapter_id = merged_adapter.adapter_id
        else:
            pools = dict(DEFAULT_RANK_POOLS if rank_pools is None else rank_pools)
            if pools:
                self.lora = ModelLoRA(self.config, pools, dtype, self.device)
                self.runner.lora = self.lora

        if kv_cache_bytes is None:
            per_tok = KVCache.bytes_per_token(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, dtype)
            kv_cache_bytes = min(self.max_batch * min(self.config.max_position_embeddings, 2048) * per_tok, 2 << 30)
        self.kv = KVCache.from_budget(self.config, kv_cache_bytes, dtype, self.device, block_size,
                                      prefix_cache=prefix_cache)
        self.cache_key = cache_key or str(self.model_dir.resolve())
        self.max_context = min(self.config.max_position_embeddings, self.kv.capacity_tokens)
        if max_context is not None:
            self.max_context = min(self.max_context, int(max_context))
        self._buffers = StepBuffers(self.device)
        self.batch_invariant = bool(batch_invariant)
        if self.batch_invariant and (compile or attention == "paged"):
            raise ValueError("batch_invariant excludes compile and attention 'paged' (padded buckets, a kernel "
                             "whose split depends on the batch)")
        self.runner.batch_invariant = self.batch_invariant
        # batch-invariant prefill cuts prompts at multiples of max_prefill_tokens: a cache hit keeps
        # that cut (and so the bits of every later token) only when it ends on one
        per_chunk, rest = divmod(self.max_prefill_tokens, block_size)
        self._invariant_hit_unit = per_chunk if per_chunk and not rest else 1 << 62
        if self.lora is not None and self.batch_invariant:
            self.lora.kernel = "invariant"
        self.compiled = bool(compile)
        if self.compiled:
            self.runner.compile()
        # the probe runs here, before the engine serves: compiling in a thread beside serving (or
        # beside a test runner) imports modules concurrently with code iterating over them (a CI run
        # failed on "dictionary changed size during iteration"), and takes the GIL from serving
        self.decode_tables: DecodeTables | None = None
        c = self.config
        if attention == "paged" or (attention == "auto" and not self.batch_invariant
                                    and paged_attention.prefers_paged(self.device, c.num_kv_heads, c.head_dim)):
            self.decode_tables = self._probe_attention(required=attention == "paged")

        self.decode_step: DecodeStep | None = None
        if decode_step or (decode_step is None and attention == "auto" and not compile and not self.batch_invariant):
            why = decode_step_why_not(self.runner, self.kv, self.lora)
            if why and decode_step:
                raise ValueError(f"decode_step: {why}")
            if why is None:
                self.decode_step = DecodeStep(self.runner, self.kv, self.lora)
            log.info("decode steps of 1-%d rows: %s", DECODE_STEP_ROWS, why or "C decode step")

        if speculate < 0 or speculate_max_rows < 1:
            raise ValueError("speculate must be >= 0 and speculate_max_rows >= 1")
        self.speculate = int(speculate)
        self.speculate_max_rows = min(int(speculate_max_rows), DECODE_STEP_ROWS)
        self._drafted = 0
        self._draft_accepted = 0

        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._adapters: dict[str, _Mounted] = {}
        self._loading: dict[str, threading.Event] = {}
        self._copy_stream = None  # CUDA: the side stream adapter mounts copy on
        self._free: dict[int, list[int]] = {}
        if self.lora is not None:
            for i, (r, _) in enumerate(self.lora.pools):
                self._free[r] = list(reversed(self.lora.slots_of_pool(i)))
        self._requests: dict[str, _Request] = {}
        self._waiting: collections.deque[_Request] = collections.deque()
        self._prefilling: list[_Request] = []
        self._running: list[_Request] = []
        self._in_forward: set[str] = set()
        self._steps = 0
        self._prompt_total = 0
        self._gen_total = 0
        self._preemptions = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._deferred = 0  # admissions put off a step for a prefix block another request was computing
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------------------------- adapters

    def pool_rank_for(self, rank: int) -> int:
        """The rank of the pool an adapter of this rank goes to; InvalidAdapterError if none fits."""
        if self.lora is None:
            raise InvalidAdapterError("this engine has no adapter slots (merged mode or rank_pools={})")
        try:
            return self.lora.pool_rank_for(int(rank))
        except ValueError as e:
            raise InvalidAdapterError(str(e)) from None

    def free_slots(self, rank: int) -> int:
        """Free slots in the pool that an adapter of this rank would use (0 when none fits)."""
        try:
            pr = self.pool_rank_for(rank)
        except InvalidAdapterError:
            return 0
        with self._lock:
            return len(self._free[pr])

    def mounted_adapters(self) -> list[str]:
        with self._lock:
            if self.merged_adapter_id is not None:
                return [self.merged_adapter_id]
            return sorted(self._adapters)

    def is_mounted(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._adapters or adapter_id == self.merged_adapter_id

    def adapter_refs(self, adapter_id: str) -> int:
        """Waiting + running requests of a mounted adapter (0 when not mounted)."""
        with self._lock:
            m = self._adapters.get(adapter_id)
            return m.refs if m else 0

    def prepare_adapter(self, weights: Mapping[str, torch.Tensor], *, rank: int, alpha: float,
                        target_modules: Iterable[str] | None = None, use_rslora: bool = False,
                        pin_memory: bool = False) -> SlotImage:
        """Validate an adapter and lay it out for a slot of its rank pool, in host memory (the RAM
        tier keeps this form, so `mount_adapter(id, image, ...)` is one copy per stack)."""
        self.pool_rank_for(rank)
        try:
            return self.lora.build_image(weights, int(rank), float(alpha), target_modules, use_rslora,
                                         pin_memory=pin_memory)
        except InvalidAdapterWeightsError as e:
            raise InvalidAdapterError(str(e)) from None

    def mount_adapter(
        self,
        adapter_id: str,
        weights: Mapping[str, torch.Tensor] | SlotImage | str | Path,
        *,
        rank: int,
        alpha: float,
        target_modules: Iterable[str] | None = None,
        use_rslora: bool = False,
    ) -> int:
        """Copy an adapter (PEFT tensor names, or a PEFT folder path) into a free slot of its rank pool.

        Returns the slot. Mounting an id that is already mounted is a no-op. Raises NoFreeSlotError
        when the pool is full and InvalidAdapterError when the tensors do not fit. Safe to call while
        the engine runs: the weights are copied into a slot no running request reads.
        """
        if self.merged_adapter_id is not None:
            if adapter_id == self.merged_adapter_id:
                return 0
            raise NoFreeSlotError("merged-mode engine: no adapter slots")
        pool_rank = self.pool_rank_for(rank)
        if isinstance(weights, (str, Path)):
            weights = read_peft_adapter(weights).weights
        while True:
            with self._lock:
                if adapter_id in self._adapters:
                    return self._adapters[adapter_id].slot
                pending = self._loading.get(adapter_id)
                if pending is None:
                    if not self._free[pool_rank]:
                        raise NoFreeSlotError(
                            f"no free slot in the rank-{pool_rank} pool for {adapter_id} (rank {rank})"
                        )
                    slot = self._free[pool_rank].pop()
                    done = self._loading[adapter_id] = threading.Event()
                    break
            pending.wait()  # another thread is mounting the same id
        try:
            self._write_slot(slot, weights, int(rank), float(alpha), target_modules, use_rslora)
        except BaseException as e:
            with self._lock:
                self.lora.reset_adapter(slot)
                self._free[pool_rank].append(slot)
                del self._loading[adapter_id]
                done.set()
            if isinstance(e, InvalidAdapterWeightsError):
                raise InvalidAdapterError(f"{adapter_id}: {e}") from None
            raise
        with self._lock:
            self._adapters[adapter_id] = _Mounted(slot, int(rank), pool_rank)
            del self._loading[adapter_id]
            done.set()
        log.info("mounted adapter %s (rank %d) in slot %d of the rank-%d pool", adapter_id, rank, slot, pool_rank)
        return slot

    def _write_slot(self, slot: int, weights, rank: int, alpha: float, target_modules, use_rslora: bool) -> None:
        """Copy into a slot no running request reads. On CUDA the copies run on a side stream that
        first waits (on the GPU) for the work already queued on the compute stream, which may still
        read the slot's previous adapter; this thread then waits for the copies' event only. The
        compute stream is never synchronized, so decode steps go on meanwhile."""
        def write():
            if isinstance(weights, SlotImage):
                self.lora.write_image(slot, weights)
            else:
                self.lora.set_adapter(slot, weights, rank, alpha, target_modules, use_rslora)

        if self.device.type != "cuda":
            write()
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            write()
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        done.synchronize()

    def unmount_adapter(self, adapter_id: str) -> None:
        """Free the adapter's slot. AdapterInUseError while requests use it; UnknownAdapterError if absent."""
        with self._lock:
            m = self._adapters.get(adapter_id)
            if m is None:
                raise UnknownAdapterError(f"adapter {adapter_id} is not mounted")
            if m.refs > 0:
                raise AdapterInUseError(f"adapter {adapter_id} has {m.refs} waiting or running requests")
            del self._adapters[adapter_id]
            self.lora.reset_adapter(m.slot)
            self._free[m.pool_rank].append(m.slot)
            self._cond.notify_all()
        log.info("unmounted adapter %s from slot %d", adapter_id, m.slot)

    # ------------------------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        adapter_id: str | None,
        on_event: Callable[[TokenEvent], None] | None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; it joins the batch at the next step where its cache fits.

        cache_salt: the prefix cache's partition (the tenant): a request only reuses blocks computed
        for the same salt, adapter and base.

        Raises RequestTooLongError (prompt + max_tokens > max_context), InvalidRequestError (bad
        params or ids, duplicate live request id) or UnknownAdapterError (adapter not mounted).
        """
        try:
            params.validate(self.config.vocab_size)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidRequestError("prompt_ids is empty")
        if min(prompt) < 0 or max(prompt) >= self.config.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        total = len(prompt) + params.max_tokens
        if total > self.max_context:
            raise RequestTooLongError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds this engine's max_context of {self.max_context} tokens"
            )
        try:  # before any reference is taken: a seed torch refuses or a grammar that does not
            # compile must leave nothing behind
            state = RowState(params, prompt, self.device, self.config.vocab_size, self.tokenizer)
        except (RuntimeError, OverflowError) as e:
            raise InvalidRequestError(f"invalid seed: {e}") from None
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        with self._lock:
            if request_id in self._requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in flight")
            slot = 0
            if self.merged_adapter_id is not None:
                if adapter_id != self.merged_adapter_id:
                    raise UnknownAdapterError(
                        f"this merged-mode engine serves only adapter {self.merged_adapter_id}, not {adapter_id}"
                    )
            elif adapter_id is not None:
                m = self._adapters.get(adapter_id)
                if m is None:
                    raise UnknownAdapterError(f"adapter {adapter_id} is not mounted")
                m.refs += 1
                slot = m.slot
            req = _Request(request_id, prompt, params, adapter_id, slot, on_event, state, cache_salt)
            self._requests[request_id] = req
            self._waiting.append(req)
            self._cond.notify_all()

    def cancel(self, request_id: str) -> bool:
        """Stop a request. A waiting request leaves the queue and a running one frees its row and
        cache now (or right after the forward pass in progress, if it is in it). Its final event has
        finish_reason "cancelled". Returns False for an unknown or already finished request."""
        events: list[tuple[_Request, TokenEvent]] = []
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.cancelled:
                return False
            req.cancelled = True
            if request_id in self._in_forward:
                return True  # the step finishes it right after the forward pass
            if req in self._waiting:
                self._waiting.remove(req)
            self._finish(req, None, "cancelled", events)
            self._cond.notify_all()
        self._dispatch(events)
        return True

    def stats(self) -> EngineStats:
        with self._lock:
            live = list(self._requests.values())
            return EngineStats(
                running=len(self._prefilling) + len(self._running),
                waiting=len(self._waiting),
                tokens_in_flight=sum(r.remaining() for r in live),
                kv_cache_usage=self.kv.usage(),
                mounted_adapters=len(self._adapters) + (self.merged_adapter_id is not None),
                free_slots={r: len(s) for r, s in self._free.items()},
                steps=self._steps,
                prompt_tokens_total=self._prompt_total,
                generated_tokens_total=self._gen_total,
                kv_cache_capacity_tokens=self.kv.capacity_tokens,
                preemptions=self._preemptions,
                attention=self.attention,
                decode_step_c=self.decode_step.steps if self.decode_step is not None else 0,
                prefix_cache_queries=self._prefix_queries,
                prefix_cache_hits=self._prefix_hits,
                prefix_cache_blocks=self.kv.pool.cached,
                prefix_cache_evictions=self.kv.pool.evictions,
                prefix_cache_deferred=self._deferred,
                speculative_drafted=self._drafted,
                speculative_accepted=self._draft_accepted,
            )

    @property
    def attention(self) -> str:
        """The decode attention the next step uses: "paged" or "gather"."""
        return "gather" if self.decode_tables is None else "paged"

    def set_attention(self, attention: str) -> None:
        """Use this decode attention ("paged" or "gather") from the next step on (benchmarks, tests);
        every decode step then takes the torch path (the C decode step has its own attention)."""
        if attention not in ("paged", "gather"):
            raise ValueError(f"attention must be 'paged' or 'gather', not {attention!r}")
        tables = self._probe_attention(required=True) if attention == "paged" else None
        with self._step_lock:
            self.decode_tables = tables
            self.decode_step = None

    def measure_attention(self, timed: bool = True) -> paged_attention.Probe:
        """The paged decode kernel compiled and checked against the gathered path for this engine's
        shapes and, with `timed` (benchmarks only), both paths timed (`paged_attention.measure`;
        cached per process)."""
        c = self.config
        fn = paged_attention.measure if timed else paged_attention.probe
        try:
            return fn(self.device, self.dtype, c.num_heads, c.num_kv_heads, c.head_dim,
                      self.kv.block_size, windows=self.runner.windows, rows=min(self.max_batch, 32))
        except Exception as e:  # noqa: BLE001 - the probe's own failure: stay on the gathered path
            return paged_attention.Probe(False, f"probe failed: {type(e).__name__}: {e}")

    def _probe_attention(self, required: bool = False) -> DecodeTables | None:
        """The paged kernel's tables once the probe found it correct: with `required` ("paged") a
        failure is an error, else ("auto", where the rule chose it) the gathered path. No timing."""
        p = self.measure_attention(timed=False)
        if required and not p.ok:
            raise ValueError(f"attention 'paged': {p.reason}")
        if not p.ok:
            log.info("decode attention: gathered (paged %s)", p.reason)
            return None
        log.info("decode attention: paged (%s)", p.reason)
        return DecodeTables(self.kv, self.max_batch)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._prefilling or self._running)

    # ------------------------------------------------------------------------------- stepping

    def step(self) -> bool:
        """Admit, run one forward pass (bounded prefill + one decode token per running request),
        sample and emit events. Returns False when there was nothing to run."""
        with self._step_lock:
            events: list[tuple[_Request, TokenEvent]] = []
            with self._lock:
                self._grow_decode_blocks()  # running rows first, then newcomers with what is left
                self._admit()
                prefill: list[tuple[_Request, int]] = []
                budget = self.max_prefill_tokens
                for req in self._prefilling:
                    if budget <= 0:
                        break
                    n = min(len(req.ctx) - req.prefilled, budget)
                    if self.batch_invariant:
                        # chunks at fixed offsets (multiples of max_prefill_tokens), whole or not at
                        # all: a prompt is cut the same way alone or beside others
                        n = min(len(req.ctx) - req.prefilled,
                                self.max_prefill_tokens - req.prefilled % self.max_prefill_tokens)
                        if n > budget:
                            break
                    prefill.append((req, n))

                    budget -= n
                # decode rows ordered by adapter slot: rows of one adapter sit together and a run of
                # consecutive slots is read from the stacks as a view instead of a gathered copy
                decode = sorted(self._running, key=lambda r: r.slot)
                if not prefill and not decode:
                    return False
                drafts = self._drafts(decode) if not prefill else {}
                seqs = [(r.ctx[r.prefilled : r.prefilled + n], r.prefilled, r.blocks) for r, n in prefill]
                slots = [r.slot for r, n in prefill for _ in range(n)]
                seq_reqs = [r for r, _ in prefill]  # the request of each entry of seqs
                for r in decode:  # a drafted request: its last token and each draft token, a row each
                    p = len(r.prompt) + len(r.out) - 1
                    toks = [r.out[-1], *drafts.get(r.id, ())]
                    seqs += [([t], p + i, r.blocks) for i, t in enumerate(toks)]
                    slots += [r.slot] * len(toks)
                    seq_reqs += [r] * len(toks)
                batch_reqs = [r for r, _ in prefill] + decode
                self._in_forward = {r.id for r in batch_reqs}
            try:
                pad_to = bucket_rows(len(seqs)) if self.compiled and not prefill else None
                if pad_to is not None:
                    slots = slots + [0] * (pad_to - len(slots))

                def forward():
                    if self._c_step_takes(seqs, len(prefill)):
                        # every token a row (a prefill chunk's rows at consecutive positions attend to
                        # the K/V the rows before them write in the step); a sequence's logits are its
                        # last row's
                        rows = [(t, start + i, table) for ids, start, table in seqs for i, t in enumerate(ids)]
                        logits = self.decode_step(rows, slots)
                        if prefill:
                            ends = list(itertools.accumulate(len(ids) for ids, _, _ in seqs))
                            logits = logits[[e - 1 for e in ends]]
                        return logits
                    batch = build_step_batch(seqs, self.kv.block_size, self.device, self.runner.windows,
                                             decode_from=len(prefill), pad_block=self.kv.null_block,
                                             decode_tables=self.decode_tables, buffers=self._buffers,
                                             pad_to=pad_to, scratch_slot=self.kv.scratch_block * self.kv.block_size,
                                             per_row=self.batch_invariant)
                    if self.lora is not None:
                        batch.lora = self.lora.prepare(slots, prefill=bool(prefill))
                    return self.runner.forward(batch, self.kv)

                try:
                    logits = forward()
                except Exception as e:  # noqa: BLE001 - re-raised unless the paged kernel's compile failed
                    if self.decode_tables is None or not paged_attention.is_compile_error(e):
                        raise
                    if self.device.type == "cuda":  # the step buffers' pending copies, before refilling
                        torch.cuda.synchronize(self.device)
                    # a recompile of the paged kernel failed (a shape the probe did not see): the
                    # gathered path from now on; the step is rerun (rewriting the same K/V is harmless)
                    log.exception("paged decode attention failed; switching to the gathered path")
                    self.decode_tables = None
                    logits = forward()
                # rows that produce a token: decode rows (drafts included), and prefill rows whose
                # prompt is complete
                pick = [i for i, (r, n) in enumerate(prefill) if r.prefilled + n == len(r.ctx)]
                pick += range(len(prefill), len(seqs))
                sreqs = [seq_reqs[i] for i in pick]
                tokens = []
                if pick:
                    if pick == list(range(pick[0], pick[0] + len(pick))):
                        picked = logits[pick[0] : pick[0] + len(pick)]
                    else:  # an index built on the host, moved without a host sync
                        picked = logits.index_select(0, to_device(torch.tensor(pick), self.device))
                    tokens = sample(picked, [r.params for r in sreqs], [r.gen for r in sreqs])
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                log.exception("engine step failed; failing %d requests", len(batch_reqs))
                with self._lock:
                    self._in_forward = set()
                    for r in batch_reqs:
                        if r.id in self._requests:
                            self._finish(r, None, "cancelled" if r.cancelled else "error", events,
                                         error=None if r.cancelled else f"{type(e).__name__}: {e}")
                    self._cond.notify_all()
                self._dispatch(events)
                return True
            with self._lock:
                self._in_forward = set()
                self._steps += 1
                for r, n in prefill:
                    self._prompt_total += max(0, min(n, len(r.prompt) - r.prefilled))  # recompute not counted
                    r.prefilled += n
                    self._publish(r)
                    if r.cancelled:
                        self._finish(r, None, "cancelled", events)
                    elif r.prefilled == len(r.ctx):
                        self._prefilling.remove(r)
                        self._running.append(r)
                for r in decode:
                    if r.cancelled:
                        self._finish(r, None, "cancelled", events)
                taken: dict[str, list[int]] = {}
                for r, tok in zip(sreqs, tokens):
                    taken.setdefault(r.id, []).append(tok)
                for r, toks in ((r, taken[r.id]) for r in dict.fromkeys(sreqs)):
                    if r.id in drafts:
                        toks = accepted(drafts[r.id], toks)
                        self._drafted += len(drafts[r.id])
                        self._draft_accepted += len(toks) - 1
                    for tok in toks:  # in order, until one ends the request
                        if r.id not in self._requests or r.cancelled:
                            break
                        self._on_token(r, tok, events)
                self._cond.notify_all()
        self._dispatch(events)
        return True

    def _c_step_takes(self, seqs: list, prefilling: int) -> bool:
        """Does the C decode step run this step? Decode rows (and drafts) up to its row limit; with
        prefill chunks, steps of at most C_PREFILL_TOKENS rows in all: a continuation after a
        prefix-cache hit (less than a block) beside a few decode rows costs one C step instead of a
        torch forward (~9,000 ops). Bigger prefill steps keep the torch path, which computes only
        each sequence's last logits (the C step computes every row's: 32 continuations of a burst
        would pay the LM head 32 times over)."""
        rows = sum(len(ids) for ids, _, _ in seqs)
        return self.decode_step is not None and rows <= (C_PREFILL_TOKENS if prefilling else DECODE_STEP_ROWS)

    def _drafts(self, decode: list[_Request]) -> dict[str, list[int]]:
        """Draft tokens for this decode-only step (`handler.engine.speculate`), request id -> tokens: while
        the step's rows stay within speculate_max_rows, for requests whose next token is the argmax
        alone, no further than their max_tokens and max_context allow, on blocks they hold or the
        pool has free (a draft never preempts anyone). Only on the C decode step, which writes every
        row's K/V before any row attends (none once set_attention has turned it off)."""
        if not self.speculate or self.decode_step is None or len(decode) >= self.speculate_max_rows:
            return {}
        out: dict[str, list[int]] = {}
        spare = self.speculate_max_rows - len(decode)
        for r in decode:
            if spare <= 0:
                break
            if not can_draft(r.params, r.gen):
                continue
            length = len(r.prompt) + len(r.out)  # positions once this step's first token is written
            k = min(self.speculate, spare, r.params.max_tokens - len(r.out) - 1, self.max_context - length)
            if k <= 0:
                continue
            if r.ngrams is None:
                r.ngrams = NgramIndex()
            r.ngrams.sync(r.prompt, r.out)
            d = r.ngrams.propose(k)
            if not d:
                continue
            if not self.kv.grow(r.blocks, length + len(d)):  # what the blocks it holds cover, then
                d = d[: len(r.blocks) * self.kv.block_size - length]
            if d:
                out[r.id] = d
                spare -= len(d)
        return out

    def _admit(self) -> None:
        bs = self.kv.block_size
        pending: set[bytes] | None = None  # blocks being prefilled now, not yet published
        while self._waiting and len(self._prefilling) + len(self._running) < self.max_batch:
            req = self._waiting[0]
            need = len(req.ctx) + (req.params.max_tokens - len(req.out) if self.kv_reserve == "max_tokens" else 0)
            hit: list[int] = []
            if self.kv.prefix_cache:
                if req.hashes is None:
                    req.root = chain_root(self.cache_key, req.adapter_id, req.salt)
                    req.hashes = chain_hashes(req.ctx, bs, req.root)
                # full blocks only, and never the whole context: its last token is prefilled here,
                # for the logits of the next token and so that no shared block is ever written
                # (batch-invariant: whole prefill chunks only, so the rest is cut as without a hit)
                usable = req.hashes[: (len(req.ctx) - 1) // bs]
                hit = self.kv.match(usable, self._invariant_hit_unit if self.batch_invariant else 1)
                if pending is None:
                    pending = {h for r in self._prefilling if r.hashes for h in r.hashes[r.published :]}
                if len(hit) < len(usable) and usable[len(hit)] in pending:
                    # its next block is being computed by a request admitted before it (a burst on one
                    # system prompt): wait for that block's publication, a step or so, rather than
                    # compute it again; first come, first served, so the queue behind it waits too
                    self.kv.free(hit)
                    self._deferred += 1
                    break
            head = self._match_head(req, len(hit))  # referenced, so the allocation cannot evict it
            blocks = self.kv.allocate(need, have=len(hit))
            if blocks is None:
                self.kv.free(hit + ([head[0]] if head else []))
                break  # the cache is full: wait for a request to finish (first come, first served)
            self._waiting.popleft()
            req.blocks = hit + blocks
            req.published, req.prefilled = len(hit), len(hit) * bs
            if head:  # the first tokens of its next block, from a cached sibling: copied, then let go
                src, n = head
                self.kv.copy_head(src, blocks[0], n)
                self.kv.free([src])
                req.prefilled += n
            if not req.admitted:  # a recompute after preemption is not a new lookup
                req.admitted = True
                req.cached = req.prefilled
                if self.kv.prefix_cache:
                    self._prefix_queries += len(req.prompt)
                    self._prefix_hits += req.cached
            self._prefilling.append(req)
            if pending is not None and req.hashes:
                pending.update(req.hashes[req.published :])

    def _match_head(self, req: _Request, hit: int) -> tuple[int, int] | None:
        """(cached block, n) whose first n tokens are the next n of the request's context after its
        `hit` full cached blocks (a template's system prompt ends mid-block and the user's text
        follows: the sibling blocks of earlier requests share its head), or None where none does or
        the prefix cache is off (no hashes). Never the whole rest of the context (its last token is
        prefilled here); never in batch-invariant mode (a hit covers whole prefill chunks there)."""
        if self.batch_invariant or req.hashes is None:
            return None
        bs, start = self.kv.block_size, hit * self.kv.block_size
        parent = req.hashes[hit - 1] if hit else req.root
        return self.kv.match_head(parent, req.ctx[start : min(start + bs, len(req.ctx) - 1)])

    def _publish(self, r: _Request) -> None:
        """Name the full blocks this request's prefill has now written (prefix cache), each with its
        parent's hash and its tokens so that a later request can also share its head."""
        if r.hashes is None or r.blocks is None:
            return
        bs = self.kv.block_size
        upto = min(r.prefilled // bs, len(r.hashes))
        for i in range(r.published, upto):
            parent = r.hashes[i - 1] if i else r.root
            self.kv.publish(r.blocks[i], r.hashes[i], parent, r.ctx[i * bs : (i + 1) * bs])
        r.published = max(r.published, upto)

    def _grow_decode_blocks(self) -> None:
        """Give every decode row the block its next token needs, oldest first, preempting the
        youngest admitted requests while the pool is empty."""
        for r in sorted(self._running, key=lambda q: q.arrival):
            if r not in self._running:
                continue  # preempted below for an older row
            need = len(r.prompt) + len(r.out)  # positions 0 .. len - 1 are written once this step ends
            while not self.kv.grow(r.blocks, need):
                victim = max(self._prefilling + self._running, key=lambda q: q.arrival)
                self._preempt(victim)
                if victim is r:
                    break

    def _preempt(self, r: _Request) -> None:
        """Free a request's cache and put it back at the head of the queue, to be recomputed."""
        if r in self._prefilling:
            self._prefilling.remove(r)
        else:
            self._running.remove(r)
        self.kv.free(r.blocks)
        r.blocks = None
        r.ctx = r.prompt + r.out
        r.prefilled = 0
        r.hashes = None  # ctx changed: hashed again at readmission
        self._waiting.appendleft(r)
        self._preemptions += 1
        log.info("preempted request %s (%d tokens to recompute): KV cache full", r.id, len(r.ctx))

    def _on_token(self, r: _Request, tok: int, events: list) -> None:
        r.out.append(tok)
        self._gen_total += 1
        p = r.params
        if r.gen.matcher is not None and (gerr := r.gen.grammar_error()) is not None:
            # a grammar that hit a parser limit: an error, never a "stop" with a broken document
            self._finish(r, None, "error", events, error=f"grammar: {gerr}")
            return
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            self._finish(r, tok, "stop", events)
            return
        r.text += self._detok(r)
        if r.max_stop:
            start = max(0, r.emitted - r.max_stop)
            hits = [i for i in (r.text.find(s, start) for s in p.stop) if i >= 0]
            if hits:
                r.text = r.text[: min(hits)]
                self._finish(r, tok, "stop", events)
                return
        if len(r.out) >= p.max_tokens:
            self._finish(r, tok, "length", events)
            return
        upto = len(r.text) - (r.max_stop - 1 if r.max_stop else 0)
        delta = ""
        if upto > r.emitted:
            delta = r.text[r.emitted : upto]
            r.emitted = upto
        events.append((r, TokenEvent(r.id, tok, delta, False, None, len(r.prompt), len(r.out), logprobs=r.gen.logprobs,
                                     cached_tokens=r.cached)))

    def _detok(self, r: _Request) -> str:
        """Incremental detokenization: new text once it no longer ends in a partial character."""
        ids = r.out
        dec = self._backend.decode if self._backend is not None else (
            lambda x, skip_special_tokens: self.tokenizer.decode(x, skip_special_tokens=skip_special_tokens))
        prefix = dec(ids[r.prefix_off : r.read_off], skip_special_tokens=True) if r.read_off > r.prefix_off else ""
        full = dec(ids[r.prefix_off :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            r.prefix_off, r.read_off = r.read_off, len(ids)
            return full[len(prefix) :]
        return ""

    def _finish(self, r: _Request, tok: int | None, reason: str, events: list, error: str | None = None) -> None:
        """Remove a request everywhere, free its cache and adapter reference, queue its final event."""
        self._requests.pop(r.id, None)
        if r in self._prefilling:
            self._prefilling.remove(r)
        elif r in self._running:
            self._running.remove(r)
        if r.blocks is not None:
            self.kv.free(r.blocks)
            r.blocks = None
        if r.adapter_id is not None and r.adapter_id in self._adapters:
            self._adapters[r.adapter_id].refs -= 1
        delta = r.text[r.emitted :] if reason in ("stop", "length") else ""
        r.emitted = len(r.text)
        events.append((r, TokenEvent(r.id, tok, delta, True, reason, len(r.prompt), len(r.out), error,
                                     r.gen.logprobs if tok is not None else None, r.cached)))

    @staticmethod
    def _dispatch(events: list[tuple[_Request, TokenEvent]]) -> None:
        for r, ev in events:
            if r.on_event is None:
                continue
            try:
                r.on_event(ev)
            except Exception:  # noqa: BLE001 - a broken callback must not stop the engine
                log.exception("on_event callback failed for request %s", ev.request_id)

    # ------------------------------------------------------------------------------- thread

    def start(self) -> None:
        """Run `step()` on a background daemon thread until `stop()`."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping.clear()
            self._thread = threading.Thread(target=self._loop, name="lorafarm-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the background thread (after its current step). Queued requests stay queued."""
        self._stopping.set()
        with self._lock:
            self._cond.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        with self._lock:
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                worked = self.step()
            except Exception:  # noqa: BLE001
                log.exception("engine loop step failed")
                worked = False
            if not worked:
                with self._lock:
                    if not self._stopping.is_set():
                        self._cond.wait(timeout=0.05)
