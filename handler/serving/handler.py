"""`LoraHandler`: the replica's model handler, with TorchServe's lifecycle, and the one path every
completion takes through the replica (the HTTP routes in `handler.serving.app` only parse and answer).

    handler = LoraHandler()
    handler.initialize(context)          # load the base, hash it, start the engine thread
    await handler.start()                # adapter cache (disk scan, thread pools), grammar workers
    greq = await handler.preprocess("chat", body)      # validate, resolve model, tokenize, limits
    handler.admit(greq)                                # shed: draining, queue cap, token bound
    gen = handler.inference(greq)                      # take the adapter (load if cold), submit
    resp = await handler.postprocess(greq, gen)        # OpenAI response object (non-streaming)
    async for chunk in handler.stream(greq, gen): ...  # or its SSE body, keep-alives included
    [resp] = await handler.handle([body])              # all of the above for a batch of bodies

`HandlerContext` carries what TorchServe's context does (model dir, limits, metrics) plus the engine
settings (`EngineConfig`, whole) and the adapter cache's.
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
from typing import Any, AsyncIterator, Callable

from safetensors.torch import load_file

from archives.basehash import base_model_hash, read_base_config
from handler.adapters.cache import (
    AdapterCache,
    AdapterLoadError,
    AdapterNotFoundError,
    AdapterSource,
    check_adapter_tensors,
)
from handler.engine.config import DEFAULT_RANK_POOLS, EngineConfig
from handler.engine.engine import Engine, InvalidRequestError
from handler.engine.sampling import SamplingParams
from handler.grammar import constrained
from handler.grammar.constrained import ToolCallStream, parse_tool_calls
from handler.grammar.pool import GrammarBusy, GrammarError, GrammarPool
from handler.grammar.tools_prompt import render_messages
from handler.model.merge import MergedAdapter
from handler.serving.config import REPLICA_ENGINE, Limits
from handler.serving.metrics import ReplicaMetrics, RequestTimer
from handler.serving.prep import FairQueuesCollector, TokenBound, prep_pool
from handler.serving.shedding import fair_admits
from handler.threads import FairThreadPool, LoopInbox, QueueFull
from lorafarm import openai_schemas as oai
from lorafarm.schemas import HeldAdapter, ReplicaState

__all__ = ["LoraHandler", "HandlerContext", "Limits", "GenerationRequest", "Generation", "Delta", "KEEPALIVE",
           "load_error_to_openai", "not_ready"]

log = logging.getLogger("lorafarm.replica")
reqlog = logging.getLogger("lorafarm.replica.requests")

KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: OpenAI clients ignore it, the router's read timeout sees bytes


@dataclass
class HandlerContext:
    """What `initialize` needs: TorchServe's context (model dir, limits, metrics), the engine's
    settings (whole: `Engine(model_dir, engine.replace(...))`) and the adapter cache's."""

    model_dir: Path
    model_name: str
    replica_id: str = "r0"
    engine: EngineConfig = REPLICA_ENGINE
    limits: Limits = field(default_factory=Limits)
    metrics: ReplicaMetrics | None = None
    slots: int = 8  # device slots per rank pool
    rank_pools: dict[int, int] | None = None  # overrides `slots`: {pool rank: slots}
    disk_dir: Path = Path("var/replica")
    ram_bytes: int = 4 * 1024**3
    load_nice: int = 10  # nice of the adapter-load threads (handler.threads.lower_thread_priority)
    disk_bytes: int = 32 * 1024**3
    trusted_keys: list = field(default_factory=list)
    source: AdapterSource | None = None
    merged_adapter: str | None = None  # adapter id merged into the base weights (merged mode)
    merged_adapter_dir: Path | None = None  # its verified PEFT folder (set by the app)


@dataclass
class GenerationRequest:
    kind: str  # "chat" | "completion"
    body: Any  # the validated OpenAI request
    model: str  # as the client named it (or the router's alias for it)
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
    tenant_weight: float = 1.0  # the router's x-lorafarm-tenant-weight: the tenant's fair share weight
    hold: Any = None  # test farms only: a handler.serving.holds.Hold pausing the engine mid-generation


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
    """One request from admission to its end: an async iterator of `Delta`s over its n choices (each
    Delta names its choice); the token counts and `finish_reason` are set once it ends.

    Admission starts with it (`LoraHandler.inference`), as a task: the adapter is taken (loaded if
    cold: only this request's adapter is waited for), then the n choices go to the engine as n
    requests on the same prompt (choice 0 has the request's id, choice i the id + f".{i}"). An
    admission error (404, 422, 503) is raised by `admitted` and by the iterator; a request that never
    reached the engine counts nowhere. Closing it early (`abandon`: the consumer stopped, the HTTP
    client went away) cancels it wherever it is, waiting for its adapter or in the engine, and counts
    it cancelled."""

    def __init__(self, handler: LoraHandler, greq: GenerationRequest):
        self.h = handler
        self.greq = greq
        self.timer = RequestTimer(handler.metrics, greq.tier)
        self.queue: asyncio.Queue = asyncio.Queue()  # engine events, or the admission error
        self.prompt_tokens = len(greq.prompt_ids)
        self.cached_tokens = 0  # prompt tokens the prefix cache saved (the most any choice got)
        self.choices = [_Choice(greq.request_id if i == 0 else f"{greq.request_id}.{i}") for i in range(greq.n)]
        self.error: BaseException | None = None  # why admission failed
        self._index = {c.engine_id: i for i, c in enumerate(self.choices)}
        self._engine_open: set[str] = set()  # submitted choices without a final event from the engine yet
        self._holds_adapter = False  # a reference on the adapter in the cache, dropped by `_release`
        self._done = False  # every choice ended, or we stopped listening
        self._released = False
        self._admission = asyncio.ensure_future(self._admit())

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def text(self) -> str:
        return self.choices[0].text

    # -- admission --------------------------------------------------------------------------

    async def _admit(self) -> None:
        h, greq = self.h, self.greq
        try:
            if h._uses_cache(greq):
                h._waiting_for_adapter += 1
                try:
                    await h.cache.acquire(greq.adapter_id)
                except AdapterNotFoundError:
                    raise oai.model_not_found(greq.model) from None
                except AdapterLoadError as e:
                    raise load_error_to_openai(e) from None
                finally:
                    h._waiting_for_adapter -= 1
                self._holds_adapter = True
            self._submit()
        except Exception as e:  # a failed admission keeps no reference (the cache's nor the engine's)
            self.error = e
            self._release()
            self.queue.put_nowait(e)

    def _submit(self) -> None:
        """The n choices to the engine (synchronous: once the adapter is held, nothing can cancel
        this half-way)."""
        h, greq = self.h, self.greq
        try:
            for i, c in enumerate(self.choices):
                h.engine.add_request(c.engine_id, greq.prompt_ids, h.sampling_params(greq, i), greq.adapter_id,
                                     self._on_event, cache_salt=greq.tenant, weight=greq.tenant_weight)
                self._engine_open.add(c.engine_id)
        except Exception as e:
            for eid in self._engine_open:
                h.engine.cancel(eid)
            if isinstance(e, InvalidRequestError):
                raise oai.bad_request(str(e), code="invalid_request") from None
            raise oai.OpenAIError(503, f"the engine refused the request: {e}", type="server_error",
                                  code="engine_unavailable") from None
        self.timer.on_scheduled()

    async def admitted(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: as long as it takes) for admission; raise its error.
        True once the engine has the request."""
        if not self._admission.done():
            await asyncio.wait({self._admission}, timeout=timeout)
        if self.error is not None:
            raise self.error
        return self._admission.done()

    # -- engine events ----------------------------------------------------------------------

    # called on the engine thread: must not block
    def _on_event(self, ev) -> None:
        self.h.events.post(self._deliver, ev)
        if self.greq.hold is not None:  # test farms only: may block here, after the token went out
            self.greq.hold.on_event(ev)

    def _deliver(self, ev) -> None:
        """On the loop: queue the event for the consumer; once the engine has ended every choice,
        drop the adapter reference at once, whether or not anyone still reads this generation."""
        self.queue.put_nowait(ev)
        if ev.finished or getattr(ev, "error", None):
            self._engine_open.discard(ev.request_id)
            if not self._engine_open:
                self._release()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self.deltas()

    async def deltas(self, keepalive_s: float = 0.0) -> AsyncIterator[Delta | None]:
        """The deltas as the engine produces them. With `keepalive_s` > 0, None after every
        `keepalive_s` seconds without one (while the request waits for its adapter, in the engine's
        queue, or behind a slow step: a stream's keep-alive)."""
        loop = asyncio.get_running_loop()
        try:
            deadline = loop.time() + keepalive_s
            while not self._done:
                if keepalive_s > 0:
                    try:
                        async with asyncio.timeout_at(deadline):
                            ev = await self.queue.get()  # cancel-safe: a timed-out get loses no event
                    except TimeoutError:
                        deadline = loop.time() + keepalive_s
                        yield None
                        continue
                else:
                    ev = await self.queue.get()
                if isinstance(ev, BaseException):  # admission failed
                    raise ev
                for d in self._on_engine_event(ev):
                    deadline = loop.time() + keepalive_s
                    yield d
        finally:
            self.abandon()

    def _on_engine_event(self, ev) -> list[Delta]:
        """One engine event -> the deltas it makes (none, text, or text then the choice's finish)."""
        i = self._index.get(ev.request_id, 0)
        c = self.choices[i]
        if getattr(ev, "error", None):
            self._end_all("error")
            if str(ev.error).startswith("grammar: "):  # a parser limit mid-generation: no broken document
                self.h.grammar_failures += 1
                param = "tools" if self.greq.tool_mode else "response_format"
                raise oai.OpenAIError(
                    400, f"The {param} grammar hit a parser limit after {c.completion_tokens} tokens; the "
                    f"schema is too complex to be enforced: {str(ev.error)[9:][:500]}", param=param,
                    code="invalid_schema")
            raise oai.OpenAIError(500, f"generation failed: {ev.error}", type="server_error",
                                  code="generation_error")
        if ev.token_id is not None and ev.token_id >= 0:
            self.timer.on_token()
        if ev.completion_tokens is not None:
            c.completion_tokens = ev.completion_tokens
        if ev.prompt_tokens:
            self.prompt_tokens = ev.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, getattr(ev, "cached_tokens", 0) or 0)
        self._entry(c, ev)
        text = ev.text or ""  # the engine applies stop strings (and holds back partial matches)
        out = []
        if text:
            c.text_parts.append(text)
            out.append(Delta(text, None, i, self._take(c)))
        if not ev.finished:
            return out
        c.done = True
        reason = ev.finish_reason or "stop"
        c.finish_reason = reason if reason in ("stop", "length", "cancelled", "error") else "stop"
        out.append(Delta("", c.finish_reason, i, self._take(c)))
        if all(x.done for x in self.choices):
            self._done = True
            self.timer.on_finish(self.finish_reason, self.prompt_tokens, self.completion_tokens)
            self._log()
            if not self._engine_open:
                self._release()
        return out

    def _entry(self, c: _Choice, ev) -> None:
        lp = getattr(ev, "logprobs", None)
        if lp is None or ev.token_id is None:
            return
        if ev.finished and ev.finish_reason == "stop" and ev.token_id in self.h.engine.eos_token_ids:
            return  # the EOS token is not part of the answer
        entry = (ev.token_id, lp[0], lp[1])
        c.logprobs.append(entry)
        c.pending.append(entry)

    @staticmethod
    def _take(c: _Choice) -> list | None:
        if not c.pending:
            return None
        out, c.pending = c.pending, []
        return out

    # -- the end ----------------------------------------------------------------------------

    def abandon(self) -> None:
        """Stop caring about this request (the client went away or the consumer stopped early):
        cancel it, waiting for its adapter or in the engine, and drop the adapter reference once the
        engine let go. No-op when it already ended or was never admitted. Synchronous, so it is safe
        in `finally` blocks under cancellation."""
        if self._done or self.error is not None:
            return
        if not self._admission.done():
            self._admission.cancel()  # still waiting for its adapter: it never takes the reference
        self._end_all("cancelled")

    def _end_all(self, reason: str) -> None:
        for c in self.choices:
            if not c.done:
                c.done = True
                c.finish_reason = reason
        for eid in self._engine_open:
            self.h.engine.cancel(eid)
        self._done = True
        self.timer.on_finish(reason, self.prompt_tokens, self.completion_tokens)
        self._log()
        self._release_after_engine_end()

    def _log(self) -> None:
        """One line per request: the adapter id is logged on every request (isolation audits)."""
        t, g = self.timer, self.greq
        ttft = f"{(t.first_token - t.arrival) * 1000:.1f}ms" if t.first_token else "-"
        reqlog.info("request %s model=%s adapter=%s tier=%s n=%d prompt=%d completion=%d finish=%s ttft=%s "
                    "e2e=%.1fms", g.request_id, g.model, g.adapter_id or "-", g.tier, g.n, self.prompt_tokens,
                    self.completion_tokens, self.finish_reason, ttft, (time.perf_counter() - t.arrival) * 1000)

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        self.h._inflight.pop(self.greq.request_id, None)
        if self._holds_adapter:
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


class SSEChunks:
    """The SSE body of one streamed request, as OpenAI writes it: per choice (`index`) a role chunk
    (chat), content (or text) chunks with their logprobs, tool calls as `tool_calls` deltas once
    complete, and a finish chunk; then the usage chunk (on request)."""

    def __init__(self, greq: GenerationRequest, token_text: Callable[[int], str]):
        self.greq = greq
        self.token_text = token_text
        self.chat = greq.kind == "chat"
        self.want_lp = greq.body.n_logprobs is not None
        self.tools = [ToolCallStream(oai.new_call_id) for _ in range(greq.n)] if self.chat and greq.tool_mode else None
        self.called = [False] * greq.n

    def head(self) -> list[bytes]:
        g = self.greq
        if not self.chat:
            return []
        return [oai.sse(oai.chat_chunk(g.response_id, g.model, g.created, content="", role=True, index=i))
                for i in range(g.n)]

    def delta(self, d: Delta) -> list[bytes]:
        return [oai.sse(obj) for obj in self._objects(d.index, d.text, d.logprobs, d.finish_reason)]

    def usage(self, gen: Generation) -> bytes:
        g = self.greq
        return oai.sse(oai.usage_chunk(g.kind, g.response_id, g.model, g.created, gen.prompt_tokens,
                                       gen.completion_tokens, gen.cached_tokens))

    def _logprobs(self, entries):
        if not self.want_lp or entries is None:
            return None
        if self.chat:
            return oai.chat_logprobs(entries, self.token_text)
        return oai.completion_logprobs(entries, self.token_text)

    def _objects(self, i: int, text: str, entries, finish: str | None):
        rid, model, created = self.greq.response_id, self.greq.model, self.greq.created
        if not self.chat:
            if text or finish or entries:
                yield oai.completion_chunk(rid, model, created, text=text, finish_reason=finish, index=i,
                                           logprobs=self._logprobs(entries))
            return
        calls = []
        if self.tools is not None:
            text, calls = self.tools[i].feed(text)
            if finish:
                more, more_calls = self.tools[i].close()
                text, calls = text + more, calls + more_calls
        if text or entries:
            yield oai.chat_chunk(rid, model, created, content=text, index=i, logprobs=self._logprobs(entries))
        if calls:
            self.called[i] = True
            yield oai.chat_chunk(rid, model, created, index=i, tool_calls=[
                {"index": k, "id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                for k, cid, name, args in calls])
        if finish:
            if self.called[i] and finish == "stop":
                finish = "tool_calls"
            yield oai.chat_chunk(rid, model, created, index=i, finish_reason=finish)


class LoraHandler:
    """TorchServe-style handler of one replica: base model + engine + tiered adapter cache, and the
    path of every completion (preprocess, admit, inference, postprocess or stream)."""

    def __init__(self):
        self.initialized = False
        self.draining = False  # set by the replica's preStop drain: `admit` refuses from then on
        self.context: HandlerContext | None = None
        self.engine: Engine | None = None
        self.cache: AdapterCache | None = None
        self.metrics: ReplicaMetrics | None = None
        self.base_model_hash = ""
        self.base_config: dict = {}
        self.models: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.events: LoopInbox | None = None  # engine events to the loop, one wake-up per batch
        self._inflight: dict[str, Generation] = {}
        self._waiting_for_adapter = 0
        self._tasks: set[asyncio.Task] = set()
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}
        self.grammar_pool: GrammarPool | None = None  # started in `start`
        self.grammar_builder: constrained.GrammarBuilder | None = None
        self.grammar_cache: constrained.GrammarCache | None = None
        self._grammar_inflight: dict[tuple[str, str], _SharedCompile] = {}  # by (tenant, schema key)
        self._grammar_refused: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self.grammar_failures = 0  # parser limits hit mid-generation
        self._prep: FairThreadPool | None = None  # threads that parse/tokenize large bodies (serving.prep)
        self.token_bound: TokenBound | None = None  # lower bounds of a prompt's tokens (refused before tokenizing)

    # -- lifecycle --------------------------------------------------------------------------

    def initialize(self, context: HandlerContext) -> None:
        """Load the base (and merge an adapter into it in merged mode), hash it, start the engine."""
        self.context = context
        self.metrics = context.metrics or ReplicaMetrics(context.replica_id, context.model_name)
        context.metrics = self.metrics
        self.metrics.watch_grammar(self)
        self.metrics.watch_prefix_cache(self)
        self.metrics.watch_speculation(self)
        if not getattr(self.metrics, "_fair_queues_watched", False):  # per-tenant queue depths
            self.metrics.registry.register(FairQueuesCollector(self))
            self.metrics._fair_queues_watched = True
        self.metrics.watch_tenants(self)
        self.base_config = read_base_config(context.model_dir)
        self.base_model_hash = base_model_hash(context.model_dir)
        rank_limit = context.limits.rank_limit
        pools = context.rank_pools or {r: context.slots for r in DEFAULT_RANK_POOLS if r <= rank_limit}
        if not pools:
            pools = {rank_limit: context.slots}
        merged = self._merged_adapter(context) if context.merged_adapter else None
        self.engine = Engine(context.model_dir, context.engine.replace(
            rank_pools=pools, cache_key=self.base_model_hash, merged_adapter=merged,
            kv_cache_bytes=context.engine.kv_cache_bytes or None))  # 0, as None: the engine sizes it
        self.models = [context.merged_adapter] if context.merged_adapter else [context.model_name]
        self.engine.start()
        self.initialized = True
        log.info("replica %s: base %s (%s), %s", context.replica_id, context.model_name, self.base_model_hash,
                 f"merged adapter {context.merged_adapter}" if context.merged_adapter else f"rank pools {pools}")

    def _merged_adapter(self, context: HandlerContext) -> MergedAdapter:
        """Merged mode: the verified adapter folder (fetched and verified by the app) -> MergedAdapter,
        its tensors checked against the base's shapes first."""
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
        """Async part of start-up (on the serving loop): the adapter cache, the grammar workers."""
        ctx = self.context
        assert ctx is not None and self.engine is not None
        self._loop = asyncio.get_running_loop()
        self.events = LoopInbox(self._loop)
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
        """The grammar worker pool, the matcher-build threads, the byte-bounded cache (handler.grammar.pool),
        and the threads that parse and tokenize large bodies, fair by tenant (handler.serving.prep)."""
        lim = self.context.limits
        vocab = int(self.engine.config.vocab_size)
        self._prep = prep_pool(lim).start()
        self.token_bound = await asyncio.to_thread(TokenBound.of, self.engine.tokenizer)
        self.grammar_cache = constrained.GrammarCache(lim.grammar_cache_bytes)
        try:
            spec = await asyncio.to_thread(constrained.tokenizer_spec, self.engine.tokenizer, vocab)
        except Exception as e:  # not a fast tokenizer: constrained decoding is refused (400), the rest serves
            log.warning("no constrained decoding on this replica: %s", e)
            return
        self.grammar_builder = constrained.GrammarBuilder(self.engine.tokenizer, vocab, nice=self.context.load_nice,
                                                          threads=lim.grammar_workers)
        await asyncio.to_thread(self.grammar_builder.start)
        self.grammar_pool = GrammarPool(spec, workers=lim.grammar_workers, timeout_s=lim.grammar_timeout_s,
                                        memory_bytes=lim.grammar_memory_bytes, max_waiting=lim.grammar_max_waiting,
                                        tenant_waiting=lim.grammar_tenant_waiting)
        await self.grammar_pool.start(wait=False)  # the replica is ready before its grammar workers are

    async def shutdown(self) -> None:
        for gen in list(self._inflight.values()):
            for eid in gen._engine_open:
                self.engine.cancel(eid)
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
            self._prep.close()

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

    async def preprocess(self, kind: str, body: bytes | dict | Any, tenant: str | None = None,
                         model_name: str | None = None) -> GenerationRequest:
        """Validate the body, resolve the model (404 when unknown), tokenize, check the limits, and
        compile the grammar (in a worker process: handler.grammar.pool). `tenant` (the router's
        x-lorafarm-tenant; default the model) is whose share of the grammar cache it uses;
        `model_name` (the router's x-lorafarm-model-name: the alias the client asked for) is the model
        the answer names. Nothing here that can take long runs on the event loop: a large body is
        tokenized (chat template, tool prompt, tokenizer) on a thread; a grammar compiles in a worker
        process, and its matcher is built on a thread that does not hold the GIL. The threads and the
        grammar workers are shared fairly by tenant (handler.serving.prep, handler.grammar.pool): 429
        prep_queue_full / grammar_queue_full when this tenant has too much of its own work waiting."""
        lim = self.context.limits
        model_cls = oai.ChatCompletionRequest if kind == "chat" else oai.CompletionRequest
        size = len(body) if isinstance(body, (bytes, bytearray, str)) else 0
        big = size > lim.prep_inline_bytes and self._prep is not None
        flow = tenant or "-"  # whose turn a large body's prep work takes
        if isinstance(body, model_cls):
            req = body
        elif big:
            req = await self._off_loop(flow, size, oai.parse_request, model_cls, body)
        else:
            req = oai.parse_request(model_cls, body)
        if not big:
            self._refuse_grammar_early(kind, req, tenant or req.model)
        adapter_id = await self.resolve_model(req.model)
        tier = "gpu" if (adapter_id is None or self.context.merged_adapter) else self.cache.tier_of(adapter_id)
        prompt_ids = await self._off_loop(flow, size, self._tokenize, kind, req) if big else self._tokenize(kind, req)
        max_tokens = self._max_tokens(kind, req, len(prompt_ids))
        rid = f"{self.context.replica_id}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        echo = model_name if model_name and len(model_name) <= 256 and model_name.isprintable() else None
        return GenerationRequest(
            kind=kind, body=req, model=echo or req.model, adapter_id=adapter_id, prompt_ids=prompt_ids,
            max_tokens=max_tokens, stop=req.stop_list, stream=req.stream, include_usage=req.include_usage,
            tier=tier, request_id=rid, response_id=oai.new_id(kind), created=oai.now(), n=req.n,
            grammar=await self._grammar(kind, req, tenant or req.model,
                                        big=size if size > lim.prep_inline_bytes else 0),
            tool_mode=req.tool_mode if kind == "chat" else None, tenant=tenant)

    def _max_tokens(self, kind: str, req, n_prompt: int) -> int:
        """The request's max_tokens (the default: what the context leaves, up to the limit), checked
        against the model's context (400 context_length_exceeded)."""
        max_ctx = int(self.engine.max_context)
        if n_prompt == 0:
            raise oai.bad_request("The prompt is empty.", param="prompt", code="invalid_value")
        if n_prompt >= max_ctx:
            raise _prompt_too_long(kind, max_ctx, n_prompt)
        max_tokens = oai.effective_max_tokens(req.max_tokens, default=self.context.limits.default_max_tokens)
        if req.max_tokens is None:  # the default, capped to what the context leaves; a sent limit must fit
            return min(max_tokens, max_ctx - n_prompt)
        if n_prompt + max_tokens > max_ctx:
            raise oai.bad_request(
                f"This model's maximum context length is {max_ctx} tokens. However, you requested "
                f"{n_prompt + req.max_tokens} tokens ({n_prompt} in the prompt, {req.max_tokens} for the "
                f"completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        return req.max_tokens

    def admit(self, greq: GenerationRequest) -> None:
        """Shed before accepting (issue 26), every rule in one place: 503 not_ready once draining
        (requests in flight finish); 429 queue_full above the waiting-queue cap (waiting for an
        adapter or for a batch place); 503 overloaded with Retry-After when the engine's remaining
        work (unprefilled prompt + tokens still to generate, waiting and running) plus this request's
        passes `Limits.max_queued_tokens` (a lone request is always admitted). The router fails these
        over to another replica, or hands the client the status and its Retry-After.

        Both bounds are shared fairly by tenant (issue 35, `handler.serving.shedding.fair_admits`):
        past a bound a tenant is still admitted while what it holds, this request included, fits its
        share (the bound / the tenants holding some of it), and one holding nothing is admitted; never
        past twice the bound. So one tenant filling the queue or the token bound has its own further
        requests refused, never another tenant's; a tenant alone sheds exactly as before."""
        lim = self.context.limits
        if self.draining:
            raise not_ready()
        st = self.engine.stats()
        load: _TenantLoad | None = None  # per-tenant counts, only once a bound is reached
        waiting = self._waiting_for_adapter + int(st.waiting)
        if waiting >= lim.max_waiting:
            load = self._tenant_load()
            if not fair_admits(waiting, load.waiting, greq.tenant, lim.max_waiting):
                raise oai.OpenAIError(429, "The replica's waiting queue is full; retry shortly.", type="rate_limit_error",
                                      code="queue_full", headers={"Retry-After": "1"})
        queued = int(st.tokens_in_flight)
        cost = len(greq.prompt_ids) + int(greq.max_tokens or 0) * int(greq.n or 1)
        if lim.max_queued_tokens > 0 and queued and queued + cost > lim.max_queued_tokens:
            load = load or self._tenant_load()
            if not fair_admits(queued, load.tokens, greq.tenant, lim.max_queued_tokens, add=cost):
                raise oai.OpenAIError(
                    503, f"The replica is overloaded ({queued} tokens of work queued, limit "
                    f"{lim.max_queued_tokens}); retry shortly.", type="server_error", code="overloaded",
                    headers={"Retry-After": str(lim.shed_retry_after_s)})

    def _tenant_load(self) -> _TenantLoad:
        """Per tenant (`GenerationRequest.tenant`), for `admit`'s fair share: its waiting count (its
        requests waiting for their adapter + its engine rows waiting for a batch place, as the global
        count) and its queued tokens of work (per live choice: the prompt until its first token, plus
        the tokens it may still generate; the engine's own count is exact only globally)."""
        load = _TenantLoad(collections.Counter(), collections.Counter())
        for a in self.engine.tenant_stats().active:
            if a.waiting > 0:
                load.waiting[a.client] += int(a.waiting)
        for gen in list(self._inflight.values()):
            g = gen.greq
            if gen._done or gen.error is not None:
                continue
            if not gen._admission.done() and not gen._holds_adapter and self._uses_cache(g):
                load.waiting[g.tenant] += 1
            left = sum(max(0, int(g.max_tokens or 0) - c.completion_tokens)
                       + (len(g.prompt_ids) if c.completion_tokens == 0 else 0)
                       for c in gen.choices if not c.done)
            if left:
                load.tokens[g.tenant] += left
        return load

    def inference(self, greq: GenerationRequest) -> Generation:
        """Start the request: its `Generation` takes the adapter (loading it if cold) and submits the
        n choices to the engine, in the background; its iterator (or `admitted`) raises an OpenAIError
        when the adapter cannot be loaded or the engine refuses."""
        gen = Generation(self, greq)
        self._inflight[greq.request_id] = gen
        return gen

    async def postprocess(self, greq: GenerationRequest, gen: Generation) -> dict:
        """Drain a generation into an OpenAI (chat) completion object with its n choices."""
        async for _ in gen:
            pass
        choices = [self.choice_object(greq, i, c.text, c.finish_reason or "stop", c.logprobs)
                   for i, c in enumerate(gen.choices)]
        build = oai.chat_completion if greq.kind == "chat" else oai.completion
        return build(greq.response_id, greq.model, choices, gen.prompt_tokens, gen.completion_tokens,
                     created=greq.created, cached_tokens=gen.cached_tokens)

    async def stream(self, greq: GenerationRequest, gen: Generation) -> AsyncIterator[bytes]:
        """The SSE body of a streamed request (`SSEChunks`), then [DONE]. While the request waits
        (its adapter, the engine's queue, prefill or a slow step) a `: keep-alive` comment goes out
        every `Limits.stream_keepalive_s`; an error once the stream is committed is an error event.
        The generation is abandoned when the stream ends early (the client left)."""
        sse = SSEChunks(greq, self.token_text)
        try:
            for chunk in sse.head():
                yield chunk
            async for d in gen.deltas(self.context.limits.stream_keepalive_s):
                if d is None:
                    yield KEEPALIVE
                    continue
                for chunk in sse.delta(d):
                    yield chunk
            if greq.include_usage:
                yield sse.usage(gen)
            yield oai.SSE_DONE
        except oai.OpenAIError as e:
            yield oai.sse_error(e)
            yield oai.SSE_DONE
        finally:
            gen.abandon()  # no-op when it finished; cancels the request when the client left

    async def handle(self, data: list[dict], context: Any = None, kind: str = "chat") -> list[dict]:
        """TorchServe's entry point: a batch of request bodies -> a list of responses (errors become
        OpenAI error objects in their place, so one bad request never fails the batch)."""

        async def one(body):
            try:
                greq = await self.preprocess(kind, body)
                self.admit(greq)
                return await self.postprocess(greq, self.inference(greq))
            except oai.OpenAIError as e:
                return e.body()

        return list(await asyncio.gather(*(one(b) for b in data)))

    # -- preprocess: the model, the prompt, the grammar --------------------------------------

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
        """The prompt's token ids; a prompt provably past the context is refused (400
        context_length_exceeded) before it is tokenized whole (handler.serving.prep.TokenBound)."""
        tok = self.engine.tokenizer
        if kind == "chat":
            messages, kw = render_messages(tok, req)
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
            except Exception as e:
                raise oai.bad_request(f"The messages cannot be formatted with the chat template: {e}",
                                      param="messages") from None
            self._check_bound(kind, text, False)
            return list(tok.encode(text, add_special_tokens=False))
        ids = req.prompt_token_ids()
        if ids is not None:
            vocab = int(getattr(self.engine.config, "vocab_size", 0) or 0)
            if vocab and any(i < 0 or i >= vocab for i in ids):
                raise oai.bad_request("prompt token ids out of the vocabulary", param="prompt")
            return ids
        text = req.prompt_text()
        self._check_bound(kind, text, True)
        return list(tok.encode(text, add_special_tokens=True))

    def _check_bound(self, kind: str, text: str, add_special_tokens: bool) -> None:
        if self.token_bound is None:
            return
        max_ctx = int(self.engine.max_context)
        least = self.token_bound.least_tokens(text, max_ctx, add_special_tokens)
        if least is not None and least >= max_ctx:
            self.token_bound.refused += 1
            raise _prompt_too_long(kind, max_ctx, least, at_least=True)

    async def _off_loop(self, tenant: str, cost: int, fn, *args):
        """`fn(*args)` on a prep thread in `tenant`'s turn (deficit round robin by `cost` bytes); 429
        prep_queue_full when the tenant already has its share of prep work waiting."""
        try:
            return await self._prep.run(tenant, cost, fn, *args)
        except QueueFull:
            raise oai.OpenAIError(429, "Too many of your large requests are waiting to be prepared; retry shortly.",
                                  type="rate_limit_error", code="prep_queue_full",
                                  headers={"Retry-After": "1"}) from None

    def _grammar_job(self, kind: str, req) -> tuple[dict, str] | None:
        """The grammar work a request asks for (the job for a worker, and the parameter it came
        from), None for free text."""
        if kind != "chat":
            return None
        if req.tool_mode is not None:
            return {"kind": "tools", "tools": [t.model_dump(exclude_none=True) for t in req.tools],
                    "choice": req.tool_mode, "parallel": req.parallel_tool_calls is not False}, "tools"
        if req.response_format is not None and req.response_format.type == "json_object":
            return {"kind": "json_object"}, "response_format"
        if req.response_format is not None and req.response_format.type == "json_schema":
            return {"kind": "json_schema", "schema": req.response_format.json_schema.schema_}, "response_format"
        return None

    def _refuse_grammar_early(self, kind: str, req, tenant: str) -> None:
        """429 grammar_queue_full before the prompt is tokenized, when this tenant's grammar queue is
        full and the request's grammar is neither compiled nor being compiled for it: the same answer
        `_grammar` would give after the tokenizing. A flood of new schemas (issue 35, attack 3: ~110
        refusals a second) then costs the serving loop a parse and a hash each, not a chat template."""
        pool = self.grammar_pool
        if pool is None or pool.admits(tenant):
            return
        found = self._grammar_job(kind, req)
        if found is None:
            return
        _raw, key = _job_key(found[0])
        if (self.grammar_cache.get(key) is None and key not in self._grammar_refused
                and (tenant, key) not in self._grammar_inflight):
            pool.count_busy()
            raise _grammar_busy()

    async def _grammar(self, kind: str, req, tenant: str, big: int = 0):
        """The compiled grammar that constrains the answer (json_object / json_schema / tool calls),
        None for free text. Compiled and test-run in a worker process (handler.grammar.pool), its
        matcher built off the loop, cached by bytes per tenant; identical concurrent requests of one
        tenant share one compile (never another tenant's: no request waits in another tenant's
        queue), and a refused grammar is remembered (a poison schema kills at most one worker). A
        compile whose requests all went away is cancelled. `big`: the body's size when it is large
        (its schema is hashed on a prep thread). 400 invalid_schema when a limit is hit or it cannot
        be enforced; 429 when the tenant has too many compiles waiting."""
        found = self._grammar_job(kind, req)
        if found is None:
            return None
        job, param = found
        if self.grammar_pool is None:
            raise oai.bad_request(f"Invalid {param}: constrained decoding is not available for this model.",
                                  param=param, code="invalid_schema")
        # a large schema's canonical JSON and hash (and its encoding for the worker) off the loop
        if big and self._prep is not None:
            raw, key = await self._off_loop(tenant, big, _job_key, job)
        else:
            raw, key = _job_key(job)
        refused = self._grammar_refused.get(key)
        if refused is not None:
            raise oai.bad_request(f"Invalid {param}: {refused[0]}", param=param, code="invalid_schema")
        hit = self.grammar_cache.get(key)
        if hit is not None:
            return hit
        shared = self._grammar_inflight.get((tenant, key))
        if shared is None:
            shared = _SharedCompile(asyncio.ensure_future(self._compile_grammar(key, raw, tenant)))
            self._grammar_inflight[(tenant, key)] = shared
            shared.task.add_done_callback(lambda f, k=(tenant, key), s=shared: self._end_compile(k, s))
            shared.task.add_done_callback(lambda f: f.cancelled() or f.exception())
        shared.requests += 1
        try:
            return await asyncio.shield(shared.task)  # one requester leaving does not stop the others'
        except GrammarError as e:
            raise oai.bad_request(f"Invalid {param}: {e}", param=param, code="invalid_schema") from None
        except (GrammarBusy, QueueFull):
            raise _grammar_busy() from None
        finally:
            shared.requests -= 1
            if shared.requests <= 0 and not shared.task.done():  # every requester went away: stop it
                shared.task.cancel()
                self._end_compile((tenant, key), shared)

    def _end_compile(self, key: tuple[str, str], shared: _SharedCompile) -> None:
        if self._grammar_inflight.get(key) is shared:
            del self._grammar_inflight[key]

    async def _compile_grammar(self, key: str, job: bytes, tenant: str):
        try:
            res = await self.grammar_pool.compile(job, tenant)
            try:
                compiled = await self.grammar_builder.build(res.grammar, res.cost, tenant, res.compile_s)
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

    # -- inference and postprocess: the engine's parameters, the answer's objects --------------

    def _uses_cache(self, greq: GenerationRequest) -> bool:
        return greq.adapter_id is not None and not self.context.merged_adapter

    def waiting(self) -> int:
        return self._waiting_for_adapter + int(self.engine.stats().waiting)

    @staticmethod
    def sampling_params(greq: GenerationRequest, index: int = 0) -> SamplingParams:
        """The engine parameters of choice `index`: choice i of a seeded request is seeded seed + i,
        so the n choices differ and each is reproducible."""
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
        content, calls = parse_tool_calls(text)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        tool_calls = oai.tool_calls_obj([(oai.new_call_id(), name, args) for name, args in calls])
        return oai.chat_choice(i, content, finish_reason, tool_calls=tool_calls, logprobs=lp)

    # -- state ------------------------------------------------------------------------------

    def state(self) -> ReplicaState:
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
        self.metrics.decode_steps_c.set(st.decode_step_c)


@dataclass
class _TenantLoad:
    """What each tenant holds of `admit`'s two bounds (`LoraHandler._tenant_load`)."""

    waiting: collections.Counter  # tenant -> requests/rows waiting (adapter, batch place)
    tokens: collections.Counter  # tenant -> queued tokens of work (estimate)


class _SharedCompile:
    """One tenant's compile of one grammar, shared by that tenant's identical concurrent requests."""

    __slots__ = ("task", "requests")

    def __init__(self, task: asyncio.Future):
        self.task = task
        self.requests = 0  # requests awaiting it: at 0 (all went away) it is cancelled


def _prompt_too_long(kind: str, max_ctx: int, n_prompt: int, at_least: bool = False) -> oai.OpenAIError:
    """400 context_length_exceeded for a prompt of `n_prompt` tokens (`at_least`: a lower bound, the
    prompt was refused before it was tokenized whole)."""
    return oai.bad_request(
        f"This model's maximum context length is {max_ctx} tokens. However, your prompt has "
        f"{'at least ' if at_least else ''}{n_prompt} tokens.", param="messages" if kind == "chat" else "prompt",
        code="context_length_exceeded")


def _grammar_busy() -> oai.OpenAIError:
    return oai.OpenAIError(429, "Too many of your grammars are waiting to be compiled; retry shortly.",
                           type="rate_limit_error", code="grammar_queue_full", headers={"Retry-After": "1"})


def _job_key(job: dict) -> tuple[bytes, str]:
    """A grammar job's canonical JSON (what the worker gets) and its hash (the cache key)."""
    raw = json.dumps(job, sort_keys=True, separators=(",", ":")).encode()
    return raw, hashlib.sha256(raw).hexdigest()


def not_ready() -> oai.OpenAIError:
    """503 not_ready: the replica is starting or draining (the router fails over and retries later)."""
    return oai.OpenAIError(503, "The replica is starting.", type="server_error", code="not_ready",
                           headers={"Retry-After": "1"})


def load_error_to_openai(e: AdapterLoadError) -> oai.OpenAIError:
    """A refused or failed adapter load, as an OpenAI error: 422 when the adapter itself is refused
    (verification), 503 when the failure may be transient (store, network)."""
    refused = e.code in ("bad_signature", "checksum_mismatch", "base_mismatch", "rank_limit",
                         "invalid_adapter", "unsafe_archive", "corrupt_archive", "invalid_archive")
    status = 422 if refused else 503
    return oai.OpenAIError(status, str(e), type="invalid_request_error" if refused else "server_error",
                           param="model", code=f"adapter_{e.code}")
