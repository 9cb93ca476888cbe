"""The scheduler: which requests are in the batch, what KV cache they hold, and what one step computes.

Owns the live requests and their queues (waiting -> prefilling -> running), admission, KV block
growth and preemption, and the plan of one step (`StepPlan`: prefill chunks and decode rows). The
policy, step by step (`Engine` module docstring for the whole story):

- Admission, first come first served, by what fits now: the head of the waiting queue joins the
  batch when the batch has a free row and the KV cache has the blocks of its prompt (not prompt +
  max_tokens; `kv_reserve="max_tokens"` reserves both, for comparison); the first request that does
  not fit stops admission, nothing behind it overtakes it (`_next_to_admit`).
- With the prefix cache, a request starts from the longest run of cached full blocks of its chain
  (batch-invariant: whole prefill chunks only) and may copy the head of its next block from a cached
  sibling; a request whose next block an earlier admitted request is computing is deferred until
  that block is published (`_cached_prefix`).
- Before a step every decode row gets the block its next token needs, oldest first; while the pool
  is empty the youngest admitted request is preempted by recompute (`_choose_victim`, `_preempt`).
- Prefill chunks: prompts in admission order within `max_prefill_tokens` per step (a long prompt is
  split); batch-invariant, chunks at fixed offsets (multiples of max_prefill_tokens), whole or not at
  all (`_fixed_offset_chunks`). Decode rows: every running request, ordered by adapter slot.

Every method runs under the engine's lock (the caller holds it).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from handler.engine.request import Request
from handler.model.kvcache import KVCache
from handler.model.prefix_cache import chain_hashes, chain_root

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """What one step computes: prompt chunks (request, tokens), then one decode row per request."""

    prefill: list[tuple[Request, int]]
    decode: list[Request]  # ordered by adapter slot: one adapter's rows sit together

    @property
    def requests(self) -> list[Request]:
        return [r for r, _ in self.prefill] + self.decode


class Scheduler:
    """The queues and the policy (module docstring). The policy's choices go through `_next_to_admit`
    (which waiting request admission considers next) and `_choose_victim` (which admitted request a
    full pool preempts); another policy replaces those two."""

    def __init__(self, kv: KVCache, *, max_batch: int, max_prefill_tokens: int, kv_reserve: str,
                 batch_invariant: bool, cache_key: str):
        self.kv, self.max_batch, self.max_prefill_tokens = kv, max_batch, max_prefill_tokens
        self.cache_key = cache_key
        self.requests: dict[str, Request] = {}  # every live request, by id
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.in_forward: set[str] = set()  # ids of the requests in the forward pass now
        self.steps = self.prompt_tokens = self.preemptions = 0
        self.prefix_queries = self.prefix_hits = 0
        self.deferred = 0  # admissions put off a step for a prefix block another request was computing
        # the mode's choices, made once
        self._reserve_max_tokens = kv_reserve == "max_tokens"
        # batch-invariant prefill cuts prompts at multiples of max_prefill_tokens: a cache hit keeps
        # that cut (and so the bits of every later token) only when it ends on one
        per_chunk, rest = divmod(max_prefill_tokens, kv.block_size)
        self._hit_unit = (per_chunk if per_chunk and not rest else 1 << 62) if batch_invariant else 1
        self._share_heads = not batch_invariant  # a hit covers whole prefill chunks there
        self._chunks = self._fixed_offset_chunks if batch_invariant else self._budget_chunks

    # ------------------------------------------------------------------------------- requests

    def add(self, req: Request) -> None:
        self.requests[req.id] = req
        self.waiting.append(req)

    def withdraw(self, req: Request) -> bool:
        """Cancel: mark it and take it out of the queue. False while it is in the forward pass (the
        step finishes it right after); True when the caller finishes it now."""
        req.cancelled = True
        if req.id in self.in_forward:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        return True

    def retire(self, req: Request) -> None:
        """Remove a finished request everywhere and free its cache."""
        self.requests.pop(req.id, None)
        if req in self.prefilling:
            self.prefilling.remove(req)
        elif req in self.running:
            self.running.remove(req)
        if req.blocks is not None:
            self.kv.free(req.blocks)
            req.blocks = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def batch_size(self) -> int:
        """Admitted requests, prefilling or decoding."""
        return len(self.prefilling) + len(self.running)

    def tokens_in_flight(self) -> int:
        return sum(r.remaining() for r in self.requests.values())

    # ------------------------------------------------------------------------------- one step

    def plan(self) -> StepPlan | None:
        """Grow the decode rows' blocks (preempting if need be), admit, and plan the step: None when
        there is nothing to run. Its requests are in the forward pass until `end_step`."""
        self._grow_decode_blocks()  # running rows first, then newcomers with what is left
        self._admit()
        prefill = self._chunks()
        # decode rows ordered by adapter slot: rows of one adapter sit together and a run of
        # consecutive slots is read from the stacks as a view instead of a gathered copy
        decode = sorted(self.running, key=lambda r: r.slot)
        if not prefill and not decode:
            return None
        plan = StepPlan(prefill, decode)
        self.in_forward = {r.id for r in plan.requests}
        return plan

    def end_step(self, failed: bool = False) -> None:
        self.in_forward = set()
        if not failed:
            self.steps += 1

    def prefilled(self, r: Request, n: int) -> None:
        """A prefill chunk of n tokens is computed: count it, name the blocks it completed, and move a
        complete, uncancelled context to the decode rows."""
        self.prompt_tokens += max(0, min(n, len(r.prompt) - r.prefilled))  # recompute not counted
        r.prefilled += n
        self._publish(r)
        if not r.cancelled and r.prefilled == len(r.ctx):
            self.prefilling.remove(r)
            self.running.append(r)

    def _budget_chunks(self) -> list[tuple[Request, int]]:
        """Prompts in admission order, as much of each as the step's prefill budget has left."""
        chunks, budget = [], self.max_prefill_tokens
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(len(req.ctx) - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
        return chunks

    def _fixed_offset_chunks(self) -> list[tuple[Request, int]]:
        """Batch-invariant: chunks at fixed offsets (multiples of max_prefill_tokens), whole or not at
        all: a prompt is cut the same way alone or beside others."""
        chunks, budget = [], self.max_prefill_tokens
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(len(req.ctx) - req.prefilled, self.max_prefill_tokens - req.prefilled % self.max_prefill_tokens)
            if n > budget:
                break
            chunks.append((req, n))
            budget -= n
        return chunks

    # ------------------------------------------------------------------------------- admission

    def _next_to_admit(self) -> Request:
        """The request admission considers next: the head of the queue (first come, first served)."""
        return self.waiting[0]

    def _admit(self) -> None:
        """Admit waiting requests while the batch has a free row and the cache their blocks; the first
        that does not fit (or is deferred) stops admission."""
        pending: set[bytes] | None = None  # blocks being prefilled now, not yet published
        while self.waiting and self.batch_size() < self.max_batch:
            req = self._next_to_admit()
            hit: list[int] | None = []
            if self.kv.prefix_cache:
                if pending is None:
                    pending = {h for r in self.prefilling if r.hashes for h in r.hashes[r.published :]}
                hit = self._cached_prefix(req, pending)
                if hit is None:
                    break
            if not self._place(req, hit):
                break  # the cache is full: wait for a request to finish (first come, first served)
            self.waiting.remove(req)
            self.prefilling.append(req)
            if pending is not None and req.hashes:
                pending.update(req.hashes[req.published :])

    def _cached_prefix(self, req: Request, pending: set[bytes]) -> list[int] | None:
        """The cached full blocks the request starts from (referenced), or None to defer it: its next
        block is being computed by a request admitted before it (a burst on one system prompt), so it
        waits for that block's publication, a step or so, rather than compute it again; first come,
        first served, so the queue behind it waits too."""
        bs = self.kv.block_size
        if req.hashes is None:
            req.root = chain_root(self.cache_key, req.adapter_id, req.salt)
            req.hashes = chain_hashes(req.ctx, bs, req.root)
        # full blocks only, and never the whole context: its last token is prefilled here, for the
        # logits of the next token and so that no shared block is ever written (batch-invariant:
        # whole prefill chunks only, so the rest is cut as without a hit)
        usable = req.hashes[: (len(req.ctx) - 1) // bs]
        hit = self.kv.match(usable, self._hit_unit)
        if len(hit) < len(usable) and usable[len(hit)] in pending:
            self.kv.free(hit)
            self.deferred += 1
            return None
        return hit

    def _place(self, req: Request, hit: list[int]) -> bool:
        """Give the request its blocks after its `hit` cached ones; False (nothing taken) when the
        cache does not have them."""
        bs = self.kv.block_size
        need = len(req.ctx) + (req.params.max_tokens - len(req.out) if self._reserve_max_tokens else 0)
        head = self._match_head(req, len(hit))  # referenced, so the allocation cannot evict it
        blocks = self.kv.allocate(need, have=len(hit))
        if blocks is None:
            self.kv.free(hit + ([head[0]] if head else []))
            return False
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
                self.prefix_queries += len(req.prompt)
                self.prefix_hits += req.cached
        return True

    def _match_head(self, req: Request, hit: int) -> tuple[int, int] | None:
        """(cached block, n) whose first n tokens are the next n of the request's context after its
        `hit` full cached blocks (a template's system prompt ends mid-block and the user's text
        follows: the sibling blocks of earlier requests share its head), or None where none does or
        the prefix cache is off (no hashes). Never the whole rest of the context (its last token is
        prefilled here); never in batch-invariant mode (a hit covers whole prefill chunks there)."""
        if not self._share_heads or req.hashes is None:
            return None
        bs, start = self.kv.block_size, hit * self.kv.block_size
        parent = req.hashes[hit - 1] if hit else req.root
        return self.kv.match_head(parent, req.ctx[start : min(start + bs, len(req.ctx) - 1)])

    def _publish(self, r: Request) -> None:
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

    # ------------------------------------------------------------------------------- KV growth

    def _grow_decode_blocks(self) -> None:
        """Give every decode row the block its next token needs, oldest first, preempting while the
        pool is empty."""
        for r in sorted(self.running, key=lambda q: q.arrival):
            if r not in self.running:
                continue  # preempted below for an older row
            need = len(r.prompt) + len(r.out)  # positions 0 .. len - 1 are written once this step ends
            while not self.kv.grow(r.blocks, need):
                victim = self._choose_victim()
                self._preempt(victim)
                if victim is r:
                    break

    def _choose_victim(self) -> Request:
        """The request preempted when the pool is empty: the youngest admitted. The oldest can always
        take the whole cache (prompt + max_tokens <= max_context <= the cache), so something always
        advances."""
        return max(self.prefilling + self.running, key=lambda q: q.arrival)

    def _preempt(self, r: Request) -> None:
        """Free a request's cache and put it back at the head of the queue, to be recomputed."""
        if r in self.prefilling:
            self.prefilling.remove(r)
        else:
            self.running.remove(r)
        self.kv.free(r.blocks)
        r.blocks = None
        r.ctx = r.prompt + r.out
        r.prefilled = 0
        r.hashes = None  # ctx changed: hashed again at readmission
        self.waiting.appendleft(r)
        self.preemptions += 1
        log.info("preempted request %s (%d tokens to recompute): KV cache full", r.id, len(r.ctx))
