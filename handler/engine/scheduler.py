"""The scheduler: which requests are in the batch, what KV cache they hold, and what one step computes.

Owns the live requests and their queues (waiting -> prefilling -> running), admission, KV block
growth and preemption, and the plan of one step (`StepPlan`: prefill chunks and decode rows). The
choices between tenants are the fairness policy's (`handler.engine.fairness.FairPolicy`, the
contract: the Virtual Token Counter and a share of rows per tenant); `scheduling="fifo"` keeps the
first come, first served order for comparison (the policy then only counts). Step by step
(`Engine` module docstring for the whole story):

- Admission, by what fits now: a waiting request joins the batch when the batch has a free row and
  the KV cache has the blocks of its prompt (not prompt + max_tokens; `kv_reserve="max_tokens"`
  reserves both, for comparison). Which request (`_next_to_admit`): fair, the head (FIFO within a
  tenant) of the backlogged tenant with the least counter; fifo, the head of the queue. The request
  chosen that does not fit stops admission: nothing overtakes it.
- Share preemption (fair): no free row for a tenant that waits below its guaranteed rows -> the
  youngest request of the tenant most over its share is parked (`_share_victim`, `_park`: it keeps
  its KV blocks and resumes where it stopped, `_resume`); no KV room for it -> parked blocks are
  freed first (`_release_parked`), then rows over a share preempted by recompute (`_make_room`).
- With the prefix cache, a request starts from the longest run of cached full blocks of its chain
  (batch-invariant: whole prefill chunks only) and may copy the head of its next block from a cached
  sibling; a request whose next block an earlier admitted request is computing is deferred until
  that block is published (`_cached_prefix`): fifo, the queue behind it waits too; fair, only its
  tenant is passed over for the step (the block is its own tenant's: the chain is salted by tenant).
- Before a step every decode row gets the block its next token needs, oldest first; while the pool
  is empty a parked request's blocks are freed, then a request is preempted by recompute (`_choose_victim`): fifo, the youngest admitted;
  fair, the youngest of the tenant most over its share, never the oldest admitted while another is.
- Prefill chunks: prompts in admission order within `max_prefill_tokens` per step (a long prompt is
  split); batch-invariant, chunks at fixed offsets (multiples of max_prefill_tokens), whole or not at
  all (`_fixed_offset_chunks`). Decode rows: every running request, ordered by adapter slot; fair,
  while two or more tenants are active (and CONTENDED_LINGER_S after), at most `contended_rows` of
  them, taking turns, and in a step carrying a newcomer's short prefill only the light tenants' rows
  (`_decode_rows`).
- Accounting (both modes): each tenant is charged the prompt tokens it had prefilled (not cache
  hits, not recompute) and the tokens it generated (at the next plan, or when it ends), its
  requests' admission waits and preemptions (`FairPolicy.ledger`).

With one tenant the fair policy makes every choice fifo makes (same admissions, victims, steps).
Every method runs under the engine's lock (the caller holds it).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

from handler.engine.fairness import W_DECODE, W_PREFILL, FairPolicy
from handler.engine.request import Request
from handler.model.kvcache import KVCache
from handler.model.prefix_cache import chain_hashes, chain_root

log = logging.getLogger(__name__)

# Seconds steps stay contended after the light tenant's last request ends: its next request most
# likely comes within them (a chat's next turn, a client's next call), and would otherwise arrive
# during a whole-batch step, the longest there is.
CONTENDED_LINGER_S = 2.0


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
    (which waiting request admission considers next), `_share_victim` (which admitted request gives
    its row to a tenant below its share) and `_choose_victim` (which admitted request a full pool
    preempts)."""

    def __init__(self, kv: KVCache, *, max_batch: int, max_prefill_tokens: int, kv_reserve: str,
                 batch_invariant: bool, cache_key: str, scheduling: str = "fair", w_prefill: float = W_PREFILL,
                 w_decode: float = W_DECODE, contended_rows: int | None = None, small_step_rows: int = 0):
        if scheduling not in ("fair", "fifo"):
            raise ValueError(f"scheduling must be 'fair' or 'fifo', not {scheduling!r}")
        self.kv, self.max_batch, self.max_prefill_tokens = kv, max_batch, max_prefill_tokens
        # fair, while two or more tenants are active: decode rows per step (rotating), None: max_batch
        self.contended_rows = max_batch if contended_rows is None else max(1, min(int(contended_rows), max_batch))
        # rows (prompt tokens + decode rows) of a step the executor runs fast (the C decode step's
        # prefill steps): a newcomer's short prefill is given such a step while tenants contend; 0: never
        self.small_step_rows = int(small_step_rows)
        self.clock = time.monotonic
        self._contended_until = 0.0  # steps stay contended until then (CONTENDED_LINGER_S)
        self.cache_key = cache_key
        self.scheduling, self.fair = scheduling, scheduling == "fair"
        self.policy = FairPolicy(max_batch, w_prefill=w_prefill, w_decode=w_decode)
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
        self.policy.arrive(req.tenant, req.weight)
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
        """Remove a finished request everywhere, free its cache, and charge its tenant the rest."""
        live = self.requests.pop(req.id, None) is not None
        admitted = True
        if req in self.prefilling:
            self.prefilling.remove(req)
        elif req in self.running:
            self.running.remove(req)
        else:
            admitted = False
            if live and req in self.waiting:  # not withdrawn first: leave the queue too
                self.waiting.remove(req)
        if req.blocks is not None:
            self.kv.free(req.blocks)
            req.blocks = None
        if live:
            self._charge_out(req)
            self.policy.leave(req.tenant, admitted)

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
        for r in self.running:  # the tokens generated since the last plan, charged to their tenants
            if len(r.out) != r.charged_out:
                self._charge_out(r)
        self._grow_decode_blocks()  # running rows first, then newcomers with what is left
        self._admit()
        prefill = self._chunks()
        decode = self._decode_rows(prefill)
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
        upto = min(r.prefilled + n, len(r.prompt))
        if upto > r.charged_prompt:  # prompt positions computed for the first time (not hits, not recompute)
            self.policy.charge(r.tenant, prefill=upto - max(r.prefilled, r.charged_prompt))
            r.charged_prompt = upto
        r.prefilled += n
        self._publish(r)
        if not r.cancelled and r.prefilled == len(r.ctx):
            self.prefilling.remove(r)
            self.running.append(r)

    def _decode_rows(self, prefill: list[tuple[Request, int]]) -> list[Request]:
        """The running requests this step decodes, ordered by adapter slot (rows of one adapter sit
        together and a run of consecutive slots is read from the stacks as a view instead of a
        gathered copy). Fair, with two or more tenants active and one of them below its guaranteed
        rows (a light tenant beside a heavy one), so that a step the light one waits on stays short:
        at most `contended_rows` (`_rotated_rows`); and a step that carries a short prefill of a
        tenant below its share (a newcomer waiting for its first token) decodes only the rows of
        tenants below their share, within `small_step_rows` in all: its first token then waits for
        its own prefill, as it does alone, not for another tenant's rows beside it."""
        rows = self.running
        if self.fair and len(self.policy.clients) > 1 and self.policy.any_below_share():
            self._contended_until = self.clock() + CONTENDED_LINGER_S
        if self.fair and self._contended_until and self.clock() < self._contended_until:
            k = self.contended_rows
            prompt = sum(n for _, n in prefill)
            if 0 < prompt < self.small_step_rows and any(self.policy.below_share(r.tenant) for r, _ in prefill):
                rows = [r for r in rows if self.policy.below_share(r.tenant)]
                k = min(k, self.small_step_rows - prompt)
            if len(rows) > k:
                rows = self._rotated_rows(rows, k)
        rows = sorted(rows, key=lambda r: r.slot)
        for r in rows:
            r.decoded_at = self.steps
        return rows

    def _rotated_rows(self, rows: list[Request], k: int) -> list[Request]:
        """k of `rows`, split between tenants by weight (the next row goes to the tenant with the
        fewest rows picked per unit of weight; ties: the least served), each tenant's least recently
        decoded rows first: every row is decoded within a few steps, and a tenant with few rows
        (a newcomer) has all of them decoded every step."""
        queues: dict = {}
        for r in sorted(rows, key=lambda q: (q.decoded_at, q.arrival)):
            queues.setdefault(r.tenant, collections.deque()).append(r)
        clients = self.policy.clients
        weight = {t: clients[t].weight if t in clients else 1.0 for t in queues}
        counter = {t: clients[t].counter if t in clients else 0.0 for t in queues}
        taken = dict.fromkeys(queues, 0)
        picked: list[Request] = []
        while len(picked) < min(k, len(rows)):
            t = min((t for t, q in queues.items() if q), key=lambda t: (taken[t] / weight[t], counter[t]))
            picked.append(queues[t].popleft())
            taken[t] += 1
        return picked

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

    def _next_to_admit(self, skip: set, full: bool) -> Request | None:
        """The request admission considers next, or None. fifo: the head of the queue (None once the
        batch is full). fair: the head of the backlogged tenant with the least counter among the
        tenants not in `skip` (deferred this step): first among those below their guaranteed rows
        (when the batch is `full`, only those: they take a row from a tenant over its share)."""
        if not self.fair:
            return None if full else self.waiting[0]
        if full and len(self.policy.clients) <= 1:  # one tenant: nobody to take a row from
            return None
        heads = self._heads(skip)
        if len(heads) == 1 and not full:  # one tenant waiting: its head (first come, first served)
            return next(iter(heads.values()))
        below = [t for t in heads if self.policy.below_share(t)]
        t = self.policy.pick(below if below or full else heads)
        return None if t is None else heads[t]

    def _heads(self, skip: set) -> dict:
        """tenant -> its first waiting request, for the tenants not in `skip`, in queue order."""
        want = self.policy.waiting_clients() - sum(1 for t in skip if self.policy.clients.get(t))
        heads: dict = {}
        if want <= 0:
            return heads
        for r in self.waiting:
            t = r.tenant
            if t not in heads and t not in skip:
                heads[t] = r
                if len(heads) >= want:
                    break
        return heads

    def _admit(self) -> None:
        """Admit waiting requests while the batch has a free row (or, fair, a tenant below its share
        can take one from a tenant over it) and the cache their blocks; the chosen request that does
        not fit stops admission; one that is deferred stops it (fifo) or passes its tenant over for
        the step (fair)."""
        pending: set[bytes] | None = None  # blocks being prefilled now, not yet published
        skip: set = set()  # tenants whose head is deferred this step (fair)
        while self.waiting:
            full = self.batch_size() >= self.max_batch
            req = self._next_to_admit(skip, full)
            if req is None:
                break
            hit: list[int] | None = []
            parked = req.blocks is not None  # share-preempted earlier: resumes with its cache
            if self.kv.prefix_cache and not parked:
                if pending is None:
                    pending = {h for r in self.prefilling if r.hashes for h in r.hashes[r.published :]}
                hit = self._cached_prefix(req, pending)
                if hit is None:
                    if not self.fair:
                        break
                    skip.add(req.tenant)
                    continue
            if full:  # fair: a tenant below its share takes the row of one over it
                victim = self._share_victim(req.tenant)
                if victim is None:
                    self.kv.free(hit)
                    break
                self._park(victim)
            if parked:
                if not self._resume(req):
                    break  # its next block does not fit: wait for a request to finish
                continue
            if self.fair:
                self._make_room(req, len(hit))
            if not self._place(req, hit):
                break  # the cache is full: wait for a request to finish (nobody overtakes it)
            self.waiting.remove(req)
            self.prefilling.append(req)
            self.policy.admit(req.tenant)
            if pending is not None and req.hashes:
                pending.update(req.hashes[req.published :])

    def _share_victim(self, tenant) -> Request | None:
        """The request preempted so that `tenant`, below its guaranteed rows, gets one: the youngest
        of the tenant most over its share (None when `tenant` is not below its share or no tenant is
        over its share)."""
        if not self.policy.below_share(tenant):
            return None
        youngest = self._youngest_by_tenant(self.prefilling + self.running)
        youngest.pop(tenant, None)
        t = self.policy.most_over(youngest, strictly=True)
        return None if t is None else youngest[t]

    def _make_room(self, req: Request, have: int) -> None:
        """Fair: a request whose blocks the cache lacks takes those of parked requests (`_park`); one
        of a tenant below its share also those of the rows of tenants over their share (preempted,
        youngest of the most over first)."""
        need = self.kv.blocks_for(len(req.ctx) + (
            req.params.max_tokens - len(req.out) if self._reserve_max_tokens else 0)) - have
        while need > self.kv.free_blocks:
            if self._release_parked():
                continue
            victim = self._share_victim(req.tenant)
            if victim is None:
                return
            self._preempt(victim, "share")

    @staticmethod
    def _youngest_by_tenant(reqs: list[Request]) -> dict:
        """tenant -> its youngest request of `reqs`, tenants ordered by that request, youngest first."""
        youngest: dict = {}
        for r in reqs:
            y = youngest.get(r.tenant)
            if y is None or r.arrival > y.arrival:
                youngest[r.tenant] = r
        return dict(sorted(youngest.items(), key=lambda kv: kv[1].arrival, reverse=True))

    def _cached_prefix(self, req: Request, pending: set[bytes]) -> list[int] | None:
        """The cached full blocks the request starts from (referenced), or None to defer it: its next
        block is being computed by a request admitted before it (a burst on one system prompt), so it
        waits for that block's publication, a step or so, rather than compute it again (fifo: the
        queue behind it waits too; fair: its tenant is passed over for the step, the others go on)."""
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
            self.policy.queued(req.tenant, time.monotonic() - req.arrival)
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
                if self._release_parked():
                    continue
                victim = self._choose_victim()
                self._preempt(victim, "kv")
                if victim is r:
                    break

    def _choose_victim(self) -> Request:
        """The request preempted when the pool is empty. fifo: the youngest admitted. fair: the
        youngest of the tenant most over its share (ties: the youngest), never the oldest admitted
        while another is. The oldest can always take the whole cache (prompt + max_tokens <=
        max_context <= the cache), so something always advances."""
        admitted = self.prefilling + self.running
        if not self.fair or len(admitted) == 1:
            return max(admitted, key=lambda q: q.arrival)
        oldest = min(admitted, key=lambda q: q.arrival)
        youngest = self._youngest_by_tenant([r for r in admitted if r is not oldest])
        return youngest[self.policy.most_over(youngest)]

    def _park(self, r: Request) -> None:
        """Share preemption without recompute: the request keeps its cache and its progress and waits
        at the head of the queue; admitted again (`_resume`) when its tenant's turn comes, it goes on
        where it stopped. Its blocks are the first taken when the cache runs short (`_release_parked`:
        then it is recomputed, as `_preempt` would have had it)."""
        self._requeue(r, "share")
        log.info("parked request %s of tenant %s (keeps %d cached tokens): a tenant below its share of rows waits",
                 r.id, r.tenant, r.prefilled)

    def _resume(self, r: Request) -> bool:
        """Admit a parked request with its cache (and the block its next token needs); False, nothing
        changed, when that block does not fit."""
        decoding = r.prefilled >= len(r.ctx)
        if decoding and not self.kv.grow(r.blocks, len(r.prompt) + len(r.out)):
            return False
        self.waiting.remove(r)
        (self.running if decoding else self.prefilling).append(r)
        self.policy.admit(r.tenant)
        return True

    def _release_parked(self) -> bool:
        """Free the cache of one parked request (the youngest of the tenant most over its share), to be
        recomputed at its readmission; False when none is parked."""
        parked = [r for r in self.waiting if r.blocks is not None]
        if not parked:
            return False
        youngest = self._youngest_by_tenant(parked)
        self._drop_cache(youngest[self.policy.most_over(youngest)])
        return True

    def _preempt(self, r: Request, reason: str = "kv") -> None:
        """Free a request's cache and put it back at the head of the queue, to be recomputed."""
        self._requeue(r, reason)
        self._drop_cache(r)
        log.info("preempted request %s of tenant %s (%d tokens to recompute): %s", r.id, r.tenant, len(r.ctx),
                 "KV cache full" if reason == "kv" else "a tenant below its share of rows waits")

    def _requeue(self, r: Request, reason: str) -> None:
        """Take an admitted request out of the batch and put it back at the head of the queue."""
        if r in self.prefilling:
            self.prefilling.remove(r)
        else:
            self.running.remove(r)
        self.waiting.appendleft(r)
        self.preemptions += 1
        self.policy.requeue(r.tenant, reason)

    def _drop_cache(self, r: Request) -> None:
        """Free a request's KV blocks: it is prefilled again from its prompt and output (recompute)."""
        self.kv.free(r.blocks)
        r.blocks = None
        r.ctx = r.prompt + r.out
        r.prefilled = 0
        r.hashes = None  # ctx changed: hashed again at readmission

    def _charge_out(self, r: Request) -> None:
        """Charge the request's tenant the tokens it generated since the last charge."""
        n = len(r.out) - r.charged_out
        if n > 0:
            r.charged_out = len(r.out)
            self.policy.charge(r.tenant, decode=n)
