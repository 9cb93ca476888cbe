"""`LoraHandler`: the replica's model handler, with TorchServe's lifecycle.

    handler = LoraHandler()
    handler.initialize(context)          # load the base, hash it, start the engine thread
    await handler.start()                # adapter cache (disk scan, thread pools)
    greq = await handler.preprocess("chat", body)      # validate, resolve model, tokenize, limits
    gen = await handler.inference(greq)                # take the adapter (load if cold), submit
    async for delta in gen: ...                        # text deltas as the engine produces them
    resp = await handler.postprocess(greq, gen)        # OpenAI response object (non-streaming)
    [resp] = await handler.handle([body], context)     # all of the above for a batch of bodies

`HandlerContext` carries what TorchServe's context does (model dir, device, limits) plus the
metrics and cache settings. The HTTP app (`handler.serving.app`) drives the same steps and adds streaming.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import torch

from lorafarm import openai_schemas as oai
from handler.adapters.cache import AdapterCache, AdapterLoadError, AdapterNotFoundError, AdapterSource
from handler.serving.metrics import ReplicaMetrics, RequestTimer
from handler.engine.speculate import SPECULATE_TOKENS

log = logging.getLogger("lorafarm.replica")
reqlog = logging.getLogger("lorafarm.replica.requests")

DEFAULT_RANK_POOLS = (8, 16, 32, 64)


@dataclass
class Limits:
    """Request and resource limits of one replica."""

    max_body_bytes: int = 1024 * 1024  # request body cap (413 above)
    max_waiting: int = 256  # requests waiting for an adapter or a batch place (429 above)
    default_max_tokens: int = 512  # chat default when the client sends no max_tokens
    rank_limit: int = 64  # the fleet's rank limit: larger adapters are refused at load
    max_batch: int = 32
    max_prefill_tokens: int = 2048  # vLLM's CPU API-server default (max_num_batched_tokens): a burst prefills in one step
    cancel_grace_s: float = 5.0  # after a cancel, how long to wait for the engine to let go
    load_timeout_s: float = 30.0  # the load endpoint answers 202 (still loading) after this
    # untrusted grammar work (handler.grammar.pool): worker processes, per-compile limits, cache
    grammar_workers: int = 2
    grammar_timeout_s: float = 4.0  # x2 (worker compile + the replica's build) < the router's first-byte timeout
    grammar_memory_bytes: int = 1024**3
    grammar_cache_bytes: int = 256 * 1024**2  # compiled matchers in the replica; a tenant gets 1/4
    prep_inline_bytes: int = 16 * 1024  # bodies above this are tokenized off the event loop


@dataclass
class HandlerContext:
    """What `initialize` needs: TorchServe's context (model dir, device, limits, metrics) plus the
    cache configuration."""

    model_dir: Path
    model_name: str
    replica_id: str = "r0"
    device: str | None = None
    dtype: torch.dtype = torch.float32
    limits: Limits = field(default_factory=Limits)
    metrics: ReplicaMetrics | None = None
    slots: int = 8  # device slots per rank pool
    rank_pools: dict[int, int] | None = None  # overrides `slots`: {pool rank: slots}
    kv_cache_bytes: int | None = None
    disk_dir: Path = Path("var/replica")
    ram_bytes: int = 4 * 1024**3
    load_nice: int = 10  # nice of the adapter-load threads (handler.threads.lower_thread_priority)
    disk_bytes: int = 32 * 1024**3
    trusted_keys: list = field(default_factory=list)
    source: AdapterSource | None = None
    merged_adapter: str | None = None  # adapter id merged into the base weights (merged mode)
    merged_adapter_dir: Path | None = None  # its verified PEFT folder (set by the app)
    attention: str = "auto"  # decode attention: auto | paged | gather
    compile: bool = False  # torch.compile'd layer pieces for decode steps
    batch_invariant: bool = False  # Engine(batch_invariant=True)
    prefix_cache: bool = True  # Engine(prefix_cache=True): reuse KV of identical prefixes, per tenant
    speculate: int = SPECULATE_TOKENS  # Engine(speculate=): n-gram draft tokens per greedy request and step


@dataclass
class GenerationRequest:
    kind: str  # "chat" | "completion"
    body: Any  # the validated OpenAI request
    model: str  # as the client named it
    adapter_id: str | None  # None: the base (or merged) model
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    stream: bool
    include_usage: bool
    tier: str  # where the adapter was when the request arrived
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    response_id: str = ""
    created: int = 0
    n: int = 1  # choices
    grammar: Any = None  # constrained decoding (response_format or tools): a constrained.CompiledGrammar
    tool_mode: str | None = None  # None, "auto", "required" or the named function
    tenant: str | None = None  # the router's x-lorafarm-tenant: the prefix cache's partition


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None
    index: int = 0  # the choice (n > 1)
    logprobs: list | None = None  # the logprob entries of the tokens behind `text` (oai.LogprobEntry)


class _Choice:
    """One of the n sequences of a request: its engine request id and what it produced so far."""

    __slots__ = ("engine_id", "text_parts", "finish_reason", "completion_tokens", "logprobs", "pending", "done")

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.logprobs: list = []  # every entry (non-streamed answers)
        self.pending: list = []  # entries not yet handed out with a Delta
        self.done = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Generation:
    """One request in flight: an async iterator of `Delta`s over its n choices (each Delta names its
    choice); `usage` and `finish_reason` are set once it ends. The n choices are n engine requests on
    the same prompt (choice 0 has the request's id, choice i the id + f".{i}"). Closing it early
    (`aclose`, or the HTTP client going away) cancels the request."""

    def __init__(self, handler: LoraHandler, greq: GenerationRequest, timer: RequestTimer):
        self.h = handler
        self.greq = greq
        self.timer = timer
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = len(greq.prompt_ids)
        self.cached_tokens = 0  # prompt tokens the prefix cache saved (the most any choice got)
        self.choices = [_Choice(greq.request_id if i == 0 else f"{greq.request_id}.{i}") for i in range(greq.n)]
        self._index = {c.engine_id: i for i, c in enumerate(self.choices)}
        self._engine_open = {c.engine_id for c in self.choices}  # no final event from the engine yet
        self._done = False  # every choice ended (or we stopped listening)
        self._released = False

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def text_parts(self) -> list[str]:
        return self.choices[0].text_parts

    # called on the engine thread: must not block
    def _on_event(self, ev) -> None:
        try:
            self.h._loop.call_soon_threadsafe(self._deliver, ev)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _deliver(self, ev) -> None:
        """On the loop: queue the event for the consumer; once the engine has ended every choice,
        drop the adapter reference at once, whether or not anyone still reads this generation."""
        self.queue.put_nowait(ev)
        if ev.finished or getattr(ev, "error", None):
            self._engine_open.discard(ev.request_id)
            if not self._engine_open:
                self._release()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iter()

    def _entry(self, c: _Choice, ev) -> None:
        lp = getattr(ev, "logprobs", None)
        if lp is None or ev.token_id is None:
            return
        if ev.finished and ev.finish_reason == "stop" and (
                ev.token_id in self.h.engine.eos_token_ids):
            return  # the EOS token is not part of the answer
        entry = (ev.token_id, lp[0], lp[1])
        c.logprobs.append(entry)
        c.pending.append(entry)

    def _take(self, c: _Choice) -> list | None:
        if not c.pending:
            return None
        out, c.pending = c.pending, []
        return out

    async def _iter(self) -> AsyncIterator[Delta]:
        try:
            while not self._done:
                ev = await self.queue.get()
                i = self._index.get(ev.request_id, 0)
                c = self.choices[i]
                if getattr(ev, "error", None):
                    self._end_all("error")
                    if str(ev.error).startswith("grammar: "):  # a parser limit mid-generation: no broken document
                        self.h.grammar_failures += 1
                        raise oai.OpenAIError(
                            400, f"The {'tools' if self.greq.tool_mode else 'response_format'} grammar hit a "
                            f"parser limit after {c.completion_tokens} tokens; the schema is too complex to be "
                            f"enforced: {str(ev.error)[9:][:500]}", param="tools" if self.greq.tool_mode else
                            "response_format", code="invalid_schema")
                    raise oai.OpenAIError(500, f"generation failed: {ev.error}", type="server_error",
                                          code="generation_error")
                text = ev.text or ""
                if ev.token_id is not None and ev.token_id >= 0:
                    self.timer.on_token()
                if ev.completion_tokens is not None:
                    c.completion_tokens = ev.completion_tokens
                if ev.prompt_tokens:
                    self.prompt_tokens = ev.prompt_tokens
                self.cached_tokens = max(self.cached_tokens, getattr(ev, "cached_tokens", 0) or 0)
                self._entry(c, ev)
                out = text  # the engine applies stop strings (and holds back partial matches)
                if ev.finished:
                    c.done = True
                    reason = ev.finish_reason or "stop"
                    c.finish_reason = reason if reason in ("stop", "length", "cancelled", "error") else "stop"
                    if out:
                        c.text_parts.append(out)
                        yield Delta(out, None, i, self._take(c))
                    yield Delta("", c.finish_reason, i, self._take(c))
                    if all(x.done for x in self.choices):
                        self._done = True
                        self.timer.on_finish(self.finish_reason, self.prompt_tokens, self.completion_tokens)
                        self._log()
                        if not self._engine_open:
                            self._release()
                        return
                    continue
                if out:
                    c.text_parts.append(out)
                    yield Delta(out, None, i, self._take(c))
        finally:
            self.abandon()

    def _end_all(self, reason: str) -> None:
        for c in self.choices:
            if not c.done:
                c.done = True
                c.finish_reason = reason
        for c in self.choices:
            if c.engine_id in self._engine_open:
                self.h.engine.cancel(c.engine_id)
        self._done = True
        self.timer.on_finish(reason, self.prompt_tokens, self.completion_tokens)
        self._log()
        self._release_after_engine_end()

    def abandon(self) -> None:
        """Stop caring about this request (the client went away or the consumer stopped early):
        cancel it in the engine and drop the adapter reference once the engine let go. No-op when it
        already ended. Synchronous, so it is safe in `finally` blocks under cancellation."""
        if self._done:
            return
        self._end_all("cancelled")

    def _log(self) -> None:
        """One line per request: the adapter id is logged on every request (isolation audits)."""
        t = self.timer
        ttft = f"{(t.first_token - t.arrival) * 1000:.1f}ms" if t.first_token else "-"
        reqlog.info("request %s model=%s adapter=%s tier=%s n=%d prompt=%d completion=%d finish=%s ttft=%s "
                    "e2e=%.1fms", self.greq.request_id, self.greq.model, self.greq.adapter_id or "-", self.greq.tier,
                    self.greq.n, self.prompt_tokens, self.completion_tokens, self.finish_reason,
                    ttft, (time.perf_counter() - t.arrival) * 1000)

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self.h._inflight.pop(self.greq.request_id, None)
        if self.h._uses_cache(self.greq):
            self.h.cache.release(self.greq.adapter_id)

    def _release_after_engine_end(self) -> None:
        """After a cancel the engine may run the row for one more step: the reference is dropped on the
        engine's final event (`_deliver`); this is only the fallback should that event never come."""

        async def fallback():
            await asyncio.sleep(self.h.context.limits.cancel_grace_s)
            if not self._released:
                log.warning("no final event for cancelled request %s: releasing its adapter", self.greq.request_id)
                self._release()

        if not self._released and self._engine_open:
            self.h._bg(fallback)
        elif not self._engine_open:
            self._release()

    @property
    def text(self) -> str:
        return self.choices[0].text


class LoraHandler:
    """TorchServe-style handler of one replica: base model + engine + tiered adapter cache."""

    def __init__(self):
        self.initialized = False
        self.context: HandlerContext | None = None
        self.engine = None
        self.cache: AdapterCache | None = None
        self.metrics: ReplicaMetrics | None = None
        self.base_model_hash = ""
        self.base_config: dict = {}
        self.models: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: dict[str, Generation] = {}
        self._waiting_for_adapter = 0
        self._tasks: set[asyncio.Task] = set()
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}
        self.grammar_pool = None  # handler.grammar.pool.GrammarPool (started in `start`)
        self.grammar_builder = None
        self.grammar_cache = None
        self._grammar_inflight: dict[str, asyncio.Future] = {}
        self._grammar_refused: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self.grammar_failures = 0  # parser limits hit mid-generation
        self._prep = None  # the thread that tokenizes large prompts off the event loop

    # -- lifecycle --------------------------------------------------------------------------

    def initialize(self, context: HandlerContext) -> None:
        """Load the base (and merge an adapter into it in merged mode), hash it, start the engine."""
        from archives.basehash import base_model_hash, read_base_config
        from handler.engine.engine import Engine

        self.context = context
        self.metrics = context.metrics or ReplicaMetrics(context.replica_id, context.model_name)
        context.metrics = self.metrics
        self.metrics.watch_grammar(self)
        self.metrics.watch_prefix_cache(self)
        self.metrics.watch_speculation(self)
        self.base_config = read_base_config(context.model_dir)
        self.base_model_hash = base_model_hash(context.model_dir)
        pools = context.rank_pools or {r: context.slots for r in DEFAULT_RANK_POOLS if r <= context.limits.rank_limit}
        if not pools:
            pools = {context.limits.rank_limit: context.slots}
        kw: dict[str, Any] = dict(device=context.device, dtype=context.dtype, max_batch=context.limits.max_batch,
                                  rank_pools=pools, max_prefill_tokens=context.limits.max_prefill_tokens,
                                  attention=context.attention, compile=context.compile,
                                  batch_invariant=context.batch_invariant, prefix_cache=context.prefix_cache,
                                  speculate=context.speculate,
                                  cache_key=self.base_model_hash)
        if context.kv_cache_bytes:
            kw["kv_cache_bytes"] = context.kv_cache_bytes
        if context.merged_adapter:
            kw["merged_adapter"] = self._merged_adapter(context)
            kw.pop("rank_pools")
        self.engine = Engine(context.model_dir, **kw)
        if context.merged_adapter:
            self.models = [context.merged_adapter]
        else:
            self.models = [context.model_name]
        self.engine.start()
        self.initialized = True
        log.info("replica %s: base %s (%s), %s", context.replica_id, context.model_name, self.base_model_hash,
                 f"merged adapter {context.merged_adapter}" if context.merged_adapter else f"rank pools {pools}")

    def _merged_adapter(self, context: HandlerContext):
        """Merged mode: the verified adapter folder (fetched and verified by the app) -> MergedAdapter,
        its tensors checked against the base's shapes first."""
        import json

        from safetensors.torch import load_file

        from handler.adapters.cache import check_adapter_tensors
        from handler.model.merge import MergedAdapter

        d = context.merged_adapter_dir
        if d is None:
            raise RuntimeError("merged mode needs the verified adapter folder")
        man = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {}
        cfg = json.loads((d / "adapter_config.json").read_text())
        rank = int(man.get("rank") or cfg["r"])
        alpha = float(man.get("alpha") or cfg.get("lora_alpha", rank))
        modules = list(man.get("target_modules") or cfg["target_modules"])
        weights = load_file(str(d / "adapter_model.safetensors"))
        check_adapter_tensors(context.merged_adapter, weights, rank=rank, target_modules=modules,
                              config=self.base_config)
        return MergedAdapter(context.merged_adapter, weights, rank, alpha, modules)

    async def start(self) -> None:
        """Async part of start-up (on the serving loop): the adapter cache."""
        ctx = self.context
        assert ctx is not None and self.engine is not None
        self._loop = asyncio.get_running_loop()
        self.cache = AdapterCache(
            self.engine, base_config=self.base_config, base_model_hash=self.base_model_hash,
            trusted_keys=ctx.trusted_keys, source=ctx.source, disk_dir=ctx.disk_dir,
            ram_bytes=ctx.ram_bytes, disk_bytes=ctx.disk_bytes, rank_limit=ctx.limits.rank_limit,
            metrics=self.metrics, dtype=None,  # kept as stored; the engine casts on mount
            pin_memory=str(getattr(self.engine, "device", "cpu")).startswith("cuda"), load_nice=ctx.load_nice,
        )
        await self.cache.start()
        await self._start_grammar()

    async def _start_grammar(self) -> None:
        """The grammar worker pool, the matcher-build thread, the byte-bounded cache, and the thread
        that tokenizes large prompts (handler.grammar.pool)."""
        from concurrent.futures import ThreadPoolExecutor

        from handler.grammar import constrained
        from handler.grammar.pool import GrammarPool

        lim = self.context.limits
        vocab = int(self.engine.config.vocab_size)
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorafarm-prep")
        self.grammar_cache = constrained.GrammarCache(lim.grammar_cache_bytes)
        try:
            spec = await asyncio.to_thread(constrained.tokenizer_spec, self.engine.tokenizer, vocab)
        except Exception as e:  # not a fast tokenizer: constrained decoding is refused (400), the rest serves
            log.warning("no constrained decoding on this replica: %s", e)
            return
        self.grammar_builder = constrained.GrammarBuilder(self.engine.tokenizer, vocab, nice=self.context.load_nice)
        await asyncio.to_thread(self.grammar_builder.start)
        self.grammar_pool = GrammarPool(spec, workers=lim.grammar_workers, timeout_s=lim.grammar_timeout_s,
                                        memory_bytes=lim.grammar_memory_bytes)
        await self.grammar_pool.start()

    async def shutdown(self) -> None:
        for gen in list(self._inflight.values()):
            self.engine.cancel(gen.greq.request_id)
        for t in list(self._tasks):
            t.cancel()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self.cache is not None:
            await self.cache.close()
        if self.grammar_pool is not None:
            await self.grammar_pool.close()
        if self.grammar_builder is not None:
            self.grammar_builder.close()
        if self._prep is not None:
            self._prep.shutdown(wait=False, cancel_futures=True)

    def _bg(self, coro_fn) -> None:
        """Run `coro_fn()` as a task on the serving loop (from any thread)."""

        def spawn():
            t = self._loop.create_task(coro_fn())
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            spawn()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(spawn)

    # -- TorchServe steps -------------------------------------------------------------------

    async def preprocess(self, kind: str, body: bytes | dict | Any, tenant: str | None = None) -> GenerationRequest:
        """Validate the body, resolve the model (404 when unknown), tokenize, check the limits, and
        compile the grammar (in a worker process: handler.grammar.pool). `tenant` (the router's
        x-lorafarm-tenant; default the model) is whose share of the grammar cache it uses.
        Nothing here that can take long runs on the event loop: a large body is tokenized (chat
        template, tool prompt, tokenizer) on a thread; a grammar compiles in a worker process, and its
        matcher is built on a thread that does not hold the GIL."""
        model_cls = oai.ChatCompletionRequest if kind == "chat" else oai.CompletionRequest
        size = len(body) if isinstance(body, (bytes, bytearray, str)) else 0
        if size > self.context.limits.prep_inline_bytes and self._prep is not None:
            req = body if isinstance(body, model_cls) else await self._off_loop(oai.parse_request, model_cls, body)
        else:
            req = body if isinstance(body, model_cls) else oai.parse_request(model_cls, body)
        adapter_id = await self.resolve_model(req.model)
        tier = "gpu" if (adapter_id is None or self.context.merged_adapter) else self.cache.tier_of(adapter_id)
        if size > self.context.limits.prep_inline_bytes and self._prep is not None:
            prompt_ids = await self._off_loop(self._tokenize, kind, req)
        else:
            prompt_ids = self._tokenize(kind, req)
        max_ctx = int(self.engine.max_context)
        n_prompt = len(prompt_ids)
        if n_prompt == 0:
            raise oai.bad_request("The prompt is empty.", param="prompt", code="invalid_value")
        if n_prompt >= max_ctx:
            raise oai.bad_request(
                f"This model's maximum context length is {max_ctx} tokens. However, your prompt has "
                f"{n_prompt} tokens.", param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded")
        if req.max_tokens is None:
            max_tokens = min(self.context.limits.default_max_tokens, max_ctx - n_prompt)
        else:
            max_tokens = req.max_tokens
            if n_prompt + max_tokens > max_ctx:
                raise oai.bad_request(
                    f"This model's maximum context length is {max_ctx} tokens. However, you requested "
                    f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                    f"completion). Please reduce the length of the prompt or max_tokens.",
                    param="max_tokens", code="context_length_exceeded")
        rid = f"{self.context.replica_id}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        tool_mode = req.tool_mode if kind == "chat" else None
        return GenerationRequest(
            kind=kind, body=req, model=req.model, adapter_id=adapter_id, prompt_ids=prompt_ids,
            max_tokens=max_tokens, stop=req.stop_list, stream=req.stream, include_usage=req.include_usage,
            tier=tier, request_id=rid, response_id=oai.new_id(kind), created=oai.now(), n=req.n,
            grammar=await self._grammar(kind, req, tenant or req.model, big=size > self.context.limits.prep_inline_bytes),
            tool_mode=tool_mode, tenant=tenant)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)

    async def _grammar(self, kind: str, req, tenant: str, big: bool = False):
        """The compiled grammar that constrains the answer (json_object / json_schema / tool calls),
        None for free text. Compiled and test-run in a worker process (handler.grammar.pool), its
        matcher built off the loop, cached by bytes per tenant; identical concurrent requests share
        one compile, and a refused grammar is remembered (a poison schema kills at most one worker).
        400 invalid_schema when a limit is hit or it cannot be enforced; 429 when too many wait."""
        from handler.grammar.pool import GrammarBusy, GrammarError

        if kind != "chat":
            return None
        if req.tool_mode is not None:
            job = {"kind": "tools", "tools": [t.model_dump(exclude_none=True) for t in req.tools],
                   "choice": req.tool_mode, "parallel": req.parallel_tool_calls is not False}
            param = "tools"
        elif req.response_format is not None and req.response_format.type == "json_object":
            job, param = {"kind": "json_object"}, "response_format"
        elif req.response_format is not None and req.response_format.type == "json_schema":
            job = {"kind": "json_schema", "schema": req.response_format.json_schema.schema_}
            param = "response_format"
        else:
            return None
        if self.grammar_pool is None:
            raise oai.bad_request(f"Invalid {param}: constrained decoding is not available for this model.",
                                  param=param, code="invalid_schema")
        # a large schema's canonical JSON and hash (and its encoding for the worker) off the loop
        raw, key = (await self._off_loop(_job_key, job)) if big and self._prep is not None else _job_key(job)
        refused = self._grammar_refused.get(key)
        if refused is not None:
            raise oai.bad_request(f"Invalid {param}: {refused[0]}", param=param, code="invalid_schema")
        hit = self.grammar_cache.get(key)
        if hit is not None:
            return hit
        fut = self._grammar_inflight.get(key)
        if fut is None:
            fut = self._grammar_inflight[key] = asyncio.ensure_future(self._compile_grammar(key, raw, tenant))
            fut.add_done_callback(lambda f, k=key: self._grammar_inflight.pop(k, None))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.shield(fut)
        except GrammarError as e:
            raise oai.bad_request(f"Invalid {param}: {e}", param=param, code="invalid_schema") from None
        except GrammarBusy:
            raise oai.OpenAIError(429, "Too many grammars are being compiled; retry shortly.",
                                  type="rate_limit_error", code="grammar_queue_full",
                                  headers={"Retry-After": "1"}) from None

    async def _compile_grammar(self, key: str, job: bytes, tenant: str):
        from handler.grammar.pool import GrammarError

        try:
            res = await self.grammar_pool.compile(job, tenant)
            try:
                compiled = await self.grammar_builder.build(res.grammar, res.cost)
            except ValueError as e:  # the worker compiled it: should not happen
                raise GrammarError(str(e)) from None
        except GrammarError as e:
            log.info("grammar refused (%s) for tenant %s: %s", e.limit, tenant, str(e)[:300])
            if e.limit in ("invalid", "parser_limit", "crash", "memory"):  # deterministic (a timeout may be load)
                self._grammar_refused[key] = (str(e)[:1000], e.limit)
                while len(self._grammar_refused) > 4096:
                    self._grammar_refused.popitem(last=False)
            raise
        evicted = self.grammar_cache.evictions
        self.grammar_cache.put(key, tenant, compiled)
        if self.grammar_cache.evictions != evicted:  # hand what the evicted matchers held back to the OS
            await self.grammar_builder.trim()
        return compiled

    async def resolve_model(self, model: str) -> str | None:
        """A base model name -> None; a known adapter id (in merged mode: only the merged one) ->
        itself; anything else -> 404 model_not_found."""
        if self.context.merged_adapter:
            if model == self.context.merged_adapter:
                return model
            raise oai.model_not_found(model)
        if model in self.models:
            return None
        try:
            known = await self.cache.exists(model)
        except AdapterNotFoundError:
            known = False
        except Exception as e:  # the registry is down: local tiers still answer
            log.warning("adapter lookup of %s failed: %s", model, e)
            raise oai.OpenAIError(503, f"cannot look up adapter {model}: {e}", type="server_error",
                                  code="registry_unavailable") from None
        if not known:
            raise oai.model_not_found(model)
        return model

    def _tokenize(self, kind: str, req) -> list[int]:
        tok = self.engine.tokenizer
        if kind == "chat":
            from handler.grammar.tools_prompt import render_messages

            messages, kw = render_messages(tok, req)
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
            except Exception as e:
                raise oai.bad_request(f"The messages cannot be formatted with the chat template: {e}",
                                      param="messages") from None
            return list(tok.encode(text, add_special_tokens=False))
        ids = req.prompt_token_ids()
        if ids is not None:
            vocab = int(getattr(self.engine.config, "vocab_size", 0) or 0)
            if vocab and any(i < 0 or i >= vocab for i in ids):
                raise oai.bad_request("prompt token ids out of the vocabulary", param="prompt")
            return ids
        return list(tok.encode(req.prompt_text(), add_special_tokens=True))

    def _uses_cache(self, greq: GenerationRequest) -> bool:
        return greq.adapter_id is not None and not self.context.merged_adapter

    def check_capacity(self) -> None:
        """The waiting-queue cap: 429 when too many requests already wait."""
        if self.waiting() >= self.context.limits.max_waiting:
            raise oai.OpenAIError(429, "The replica's waiting queue is full; retry shortly.",
                                  type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    def waiting(self) -> int:
        return self._waiting_for_adapter + int(self.engine.stats().waiting)

    async def inference(self, greq: GenerationRequest) -> Generation:
        """Take the adapter (loading it if cold: only this request's adapter is waited for) and submit
        the request's n choices to the engine. Raises OpenAIError when the adapter cannot be loaded."""
        timer = RequestTimer(self.metrics, greq.tier)
        if self._uses_cache(greq):
            self._waiting_for_adapter += 1
            try:
                await self.cache.acquire(greq.adapter_id)
            except AdapterNotFoundError:
                raise oai.model_not_found(greq.model) from None
            except AdapterLoadError as e:
                raise load_error_to_openai(e) from None
            finally:
                self._waiting_for_adapter -= 1
        gen = Generation(self, greq, timer)
        self._inflight[greq.request_id] = gen
        added: list[str] = []
        try:
            for i, choice in enumerate(gen.choices):
                self.engine.add_request(choice.engine_id, greq.prompt_ids, self.sampling_params(greq, i),
                                        greq.adapter_id, gen._on_event, cache_salt=greq.tenant)
                added.append(choice.engine_id)
        except BaseException as e:  # a failed admission keeps no reference (the cache's nor the engine's)
            for eid in added:
                self.engine.cancel(eid)
            gen._done = True
            gen._release()
            from handler.engine.engine import InvalidRequestError

            if isinstance(e, InvalidRequestError):
                raise oai.bad_request(str(e), code="invalid_request") from None
            if not isinstance(e, Exception):
                raise
            raise oai.OpenAIError(503, f"the engine refused the request: {e}", type="server_error",
                                  code="engine_unavailable") from None
        timer.on_scheduled()
        return gen

    @staticmethod
    def sampling_params(greq: GenerationRequest, index: int = 0):
        """The engine parameters of choice `index`: choice i of a seeded request is seeded seed + i,
        so the n choices differ and each is reproducible."""
        from handler.engine.engine import SamplingParams

        body = greq.body
        seed = None if body.seed is None else int(body.seed) + index
        if seed is not None and seed > oai.SEED_MAX:
            seed -= 2**64  # still a seed torch accepts, and still distinct per choice
        return SamplingParams(
            max_tokens=greq.max_tokens, temperature=float(body.temperature), top_p=float(body.top_p), seed=seed,
            stop=tuple(greq.stop), ignore_eos=bool(body.ignore_eos), top_k=int(body.top_k), min_p=float(body.min_p),
            presence_penalty=float(body.presence_penalty), frequency_penalty=float(body.frequency_penalty),
            repetition_penalty=float(body.repetition_penalty), logit_bias=body.logit_bias_ids(),
            logprobs=body.n_logprobs, grammar=greq.grammar)

    def token_text(self, token_id: int) -> str:
        """A token's text as logprobs report it (cached per token)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.engine.tokenizer.decode([token_id])
        return text

    def choice_object(self, greq: GenerationRequest, i: int, text: str, finish_reason: str,
                      entries: list | None) -> dict:
        """One finished choice as OpenAI writes it (tool calls parsed out of chat text)."""
        want_lp = greq.body.n_logprobs is not None
        if greq.kind != "chat":
            lp = oai.completion_logprobs(entries or [], self.token_text) if want_lp else None
            return oai.completion_choice(i, text, finish_reason, lp)
        lp = oai.chat_logprobs(entries or [], self.token_text) if want_lp else None
        if greq.tool_mode is None:
            return oai.chat_choice(i, text, finish_reason, logprobs=lp)
        from handler.grammar.constrained import parse_tool_calls

        content, calls = parse_tool_calls(text)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        tool_calls = oai.tool_calls_obj([(oai.new_call_id(), name, args) for name, args in calls])
        return oai.chat_choice(i, content, finish_reason, tool_calls=tool_calls, logprobs=lp)

    async def postprocess(self, greq: GenerationRequest, gen: Generation) -> dict:
        """Drain a generation into an OpenAI (chat) completion object with its n choices."""
        async for _ in gen:
            pass
        choices = [self.choice_object(greq, i, c.text, c.finish_reason or "stop", c.logprobs)
                   for i, c in enumerate(gen.choices)]
        build = oai.chat_completion if greq.kind == "chat" else oai.completion
        return build(greq.response_id, greq.model, choices, gen.prompt_tokens, gen.completion_tokens,
                     created=greq.created, cached_tokens=gen.cached_tokens)

    async def handle(self, data: list[dict], context: Any = None, kind: str = "chat") -> list[dict]:
        """TorchServe's entry point: a batch of request bodies -> a list of responses (errors become
        OpenAI error objects in their place, so one bad request never fails the batch)."""

        async def one(body):
            try:
                greq = await self.preprocess(kind, body)
                gen = await self.inference(greq)
                return await self.postprocess(greq, gen)
            except oai.OpenAIError as e:
                return e.body()

        return list(await asyncio.gather(*(one(b) for b in data)))

    # -- state ------------------------------------------------------------------------------

    def state(self):
        from lorafarm.schemas import HeldAdapter, ReplicaState

        st = self.engine.stats()
        merged = self.context.merged_adapter
        return ReplicaState(
            replica_id=self.context.replica_id, base_model_hash=self.base_model_hash, models=list(self.models),
            gpu_adapters=[merged] if merged else self.cache.gpu_adapters(),
            ram_adapters=[] if merged else self.cache.ram_adapters(),
            queue_depth=self.waiting(), engine_waiting=int(st.waiting), running=int(st.running),
            tokens_in_flight=int(st.tokens_in_flight),
            evictions_per_min=self.metrics.evictions_per_min(), loads_per_min=self.metrics.loads_per_min(),
            kv_cache_usage=float(st.kv_cache_usage),
            adapters=({merged: HeldAdapter(tier="gpu")} if merged else
                      {a: HeldAdapter(tier=t, expected_load_ms=round(ms, 3)) for a, (t, ms) in self.cache.held().items()}),
            load_ms={} if merged else self.cache.load_times.averages_ms())

    def refresh_gauges(self) -> None:
        st = self.engine.stats()
        self.metrics.num_requests_running.set(st.running)
        self.metrics.num_requests_waiting.set(self.waiting())
        self.metrics.tokens_in_flight.set(st.tokens_in_flight)
        self.metrics.kv_cache_usage_perc.set(st.kv_cache_usage)
        self.metrics.decode_attention_paged.set(1 if st.attention == "paged" else 0)


def _job_key(job: dict) -> tuple[bytes, str]:
    """A grammar job's canonical JSON (what the worker gets) and its hash (the cache key)."""
    raw = json.dumps(job, sort_keys=True, separators=(",", ":")).encode()
    return raw, hashlib.sha256(raw).hexdigest()


def load_error_to_openai(e: AdapterLoadError) -> oai.OpenAIError:
    """A refused or failed adapter load, as an OpenAI error: 422 when the adapter itself is refused
    (verification), 503 when the failure may be transient (store, network)."""
    refused = e.code in ("bad_signature", "checksum_mismatch", "base_mismatch", "rank_limit",
                         "invalid_adapter", "unsafe_archive", "corrupt_archive", "invalid_archive")
    status = 422 if refused else 503
    return oai.OpenAIError(status, str(e), type="invalid_request_error" if refused else "server_error",
                           param="model", code=f"adapter_{e.code}")
