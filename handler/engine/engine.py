"""The replica engine: continuous batching over one base model with many LoRA adapters.

    engine = Engine(model_dir, EngineConfig(max_batch=32, ...))   # or Engine(model_dir, max_batch=32, ...)
    engine.mount_adapter("ad-...", weights, rank=16, alpha=32, target_modules=[...])
    engine.add_request("req-1", prompt_ids, SamplingParams(max_tokens=64), "ad-...", on_event)
    engine.start()            # or call engine.step() yourself

`Engine` is a façade: it builds the model's pieces from an `EngineConfig` (runner, tokenizer, KV
cache, LoRA slot stacks or a merged adapter) and the engine's own, then forwards to them:

- `slot_table.SlotTable`: which adapter is mounted in which slot, and its references.
- `scheduler.Scheduler`: the queues, admission, KV growth and preemption, the plan of one step.
- `executor.StepExecutor`: how a step runs (C decode step or torch forward, paged or gathered
  attention, compile padding, batch-invariant rows, speculative drafts), chosen at start-up.
- `output.OutputProcessor`: tokens to events (detokenisation, stops, finishing requests).

One `step()`: the scheduler plans (decode rows grow their KV blocks, preempting by recompute when
the pool is empty; waiting requests are admitted by what fits, the least served tenant's first, a
tenant below its share of rows taking one from a tenant over its share (`fairness`; one tenant
alone: first come first served; `scheduling="fifo"`: first come first served over all); prompt
chunks within `max_prefill_tokens`), the executor runs one forward pass over prefill chunks and one
decode token per running request (plus n-gram drafts of greedy requests on small C decode steps:
a request can take more than one token from a step, always the tokens plain decoding gives) and
samples, and the output processor emits events; finished or cancelled requests leave the batch
and free their cache blocks at once.

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
lookups may be called from any thread while another thread runs `step()` (or after `start()`): the
pieces share one RLock (and its Condition); `_step_lock` is held around a step. `on_event`
callbacks run on the engine thread (a cancellation's final event runs on the thread that completed
it) and must not block.

Events: `finish_reason` is "stop" (EOS, stop token or stop string), "length" (max_tokens),
"cancelled" or "error"; `handler.engine.output` says what their text and usage hold.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from handler.engine.config import DEFAULT_RANK_POOLS, EngineConfig
from handler.engine.errors import (
    AdapterInUseError,
    EngineError,
    InvalidAdapterError,
    InvalidRequestError,
    NoFreeSlotError,
    RequestTooLongError,
    UnknownAdapterError,
)
from handler.engine.executor import C_PREFILL_TOKENS, StepExecutor
from handler.engine.fairness import TenantReport
from handler.engine.output import OutputProcessor
from handler.engine.request import EngineStats, Request, TokenEvent, checked_prompt, row_state
from handler.engine.sampling import SamplingParams
from handler.engine.scheduler import Scheduler
from handler.engine.slot_table import SlotTable
from handler.model import paged_attention
from handler.model.decode_step import DecodeStep
from handler.model.kvcache import KVCache
from handler.model.lora import InvalidAdapterWeightsError, ModelLoRA, SlotImage, read_peft_adapter
from handler.model.merge import MergedAdapter, merge_adapter
from handler.model.paged_attention import DecodeTables
from handler.model.runner import Runner
from handler.model.tokenizer import load_tokenizer  # transformers' tokenizer only where the folder's needs it

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
    "C_PREFILL_TOKENS",
    "TenantReport",
]

log = logging.getLogger(__name__)


class Engine:
    """The façade over the engine's pieces (module docstring); its methods are the engine's contract."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, **overrides):
        """Load the model and preallocate the KV cache and the adapter slot stacks. `config` (with
        `overrides`, EngineConfig field names, on top) says how; `EngineConfig` documents each field."""
        cfg = (config or EngineConfig()).replace(**overrides) if overrides or config is None else config
        self.engine_config, self.model_dir = cfg, Path(model_dir)
        dtype = cfg.resolved_dtype(torch.device(cfg.device) if cfg.device else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"))
        self.runner = Runner(self.model_dir, dtype=dtype, device=cfg.device)
        self.device, self.dtype = self.runner.device, dtype
        self.config, self.hf_config = self.runner.config, self.runner.hf_config  # the model's
        self.max_batch, self.max_prefill_tokens = int(cfg.max_batch), int(cfg.max_prefill_tokens)
        self.kv_reserve, self.batch_invariant = cfg.kv_reserve, bool(cfg.batch_invariant)
        self.tokenizer, self.eos_token_ids = _tokenizer(self.model_dir, self.config)
        self.lora, self.merged_adapter_id = _lora_or_merged(self.runner, cfg, dtype)
        self.kv = _kv_cache(cfg, self.config, dtype, self.device, self.max_batch)
        self.cache_key = cfg.cache_key or str(self.model_dir.resolve())
        self.max_context = min(self.config.max_position_embeddings, self.kv.capacity_tokens)
        if cfg.max_context is not None:
            self.max_context = min(self.max_context, int(cfg.max_context))
        self._lock = threading.RLock()  # shared by every piece
        self._cond = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # held around a step
        self.executor = StepExecutor(
            self.runner, self.kv, self.lora, self._lock, max_batch=self.max_batch, max_context=self.max_context,
            attention=cfg.attention, compile=cfg.compile, batch_invariant=self.batch_invariant,
            decode_step=cfg.decode_step, speculate=cfg.speculate, speculate_max_rows=cfg.speculate_max_rows)
        self.slots = SlotTable(self.lora, self.merged_adapter_id, self.device, self._lock, self._cond)
        self.scheduler = Scheduler(self.kv, max_batch=self.max_batch, max_prefill_tokens=self.max_prefill_tokens,
                                   kv_reserve=cfg.kv_reserve, batch_invariant=self.batch_invariant,
                                   cache_key=self.cache_key, scheduling=cfg.scheduling,
                                   w_prefill=cfg.fair_prefill_weight, w_decode=cfg.fair_decode_weight,
                                   contended_rows=cfg.resolved_contended_rows(self.device),
                                   small_step_rows=C_PREFILL_TOKENS if self.executor.decode_step else 0)
        self.output = OutputProcessor(self.tokenizer, self.eos_token_ids, self.scheduler, self.slots,
                                      self._lock, self._cond)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------------------------- adapters

    def pool_rank_for(self, rank: int) -> int:
        """The rank of the pool an adapter of this rank goes to; InvalidAdapterError if none fits."""
        return self.slots.pool_rank_for(rank)

    def free_slots(self, rank: int) -> int:
        """Free slots in the pool that an adapter of this rank would use (0 when none fits)."""
        return self.slots.free_slots(rank)

    def mounted_adapters(self) -> list[str]:
        return self.slots.mounted()

    def is_mounted(self, adapter_id: str) -> bool:
        return self.slots.is_mounted(adapter_id)

    def adapter_refs(self, adapter_id: str) -> int:
        """Waiting + running requests of a mounted adapter (0 when not mounted)."""
        return self.slots.refs(adapter_id)

    def prepare_adapter(self, weights: Mapping[str, torch.Tensor], *, rank: int, alpha: float,
                        target_modules: Iterable[str] | None = None, use_rslora: bool = False,
                        pin_memory: bool = False) -> SlotImage:
        """Validate an adapter and lay it out for a slot of its rank pool, in host memory (the RAM
        tier keeps this form, so `mount_adapter(id, image, ...)` is one copy per stack)."""
        return self.slots.prepare(weights, rank=rank, alpha=alpha, target_modules=target_modules,
                                  use_rslora=use_rslora, pin_memory=pin_memory)

    def mount_adapter(self, adapter_id: str, weights: Mapping[str, torch.Tensor] | SlotImage | str | Path, *,
                      rank: int, alpha: float, target_modules: Iterable[str] | None = None,
                      use_rslora: bool = False) -> int:
        """Copy an adapter (PEFT tensor names, or a PEFT folder path) into a free slot of its rank pool.

        Returns the slot. Mounting an id that is already mounted is a no-op. Raises NoFreeSlotError
        when the pool is full and InvalidAdapterError when the tensors do not fit. Safe to call while
        the engine runs: the weights are copied into a slot no running request reads.
        """
        return self.slots.mount(adapter_id, weights, rank=rank, alpha=alpha, target_modules=target_modules,
                                use_rslora=use_rslora)

    def unmount_adapter(self, adapter_id: str) -> None:
        """Free the adapter's slot. AdapterInUseError while requests use it; UnknownAdapterError if absent."""
        self.slots.unmount(adapter_id)

    # ------------------------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, adapter_id: str | None,
                    on_event: Callable[[TokenEvent], None] | None, cache_salt: str | None = None,
                    tenant: str | None = None, weight: float = 1.0) -> None:
        """Queue a request; it joins the batch at the next step where its cache fits (and, with fair
        scheduling, where its tenant's turn comes: `handler.engine.fairness`).

        cache_salt: the prefix cache's partition (the tenant): a request only reuses blocks computed
        for the same salt, adapter and base.
        tenant: whose request it is for fair scheduling (default: `cache_salt`; None: one anonymous
        tenant). weight: the tenant's weight (its share of rows and of service grows with it;
        positive; the latest request's weight is the tenant's).

        Raises RequestTooLongError (prompt + max_tokens > max_context), InvalidRequestError (bad
        params or ids, duplicate live request id) or UnknownAdapterError (adapter not mounted).
        """
        prompt = checked_prompt(prompt_ids, params, self.config.vocab_size, self.max_context)
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"weight must be a number, not {weight!r}") from None
        if not (math.isfinite(weight) and weight > 0):
            raise InvalidRequestError(f"weight must be a positive finite number, not {weight!r}")
        state = row_state(params, prompt, self.device, self.config.vocab_size, self.tokenizer)
        with self._lock:
            if request_id in self.scheduler.requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in flight")
            slot = self.slots.acquire(adapter_id)
            self.scheduler.add(Request(request_id, prompt, params, adapter_id, slot, on_event, state, cache_salt,
                                       tenant=cache_salt if tenant is None else tenant, weight=weight))
            self._cond.notify_all()

    def cancel(self, request_id: str) -> bool:
        """Stop a request. A waiting request leaves the queue and a running one frees its row and
        cache now (or right after the forward pass in progress, if it is in it). Its final event has
        finish_reason "cancelled". Returns False for an unknown or already finished request."""
        events: list[tuple[Request, TokenEvent]] = []
        with self._lock:
            req = self.scheduler.requests.get(request_id)
            if req is None or req.cancelled:
                return False
            if not self.scheduler.withdraw(req):
                return True  # the step finishes it right after the forward pass
            self.output.finish(req, None, "cancelled", events)
            self._cond.notify_all()
        self.output.dispatch(events)
        return True

    def stats(self) -> EngineStats:
        with self._lock:
            s, ex, pool = self.scheduler, self.executor, self.kv.pool
            return EngineStats(
                running=s.batch_size(), waiting=len(s.waiting), tokens_in_flight=s.tokens_in_flight(),
                kv_cache_usage=self.kv.usage(), mounted_adapters=self.slots.count(),
                free_slots=self.slots.free_counts(), steps=s.steps, prompt_tokens_total=s.prompt_tokens,
                generated_tokens_total=self.output.generated, kv_cache_capacity_tokens=self.kv.capacity_tokens,
                preemptions=s.preemptions, attention=self.attention,
                decode_step_c=ex.decode_step.steps if ex.decode_step is not None else 0,
                prefix_cache_queries=s.prefix_queries, prefix_cache_hits=s.prefix_hits,
                prefix_cache_blocks=pool.cached, prefix_cache_evictions=pool.evictions,
                prefix_cache_deferred=s.deferred, speculative_drafted=ex.drafted,
                speculative_accepted=ex.draft_accepted, scheduling=s.scheduling,
                preemptions_kv=s.policy.preemptions.get("kv", 0),
                preemptions_share=s.policy.preemptions.get("share", 0), tenants_active=len(s.policy.clients),
            )

    def tenant_stats(self) -> TenantReport:
        """Per tenant: what it was served (the most recently served tenants by name, the rest summed),
        and the fairness state of the active ones (counters, rows held, shares); for metrics."""
        with self._lock:
            named, other = self.scheduler.policy.ledger.snapshot()
            return TenantReport(named, other, self.scheduler.policy.active(), self.scheduler.scheduling)

    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work()

    # ------------------------------------------------------------------------------- the executor's choices

    @property
    def attention(self) -> str:
        """The decode attention the next step uses: "paged" or "gather"."""
        return "gather" if self.executor.decode_tables is None else "paged"

    def set_attention(self, attention: str) -> None:
        """Use this decode attention ("paged" or "gather") from the next step on (benchmarks, tests);
        every decode step then takes the torch path (the C decode step has its own attention)."""
        if attention not in ("paged", "gather"):
            raise ValueError(f"attention must be 'paged' or 'gather', not {attention!r}")
        tables = self.executor.probe_attention(required=True) if attention == "paged" else None
        with self._step_lock:
            self.executor.decode_tables = tables
            self.executor.decode_step = None

    def measure_attention(self, timed: bool = True) -> paged_attention.Probe:
        """The paged decode kernel compiled and checked against the gathered path for this engine's
        shapes and, with `timed` (benchmarks only), both paths timed (cached per process)."""
        return self.executor.measure_attention(timed)

    @property
    def decode_tables(self) -> DecodeTables | None:
        return self.executor.decode_tables

    @property
    def decode_step(self) -> DecodeStep | None:
        """The C decode step (None: every step on the torch path); benchmarks set it."""
        return self.executor.decode_step

    @decode_step.setter
    def decode_step(self, step: DecodeStep | None) -> None:
        self.executor.decode_step = step

    @property
    def compiled(self) -> bool:
        return self.executor.compiled

    @property
    def speculate(self) -> int:
        return self.executor.speculate

    @property
    def speculate_max_rows(self) -> int:
        return self.executor.speculate_max_rows

    # ------------------------------------------------------------------------------- stepping

    def step(self) -> bool:
        """Plan (admit, grow, chunk), run one forward pass, sample, emit events. Returns False when
        there was nothing to run."""
        with self._step_lock:
            with self._lock:
                plan = self.scheduler.plan()
                if plan is None:
                    return False
                rows = self.executor.prepare(plan)
            try:
                taken = self.executor.run(rows)
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                self.output.fail(plan, e)
                return True
            events = self.output.commit(plan, taken)
        self.output.dispatch(events)
        return True

    # the internals tests and benchmarks peek at
    _requests = property(lambda self: self.scheduler.requests)
    _waiting = property(lambda self: self.scheduler.waiting)
    _prefilling = property(lambda self: self.scheduler.prefilling)
    _running = property(lambda self: self.scheduler.running)
    _adapters = property(lambda self: self.slots.adapters)

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


# ------------------------------------------------------------------------------- construction


def _tokenizer(model_dir: Path, config) -> tuple:
    """The model's tokenizer and every id that ends a sequence (model config, tokenizer and
    generation_config.json)."""
    tokenizer = load_tokenizer(model_dir)
    eos = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.exists():
        g = json.loads(gen_cfg.read_text()).get("eos_token_id")
        eos.update(g if isinstance(g, list) else ([g] if g is not None else []))
    return tokenizer, frozenset(eos)


def _lora_or_merged(runner: Runner, cfg: EngineConfig, dtype: torch.dtype) -> tuple[ModelLoRA | None, str | None]:
    """(the LoRA slot stacks, None), or (None, its id) with `merged_adapter` folded into the weights
    (merged mode: the engine then serves only that adapter id, no slots, no LoRA path)."""
    merged = cfg.merged_adapter
    if merged is not None:
        w = merged.weights
        if isinstance(w, (str, Path)):
            w = read_peft_adapter(w).weights
        try:
            merge_adapter(runner, w, merged.rank, merged.alpha, merged.target_modules, merged.use_rslora)
        except InvalidAdapterWeightsError as e:
            raise InvalidAdapterError(str(e)) from None
        return None, merged.adapter_id
    pools = dict(DEFAULT_RANK_POOLS if cfg.rank_pools is None else cfg.rank_pools)
    if not pools:
        return None, None
    runner.lora = ModelLoRA(runner.config, pools, dtype, runner.device)
    return runner.lora, None


def _kv_cache(cfg: EngineConfig, config, dtype: torch.dtype, device: torch.device, max_batch: int) -> KVCache:
    """The KV cache of `kv_cache_bytes`; None sizes it for max_batch requests of
    min(max_position_embeddings, 2048) tokens, capped at 2 GiB."""
    budget = cfg.kv_cache_bytes
    if budget is None:
        per_tok = KVCache.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, dtype)
        budget = min(max_batch * min(config.max_position_embeddings, 2048) * per_tok, 2 << 30)
    return KVCache.from_budget(config, budget, dtype, device, cfg.block_size, prefix_cache=cfg.prefix_cache)
