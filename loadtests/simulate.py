"""Fleet simulator: a discrete-event (SimPy) model of the farm that runs the real routing and cache code.

What is real and what is modelled:
- Routing is the router's own code: a `router.view.ReplicaView` fed with the routing table and each
  replica's `ReplicaState` every `poll_s` (as its poll loop does), its `acquire`/`release` of the
  router's own in-flight estimate, and `router.routing.choose()` over its `snapshot()`.
- Each replica's cache is the replica's own `handler.adapters.slots.SlotPolicy` (LRU over idle adapters,
  reference counts, RAM/disk byte budgets), driven through `acquire` / `on_loaded` / `release`.
- Owner counts follow the registry's rule (`registry.placement.add_window` + `owner_count`, with the
  registry's default settings) from the same per-adapter token counts the router pushes every
  `stats_window_s`.
- The autoscaler is the Kubernetes HPA algorithm (`loadtests.autoscale.Hpa`) on the metrics the
  ScaledObject in deploy/ reads (mean queue depth and tokens in flight per replica).
- Modelled: arrivals (Poisson, thinned for a rate curve; Zipf adapter mix and log-normal lengths with
  the shapes of `loadtests.workload`), a load from a tier as a fixed delay (the seed's 8 ms / 40 ms /
  0.4 s) through `load_concurrency` loader threads, and the engine as continuous batching in steps:
  a step takes `decode_step_s + decode_step_per_row_s x rows + prefill_tokens / prefill_tokens_per_s`
  (the seed: 50 ms per decode step of up to 32 rows, 8,000 prefill tokens/s); a request admitted in
  a step gets its first token at the step's end (TTFT = queue + adapter wait + that step) and one
  more token per step after.
- Modelled: per-tenant shared system prompts and each replica's prefix cache (`PrefixCachePolicy`,
  pure). Each adapter is one customer with one system prompt (its length log-normal around
  `system_prompt_tokens`, drawn once per adapter); a share `system_prompt_share` of requests carries
  it ahead of their own prompt. A request whose adapter's system prompt is cached on its replica
  prefills only the rest (full blocks of `prefix_block_tokens`, as the replica's paged cache reuses
  whole blocks); once its prefill step ends the prompt's blocks are cached, kept by reference while
  the request runs, evicted least recently used beyond `prefix_cache_tokens` per replica.
  `prefix_cache=False` is a replica started with --no-prefix-cache.
- Each replica's batch admission is the engine's own fairness policy (`handler.engine.fairness.
  FairPolicy`, pure, as the engine's scheduler runs it; issue 35): with `scheduling="fair"` the
  next request admitted is the head of the backlogged tenant with the least virtual token counter
  (first among the tenants below their guaranteed rows), and when the batch is full a tenant below
  its share takes the row of the youngest request of the tenant most over its share (preempted by
  recompute: back at the head of the queue, its prompt and the tokens it generated prefilled again
  when it is readmitted, its TTFT unchanged); tenants are charged the prompt tokens prefilled for
  them and one decode token per row per step. `scheduling="fifo"` admits the head of the queue.
  Tenants come from the workload: with `tenants` N > 0 adapter i belongs to tenant "t{i % N}" (the
  hot adapter to "hot"); with 0 every request is one anonymous tenant, for which both modes make
  the same choices (the policy's guarantee), so results without tenants are unchanged. A hostile
  tenant ("hostile", `hostile_rate` > 0) sends requests of `hostile_n` rows (n choices) with
  `hostile_output_tokens` each, routed as one request. Not modelled: the KV cache (no KV
  preemption: a row never fails to grow), prefix-block deferral, tenant weights (all 1).

Results exclude the first `warmup_s` seconds (adapters reach their steady tiers first).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone

import numpy as np
import simpy

from handler.adapters.slots import SlotPolicy
from handler.engine.fairness import FairPolicy
from loadtests.workload import _lognormal_int, zipf_weights
from lorafarm import capacity as cap
from lorafarm.schemas import HeldAdapter, ReplicaState
from registry import placement
from registry.settings import RegistrySettings
from router.routing import RouteRequest, ViewSnapshot, choose
from router.view import ReplicaView

BASE_HASH = "sha256:sim-base"
BASE_NAME = "sim-base"
HOT_ADAPTER = "ad-hot"
HOSTILE_ADAPTER = "ad-hostile"
HOSTILE_TENANT = "hostile"
PROMPT_SIGMA = 0.6  # log-normal shapes of loadtests.workload.generate
OUTPUT_SIGMA = 0.5
SYSTEM_SIGMA = 0.5  # of the per-adapter system prompt length (loadtests.workload's default)
TIERS = ("gpu", "ram", "disk", "remote")
SIM_EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)


@dataclass
class AutoscaleConfig:
    """HPA on external metrics (what deploy/ configures): see loadtests.autoscale."""

    min_replicas: int = 2
    max_replicas: int = 64
    target_queue_depth: float = 2.0  # mean requests waiting per replica
    target_tokens_in_flight: float = 3000.0  # mean tokens in flight per replica
    sync_s: float = 15.0
    metric_window_s: float = 60.0  # the Prometheus query's averaging window
    scale_down_window_s: float = 300.0
    scale_up_window_s: float = 0.0  # Kubernetes default (120 s was tried: worse, see docs/scale.md)
    tolerance: float = 0.1
    startup_s: float = 30.0  # pod scheduled + container started (node already up)
    base_load_s: float = 14.0  # the seed's 14 GB at 1 GB/s


@dataclass
class SimConfig:
    replicas: int = 26
    adapters: int = 5000
    rate: float = 40.0  # requests/s (peak of the rate curve when one is given)
    duration: float = 3600.0  # simulated seconds of arrivals
    warmup_s: float = 60.0
    slots: int = 250  # device slots (one rank pool of `rank`)
    rank: int = 16
    rank_pools: dict[int, int] | None = None  # several pools {rank: slots} (overrides slots/rank)
    adapter_ranks: tuple[int, ...] | None = None  # adapter i has rank adapter_ranks[i % len] (default: rank)
    routing: str = "affinity"  # affinity | random
    strategy: str = "least_tokens"
    owners_k: int = 2
    zipf_s: float = 1.1
    prompt_tokens: float = 750.0  # means (the log-normal medians are set so the means match)
    output_tokens: float = 250.0
    max_request_tokens: int = 2000
    max_batch: int = 32
    decode_step_s: float = 0.05
    decode_step_per_row_s: float = 0.0
    prefill_tokens_per_s: float = 8000.0
    load_s: dict[str, float] = field(default_factory=lambda: {"gpu": 0.0, "ram": 0.008, "disk": 0.04,
                                                              "remote": 0.4})
    load_concurrency: int = 2  # the replica's io threads
    ram_adapters: int = 385  # host RAM tier, in adapters of the fleet's size (the seed's 31 GB)
    disk_adapters: int = 2500
    adapter_bytes: int = 79_953_920
    poll_s: float = 1.0
    load_threshold_tokens: int = 32_000  # the router's overload threshold at this scale (see docs/scale.md)
    load_threshold_queue: int = 16
    stats_window_s: float = 10.0
    hot_tokens_per_s: float = 0.0  # a hot tenant's output tokens/s (0: none)
    gpu_price_per_h: float = 2.5
    seed: int = 0
    rate_curve: Callable[[float], float] | None = None  # t -> share of `rate` (0..1)
    trace: tuple | None = None  # loadtests.workload.TraceRow rows: their gaps (scaled to `rate`) and lengths
    autoscale: AutoscaleConfig | None = None
    sample_s: float = 10.0  # time series resolution
    progress: bool = False
    system_prompt_share: float = 0.0  # share of requests carrying their adapter's system prompt (0: none)
    system_prompt_tokens: float = 500.0  # mean system prompt length (per adapter, log-normal)
    prefix_cache: bool = True  # False: replicas started with --no-prefix-cache
    prefix_cache_tokens: int = 32_000  # cached prefix tokens kept per replica (half the seed's 32 x 2,000 KV)
    prefix_block_tokens: int = 16  # the replica's KV block: only whole blocks are reused
    # fair share by tenant (issue 35): the engine's batch admission (handler.engine.fairness)
    scheduling: str = "fair"  # fair | fifo (the replica's --scheduling)
    tenants: int = 0  # adapter i belongs to tenant t{i % tenants}; 0: one anonymous tenant
    hostile_rate: float = 0.0  # requests/s of a hostile tenant (0: none)
    hostile_n: int = 16  # rows (n choices) per hostile request
    hostile_prompt_tokens: int = 50
    hostile_output_tokens: int = 600

    def check(self) -> None:
        if self.replicas < 1 or self.adapters < 1 or self.rate < 0 or self.duration <= 0:
            raise ValueError("replicas and adapters must be >= 1, rate >= 0 and duration > 0")
        if self.slots < 1 or self.max_batch < 1 or self.load_concurrency < 1:
            raise ValueError("slots, max_batch and load_concurrency must be >= 1")
        if self.routing not in ("affinity", "random"):
            raise ValueError(f"routing must be affinity or random, not {self.routing!r}")
        if self.warmup_s >= self.duration:
            raise ValueError("warmup_s must be shorter than the duration")
        if not 0.0 <= self.system_prompt_share <= 1.0:
            raise ValueError("system_prompt_share must be within 0..1")
        if self.system_prompt_tokens < 1 and self.system_prompt_share > 0:
            raise ValueError("system_prompt_tokens must be >= 1")
        if self.prefix_cache_tokens < 0 or self.prefix_block_tokens < 1:
            raise ValueError("prefix_cache_tokens must be >= 0 and prefix_block_tokens >= 1")
        if self.scheduling not in ("fair", "fifo"):
            raise ValueError(f"scheduling must be fair or fifo, not {self.scheduling!r}")
        if self.tenants < 0 or self.hostile_rate < 0 or self.hostile_n < 1:
            raise ValueError("tenants and hostile_rate must be >= 0 and hostile_n >= 1")
        if self.hostile_rate > 0 and not (1 <= self.hostile_prompt_tokens and 1 <= self.hostile_output_tokens
                                          and self.hostile_prompt_tokens + self.hostile_output_tokens
                                          <= self.max_request_tokens):
            raise ValueError("hostile prompt and output tokens must be >= 1 and fit max_request_tokens")


class PrefixCachePolicy:
    """One replica's prefix cache, as a policy (pure: no clock, no simulation; tested alone).

    Entries are keyed by (adapter: one customer) and hold the whole blocks of that key's shared prefix;
    `lookup` answers how many prompt tokens are served from the cache (0 on a miss, and always when
    disabled), `insert` keeps a prefix once computed, evicting least recently used entries that no
    running request references (`pin` / `unpin`) until `capacity_tokens` hold it; a prefix that does
    not fit beside the referenced ones is not kept. Counters in prompt tokens, like the replica's
    lorafarm_prefix_cache_queries_total / _hits_total."""

    def __init__(self, capacity_tokens: int, block_tokens: int = 16, enabled: bool = True):
        if capacity_tokens < 0 or block_tokens < 1:
            raise ValueError("capacity_tokens must be >= 0 and block_tokens >= 1")
        self.capacity_tokens, self.block_tokens, self.enabled = capacity_tokens, block_tokens, enabled
        self.entries: OrderedDict[str, int] = OrderedDict()  # key -> cached tokens, least recent first
        self.refs: dict[str, int] = defaultdict(int)
        self.used_tokens = 0
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens served from the cache
        self.evictions = 0

    def blocks_of(self, tokens: int) -> int:
        """Tokens in the whole blocks of a `tokens`-long prefix (the part a cache can reuse)."""
        return tokens // self.block_tokens * self.block_tokens

    def lookup(self, key: str | None, prompt_tokens: int, prefix_tokens: int = 0) -> int:
        """Prompt tokens of this request served from the cache; counts the query (all its prompt tokens)."""
        self.queries += prompt_tokens
        if not self.enabled or key is None or key not in self.entries:
            return 0
        cached = min(self.entries[key], self.blocks_of(min(prefix_tokens, prompt_tokens)))
        self.entries.move_to_end(key)
        self.hits += cached
        return cached

    def pin(self, key: str) -> None:
        self.refs[key] += 1

    def unpin(self, key: str) -> None:
        self.refs[key] -= 1
        if self.refs[key] <= 0:
            del self.refs[key]

    def insert(self, key: str, prefix_tokens: int) -> bool:
        """Keep `key`'s prefix (whole blocks); True when it is cached afterwards."""
        size = self.blocks_of(prefix_tokens)
        if not self.enabled or size <= 0:
            return False
        have = self.entries.get(key, 0)
        if have >= size:
            self.entries.move_to_end(key)
            return True
        victims = []
        free = self.capacity_tokens - self.used_tokens + have
        for k, tokens in self.entries.items():  # least recent first
            if free >= size:
                break
            if k != key and not self.refs.get(k):
                victims.append(k)
                free += tokens
        if free < size:
            return key in self.entries  # no room beside the referenced prefixes: nothing evicted
        for k in victims:
            self.used_tokens -= self.entries.pop(k)
            self.evictions += 1
        self.used_tokens += size - have
        self.entries[key] = size
        self.entries.move_to_end(key)
        return True


class Req:
    __slots__ = ("arrival", "adapter", "rank", "prompt", "output", "est", "replica", "tier", "ttft", "hot", "system",
                 "cached", "tenant", "order", "produced", "admitted_at", "finish")

    def __init__(self, arrival: float, adapter: str, rank: int, prompt: int, output: int, hot: bool = False,
                 system: int = 0, tenant: str | None = None):
        self.arrival = arrival
        self.adapter = adapter
        self.rank = rank
        self.prompt = prompt  # all prompt tokens, the system prompt's included
        self.system = system  # of which the adapter's shared system prompt (0: none)
        self.cached = 0  # prompt tokens its replica's prefix cache served
        self.output = output
        self.est = prompt + output  # the router's cost estimate (prompt + max_tokens)
        self.replica = ""
        self.tier = ""
        self.ttft = math.nan
        self.hot = hot
        self.tenant = tenant  # whose request it is for the batch's fairness policy (None: anonymous)
        self.order = 0  # its place in its replica's queue (lower: earlier; a preempted one goes first)
        self.produced = 0  # tokens generated before its last preemption
        self.admitted_at = 0  # the replica's step count when it was (last) admitted
        self.finish = 0  # the step at whose end it has generated all its output


class SimReplica:
    """One replica: the real slot policy, loads as delays, the engine as continuous batching."""

    def __init__(self, sim: Simulation, rid: str):
        c = sim.cfg
        self.sim, self.env, self.cfg, self.rid = sim, sim.env, c, rid
        self.policy = SlotPolicy(c.rank_pools or {c.rank: c.slots}, ram_bytes=c.ram_adapters * c.adapter_bytes,
                                 disk_bytes=c.disk_adapters * c.adapter_bytes, clock=lambda: self.env.now)
        # requests ready for the batch (adapter held), one FIFO queue per tenant; `order` is the engine's
        # single queue order across them
        self.queues: dict[str | None, deque[Req]] = {}
        self.n_ready = 0
        self._order = 0
        self._front = 0  # orders below every other: a preempted request goes back at the head
        self.fair = FairPolicy(c.max_batch, clock=lambda: self.env.now)  # the engine's policy (pure)
        self.preemptions = 0
        self._owed: dict = defaultdict(int)  # decode tokens not yet charged to each tenant (`_settle`)
        self.running: list[tuple[int, int, Req]] = []  # heap of (finish step, seq, request)
        self.step = 0
        self.sum_finish = 0
        self.waiting_tokens = 0  # prompt + output of requests not yet running
        self.queued = 0  # requests arrived and not yet running (loading or batch full)
        self.joiners: dict[str, list[Req]] = defaultdict(list)
        self.slot_waiters: deque[Req] = deque()
        self.loader = simpy.Resource(self.env, capacity=c.load_concurrency)
        self.wake: simpy.Event | None = None
        self._held = {t: HeldAdapter.model_construct(tier=t, expected_load_ms=1000 * c.load_s[t])
                      for t in ("gpu", "ram", "disk")}
        self._held_sig: tuple | None = None
        self._held_state: tuple = ([], [], {})
        self.busy_time = 0.0
        self.served_tokens = 0
        self._seq = 0
        self.prefix = PrefixCachePolicy(c.prefix_cache_tokens, c.prefix_block_tokens, enabled=c.prefix_cache)
        self.env.process(self._loop())

    # -- state the router polls --------------------------------------------------------------

    def tokens_in_flight(self) -> int:
        return self.waiting_tokens + self.sum_finish - len(self.running) * self.step

    def _membership(self) -> tuple:
        c = self.policy.counters
        return (sum(c.loads.values()), c.evictions, c.ram_evictions, c.disk_evictions)

    def state(self) -> tuple[ReplicaState, bool]:
        """What `GET /internal/replicas/{id}/state` would answer (handler.LoraHandler.state), and
        whether the held adapters changed since the last call (the router's derived sets then too)."""
        p, c = self.policy, self.cfg
        sig = self._membership()
        changed = sig != self._held_sig
        if changed:
            held = {a: self._held["disk"] for a in p.resident("disk")}
            held.update((a, self._held["ram"]) for a in p.resident("ram"))
            held.update((a, self._held["gpu"]) for a in p.resident("gpu"))
            self._held_state = (p.resident("gpu"), p.resident("ram"), held)
            self._held_sig = sig
        gpu, ram, held = self._held_state
        st = ReplicaState.model_construct(
            replica_id=self.rid, base_model_hash=BASE_HASH, models=[BASE_NAME], task="generate",
            gpu_adapters=gpu, ram_adapters=ram, queue_depth=self.queued, running=len(self.running),
            tokens_in_flight=self.tokens_in_flight(), evictions_per_min=0.0, loads_per_min=0.0, kv_cache_usage=0.0,
            adapters=held, load_ms={t: 1000 * c.load_s[t] for t in ("ram", "disk", "remote")})
        return st, changed

    # -- adapters ----------------------------------------------------------------------------

    def warm(self, owned: list[str]) -> None:
        """What the replica's start-up pull leaves: owned adapters on disk and in RAM, the first
        ones mounted (idle) while their pool has free slots."""
        p, size = self.policy, self.cfg.adapter_bytes
        for aid in owned:
            p.put("disk", aid, size)
            p.put("ram", aid, size)
            rank = self.sim.rank_of(aid)
            if p.free_slots(p.pool_for(rank)) > 0:
                plan = p.acquire(aid, rank, size, retry=True)
                if plan.action == "load":
                    p.on_loaded(plan)
                    p.release(aid)

    def arrive(self, req: Req) -> None:
        req.replica = self.rid
        self.queued += 1
        self.waiting_tokens += req.est
        plan = self.policy.acquire(req.adapter, req.rank, self.cfg.adapter_bytes)
        req.tier = plan.tier
        self._follow(req, plan)

    def _follow(self, req: Req, plan) -> None:
        if plan.action == "hit":
            self._ready(req)
        elif plan.action == "join":
            self.joiners[req.adapter].append(req)
        elif plan.action == "wait":
            self.slot_waiters.append(req)
        else:
            self.env.process(self._load(req, plan))

    def _load(self, req: Req, plan):
        with self.loader.request() as turn:
            yield turn
            yield self.env.timeout(self.cfg.load_s[plan.tier])
        self.policy.on_loaded(plan)
        self._ready(req)
        for other in self.joiners.pop(req.adapter, ()):
            self._follow(other, self.policy.acquire(other.adapter, other.rank, self.cfg.adapter_bytes,
                                                    retry=True))

    def _ready(self, req: Req) -> None:
        """The request's adapter is held: it joins the engine's queue (and its tenant the policy)."""
        self._order += 1
        req.order = self._order
        self._enqueue(req)
        self._settle()
        self.fair.arrive(req.tenant)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def _settle(self) -> None:
        """Charge the decode tokens owed (batched per step: charging adds, so this is exact as long
        as it runs before the policy reads a counter: an arrival's lift, a leave, an admission)."""
        if self._owed:
            for t, n in self._owed.items():
                self.fair.charge(t, decode=n)
            self._owed.clear()

    def _enqueue(self, req: Req, front: bool = False) -> None:
        q = self.queues.get(req.tenant)
        if q is None:
            q = self.queues[req.tenant] = deque()
        if front:
            q.appendleft(req)
        else:
            q.append(req)
        self.n_ready += 1

    def _heads(self) -> list[Req]:
        """Each tenant's first ready request, in the engine's queue order."""
        return sorted((q[0] for q in self.queues.values() if q), key=lambda r: r.order)

    def _next_to_admit(self, full: bool) -> Req | None:
        """`handler.engine.scheduler.Scheduler._next_to_admit` (no prefix-block deferral here)."""
        if self.cfg.scheduling == "fifo" or len(self.queues) == 1 and not full:
            if full:
                return None
            return self._heads()[0] if len(self.queues) > 1 else next(iter(self.queues.values()))[0]
        if full and len(self.fair.clients) <= 1:  # one tenant: nobody to take a row from
            return None
        heads = self._heads()
        if len(heads) == 1 and not full:
            return heads[0]
        by_tenant = {r.tenant: r for r in heads}
        below = [t for t in by_tenant if self.fair.below_share(t)]
        t = self.fair.pick(below if below or full else by_tenant)
        return None if t is None else by_tenant[t]

    def _take(self, req: Req) -> None:
        q = self.queues[req.tenant]
        q.popleft()
        if not q:
            del self.queues[req.tenant]
        self.n_ready -= 1

    def _share_victim(self, tenant) -> Req | None:
        """The running request preempted so that `tenant`, below its guaranteed rows, gets one: the
        youngest of the tenant most over its share (`Scheduler._share_victim`)."""
        if not self.fair.below_share(tenant):
            return None
        youngest: dict = {}
        for _, _, r in self.running:
            y = youngest.get(r.tenant)
            if y is None or (r.arrival, r.order) > (y.arrival, y.order):
                youngest[r.tenant] = r
        youngest.pop(tenant, None)
        ordered = dict(sorted(youngest.items(), key=lambda kv: (kv[1].arrival, kv[1].order), reverse=True))
        t = self.fair.most_over(ordered, strictly=True)
        return None if t is None else ordered[t]

    def _preempt(self, r: Req) -> None:
        """Recompute: out of the batch, back at the head of the queue with the tokens it generated."""
        self.running = [e for e in self.running if e[2] is not r]
        heapq.heapify(self.running)
        self.sum_finish -= r.finish
        r.produced += self.step - r.admitted_at
        if r.system:
            self.prefix.unpin(r.adapter)
        self._front -= 1
        r.order = self._front
        self._enqueue(r, front=True)
        self.waiting_tokens += r.est
        self.queued += 1
        self.preemptions += 1
        self.fair.requeue(r.tenant, "share")

    def _finish(self, req: Req) -> None:
        if self.policy.release(req.adapter) and self.slot_waiters:
            waiters, self.slot_waiters = self.slot_waiters, deque()
            for w in waiters:
                self._follow(w, self.policy.acquire(w.adapter, w.rank, self.cfg.adapter_bytes, retry=True))
        if req.system:
            self.prefix.unpin(req.adapter)
        self._settle()
        self.fair.leave(req.tenant, True)
        self.served_tokens += req.output
        self.sim.finished(req)

    # -- the engine --------------------------------------------------------------------------

    def _loop(self):
        env, c = self.env, self.cfg
        while True:
            if not self.n_ready and not self.running:
                self.wake = env.event()
                yield self.wake
                self.wake = None
            admitted: list[Req] = []
            prefill = 0
            if self.n_ready:
                self._settle()
            while self.n_ready:
                full = len(self.running) + len(admitted) >= c.max_batch
                r = self._next_to_admit(full)
                if r is None:
                    break
                if full:  # fair: a tenant below its share takes the row of one over it
                    victim = self._share_victim(r.tenant)
                    if victim is None:
                        break
                    self._preempt(victim)
                self._take(r)
                admitted.append(r)
                self.fair.admit(r.tenant)
                # a cached system prompt is not prefilled again: only the rest of the prompt is (and a
                # preempted request's generated tokens, recomputed; its tenant is not charged for those)
                cached = self.prefix.lookup(r.adapter if r.system else None, r.prompt, r.system)
                if r.system:
                    self.prefix.pin(r.adapter)
                prefill += r.prompt - cached + r.produced
                if math.isnan(r.ttft):
                    r.cached = cached
                    self.fair.charge(r.tenant, prefill=r.prompt - cached)
                    self.fair.queued(r.tenant, env.now - r.arrival)
            rows = len(self.running) + len(admitted)
            dt = c.decode_step_s + c.decode_step_per_row_s * rows + prefill / c.prefill_tokens_per_s
            yield env.timeout(dt)
            self.step += 1
            self.busy_time += dt
            now = env.now
            for r in admitted:
                if r.system:  # its prompt's KV now exists: the shared prefix is kept for the next ones
                    self.prefix.insert(r.adapter, r.system)
                if math.isnan(r.ttft):
                    r.ttft = now - r.arrival
                r.admitted_at = self.step - 1
                finish = r.finish = self.step + (r.output - r.produced) - 1
                self._seq += 1
                heapq.heappush(self.running, (finish, self._seq, r))
                self.sum_finish += finish
                self.waiting_tokens -= r.est
                self.queued -= 1
            owed = self._owed  # every row made one token this step, charged before the policy next decides
            if len(self.fair.clients) == 1:
                owed[next(iter(self.fair.clients))] += len(self.running)
            else:
                for _, _, r in self.running:
                    owed[r.tenant] += 1
            while self.running and self.running[0][0] <= self.step:
                finish, _, r = heapq.heappop(self.running)
                self.sum_finish -= finish
                self._finish(r)


@dataclass
class SimResult:
    config: dict
    requests: int
    p50_ttft_s: float
    p95_ttft_s: float
    p99_ttft_s: float
    ttft_by_tier: dict[str, dict[str, float]]
    tier_share: dict[str, float]
    device_hit_rate: float
    ram_hit_rate: float
    evictions_per_min: float
    evictions_in_use: int
    slot_waits: int
    replicas: int  # at the end
    mean_replicas: float
    replica_requests: dict[str, int]  # requests per replica (measured window)
    replica_busy: dict[str, float]  # share of the time each replica ran steps
    output_tokens_per_s: float
    prefix_hit_rate: float  # prompt tokens served by the prefix caches / prompt tokens (measured window)
    prefix_request_hit_rate: float  # of the requests carrying a system prompt, those that found it cached
    prefix_evictions: int  # prefix cache entries evicted, all replicas, whole run
    cost_per_h: float
    cost_per_m_tokens: float  # prompt + output
    cost_per_m_output_tokens: float
    hot: dict | None
    # per tenant (with `tenants` or a hostile tenant): rows, TTFT p50/p95/max, output tokens/s; and
    # "victims": every tenant but the hostile one together
    tenants: dict | None
    preemptions: int  # share preemptions, all replicas
    series: dict[str, list]  # t, replicas, rate, p95 per sample window, hot owners
    wall_s: float

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("series")
        d.pop("config")
        return d


class Simulation:
    def __init__(self, cfg: SimConfig):
        cfg.check()
        self.cfg = cfg
        self.env = simpy.Environment()
        self.rng = random.Random(cfg.seed)
        self.route_rng = random.Random(cfg.seed + 1)
        self.reg = RegistrySettings()
        self.view = ReplicaView(None, load_threshold_tokens=cfg.load_threshold_tokens,
                                load_threshold_queue=cfg.load_threshold_queue)
        self.adapter_ids = [f"ad-{i:05d}" for i in range(cfg.adapters)]
        self.cum = list(np.cumsum(zipf_weights(cfg.adapters, cfg.zipf_s)))
        self.replicas: dict[str, SimReplica] = {}
        self._snaps: dict = {}  # replica id -> its ReplicaSnapshot until the entry changes
        self.all_replicas: list[SimReplica] = []  # including removed ones (their counters)
        self.next_ordinal = 0
        self.owners_k: dict[str, int] = {}
        self.rate_est: dict[str, tuple[float, float]] = {}  # adapter -> (tokens/s, updated at)
        self.window_tokens: dict[str, int] = defaultdict(int)
        self.done: list[Req] = []
        self.arrived: dict[str, int] = defaultdict(int)  # rows arrived after the warm-up, per tenant
        self.replica_seconds = 0.0
        self.series: dict[str, list] = defaultdict(list)
        self._window_ttft: list[float] = []
        self._metric_samples: deque = deque()  # (t, mean queue depth, mean tokens in flight)
        self.system_tokens: dict[str, int] = {}  # adapter -> its system prompt's length (drawn once)
        self.hpa = None
        if cfg.autoscale is not None:
            from loadtests.autoscale import Hpa

            a = cfg.autoscale
            self.hpa = Hpa(min_replicas=a.min_replicas, max_replicas=a.max_replicas, tolerance=a.tolerance,
                           scale_down_window_s=a.scale_down_window_s, scale_up_window_s=a.scale_up_window_s)
        self.pending_starts = 0

    def rank_of(self, adapter_id: str) -> int:
        ranks = self.cfg.adapter_ranks
        if not ranks or adapter_id in (HOT_ADAPTER, HOSTILE_ADAPTER):
            return ranks[0] if ranks else self.cfg.rank
        return ranks[int(adapter_id[3:]) % len(ranks)]

    def system_of(self, adapter_id: str) -> int:
        """The adapter's system prompt length in tokens: log-normal with mean system_prompt_tokens, drawn
        once per adapter from (seed, adapter) alone, at most half of max_request_tokens."""
        n = self.system_tokens.get(adapter_id)
        if n is None:
            c = self.cfg
            med = max(1, round(c.system_prompt_tokens * math.exp(-SYSTEM_SIGMA**2 / 2)))
            rng = random.Random(f"sim-system-prompt:{c.seed}:{adapter_id}")
            n = self.system_tokens[adapter_id] = _lognormal_int(rng, med, SYSTEM_SIGMA, 1, c.max_request_tokens // 2)
        return n

    # -- fleet membership (registry table -> the router's view) ------------------------------

    def _table(self) -> dict:
        reps = [{"replica_id": rid, "url": f"http://{rid}.sim:8200", "base_model_hash": BASE_HASH,
                 "models": [BASE_NAME], "capacity_weight": 1.0, "status": "up"} for rid in self.replicas]
        return {"version": len(self.replicas), "replicas": reps, "base_models": {BASE_NAME: BASE_HASH}}

    def _owned(self, ids: list[str]) -> dict[str, list[str]]:
        """replica id -> the adapters it owns among `ids` (the registry's placement), in id order."""
        weights = {r: 1.0 for r in ids}
        out: dict[str, list[str]] = {r: [] for r in ids}
        for a in self.adapter_ids:
            for r in placement.owners_for(a, self.owners_k.get(a, self.cfg.owners_k), weights):
                out[r].append(a)
        return out

    def _new_id(self) -> str:
        rid = f"replica-{self.next_ordinal}"  # a StatefulSet's next ordinal
        self.next_ordinal += 1
        return rid

    def add_replica(self, rid: str, owned: list[str]) -> SimReplica:
        rep = SimReplica(self, rid)
        rep.warm(owned)
        self.replicas[rid] = rep
        self.all_replicas.append(rep)
        self.view.apply_table(self._table())
        self._snaps.clear()
        self._poll_one(rep)
        return rep

    def remove_replica(self) -> None:
        """Scale down: the highest ordinal leaves (a StatefulSet); its running requests finish."""
        rid = max(self.replicas, key=lambda r: int(r.rsplit("-", 1)[1]))
        self.replicas.pop(rid)  # out of the table: no new requests; those in flight finish
        self._snaps.clear()
        if not self.pending_starts:
            self.next_ordinal = int(rid.rsplit("-", 1)[1])  # the ordinal is reused by the next scale-up
        self.view.apply_table(self._table())

    def _poll_one(self, rep: SimReplica) -> None:
        e = self.view.replicas.get(rep.rid)
        if e is not None:  # what ReplicaView._poll_one does with a good answer
            e.state, changed = rep.state()  # (the router validates the JSON; here it is built directly)
            if changed or e.state_at is None:
                e.derive()  # (unchanged held adapters derive the same sets: skipped)
            e.state_ok = True
            e.state_at = self.env.now
            self._snaps.pop(rep.rid, None)

    # -- processes ---------------------------------------------------------------------------

    def _poller(self):
        while True:
            yield self.env.timeout(self.cfg.poll_s)
            for rep in self.replicas.values():
                self._poll_one(rep)

    def _stats(self):
        """Every stats window: the router's per-adapter tokens -> the registry's rule
        (`placement.add_window`, `placement.owner_count` with the registry's default settings)."""
        s, w = self.reg, self.cfg.stats_window_s
        while True:
            yield self.env.timeout(w)
            now = SIM_EPOCH + timedelta(seconds=self.env.now)
            for aid in set(self.window_tokens) | set(self.owners_k):
                rate, at = self.rate_est.get(aid, (0.0, None))
                rate = placement.add_window(rate, at, now, self.window_tokens.get(aid, 0), s.stats_tau_s)
                k = placement.owner_count(rate, self.owners_k.get(aid, s.owners_k), k_min=s.owners_k,
                                          capacity=s.replica_capacity_tokens_per_s, cooldown_ratio=s.cooldown_ratio)
                self.rate_est[aid] = (rate, now)
                if k == s.owners_k:
                    self.owners_k.pop(aid, None)
                else:
                    self.owners_k[aid] = k
            self.window_tokens.clear()

    def _arrivals(self, hot: bool):
        c = self.cfg
        rng = random.Random(c.seed + 7) if hot else self.rng
        share_rng = random.Random(c.seed + (13 if hot else 11))  # its own stream: share 0 changes nothing else
        p_med = max(1, round(c.prompt_tokens * math.exp(-PROMPT_SIGMA**2 / 2)))
        o_med = max(1, round(c.output_tokens * math.exp(-OUTPUT_SIGMA**2 / 2)))
        peak = c.hot_tokens_per_s / c.output_tokens if hot else c.rate
        if peak <= 0:
            return
        curve = None if hot else c.rate_curve
        trace = None if hot else c.trace
        if trace:  # the trace's gaps scaled to a mean rate of `rate`, as loadtests.workload.generate
            span = trace[-1].at - trace[0].at
            mean = span / (len(trace) - 1) if len(trace) > 1 and span > 0 else 1.0 / peak
            gaps = [mean] + [b.at - a.at for a, b in zip(trace, trace[1:])]
            scale = (1.0 / peak) / mean
        t, i = 0.0, 0
        while True:
            t += gaps[i % len(trace)] * scale if trace else rng.expovariate(peak)
            if t >= c.duration:
                return
            if curve is not None and rng.random() > curve(t):
                continue  # thinning: a non-homogeneous Poisson process
            if t > self.env.now:
                yield self.env.timeout(t - self.env.now)
            if trace:
                row = trace[i % len(trace)]
                i += 1
                prompt = max(1, min(c.max_request_tokens - 1, row.context_tokens))
                output = max(1, min(c.max_request_tokens - prompt, row.generated_tokens))
            else:
                prompt = _lognormal_int(rng, p_med, PROMPT_SIGMA, 1, c.max_request_tokens - 1)
                output = _lognormal_int(rng, o_med, OUTPUT_SIGMA, 1, c.max_request_tokens - prompt)
            aid = HOT_ADAPTER if hot else self.adapter_ids[min(bisect.bisect(self.cum, rng.random()), c.adapters - 1)]
            system = 0
            if c.system_prompt_share > 0 and share_rng.random() < c.system_prompt_share:
                # the system prompt goes ahead of the request's own prompt, within max_request_tokens
                system = self.system_of(aid)
                prompt = min(prompt, c.max_request_tokens - 1 - system)
                output = min(output, c.max_request_tokens - system - prompt)
                prompt += system
            self.route(Req(self.env.now, aid, self.rank_of(aid), prompt, output, hot, system,
                           self.tenant_of(aid)))

    def tenant_of(self, adapter_id: str) -> str | None:
        """The workload's tenant of an adapter: None (one anonymous tenant) without `tenants`."""
        n = self.cfg.tenants
        if adapter_id == HOSTILE_ADAPTER:
            return HOSTILE_TENANT
        if not n:
            return None
        if adapter_id == HOT_ADAPTER:
            return "hot"
        return f"t{int(adapter_id[3:]) % n}"

    def _hostile(self):
        """A hostile tenant: Poisson arrivals of `hostile_n`-row requests (n choices, one route)."""
        c = self.cfg
        rng = random.Random(c.seed + 17)
        t = 0.0
        while True:
            t += rng.expovariate(c.hostile_rate)
            if t >= c.duration:
                return
            yield self.env.timeout(t - self.env.now)
            rows = [Req(self.env.now, HOSTILE_ADAPTER, self.rank_of(HOSTILE_ADAPTER), c.hostile_prompt_tokens,
                        c.hostile_output_tokens, tenant=HOSTILE_TENANT) for _ in range(c.hostile_n)]
            self.route(rows[0], rows[1:])

    def route(self, req: Req, siblings: list[Req] = ()) -> None:
        """Route `req` (and its `siblings`: the other choices of an n > 1 request, on the same replica)."""
        k = self.owners_k.get(req.adapter, self.cfg.owners_k)
        rr = RouteRequest(adapter_id=req.adapter, base_model_hash=BASE_HASH, owners_k=k, tokens=req.est)
        random_routing = self.cfg.routing == "random"
        ranked = choose(rr, self._view_snapshot(), "random" if random_routing else self.cfg.strategy,
                        affinity=not random_routing, rng=self.route_rng if random_routing else None)
        rep = self.replicas[ranked[0].replica_id]
        for r in (req, *siblings):
            self.view.acquire(rep.rid, r.est)
            rep.arrive(r)
            if r.arrival >= self.cfg.warmup_s:
                self.arrived[str(r.tenant)] += 1
        self._snaps.pop(rep.rid, None)

    def _view_snapshot(self) -> ViewSnapshot:
        """`ReplicaView.snapshot()`, with each replica's `ReplicaEntry.snapshot` reused until that
        entry changes (a poll, or the router's acquire/release of a request to it)."""
        v, snaps = self.view, self._snaps
        for rid, e in v.replicas.items():
            if rid not in snaps:
                snaps[rid] = e.snapshot(v.health_failures)
        return ViewSnapshot(replicas=tuple(snaps[rid] for rid in v.replicas),
                            load_threshold_tokens=v.load_threshold_tokens, load_threshold_queue=v.load_threshold_queue)

    def finished(self, req: Req) -> None:
        self.view.release(req.replica, req.est)
        self._snaps.pop(req.replica, None)
        self.window_tokens[req.adapter] += req.prompt + req.output  # what the router reports (total)
        if req.arrival >= self.cfg.warmup_s:
            self.done.append(req)
            self._window_ttft.append(req.ttft)

    def _sampler(self):
        c = self.cfg
        last = 0.0
        while True:
            yield self.env.timeout(c.sample_s)
            now = self.env.now
            self.replica_seconds += len(self.replicas) * (now - last)
            last = now
            share = c.rate_curve(now) if c.rate_curve else 1.0
            self.series["t"].append(now)
            self.series["replicas"].append(len(self.replicas))
            self.series["rate"].append(c.rate * share)
            w = self._window_ttft
            self.series["p95_ttft_s"].append(float(np.percentile(w, 95)) if w else math.nan)
            self._window_ttft = []
            self.series["hot_owners"].append(self.owners_k.get(HOT_ADAPTER, c.owners_k))
            self.series["evictions"].append(sum(r.policy.counters.evictions for r in self.all_replicas))

    def _autoscaler(self):
        a = self.cfg.autoscale
        ticks, per_sync = 0, max(1, round(a.sync_s / self.cfg.poll_s))
        while True:
            yield self.env.timeout(self.cfg.poll_s)
            ticks += 1
            reps = list(self.replicas.values())
            if reps:
                n = len(reps)
                self._metric_samples.append((self.env.now, sum(r.queued for r in reps) / n,
                                             sum(r.tokens_in_flight() for r in reps) / n))
            while self._metric_samples and self._metric_samples[0][0] < self.env.now - a.metric_window_s:
                self._metric_samples.popleft()
            if ticks % per_sync or not self._metric_samples:
                continue
            qd = sum(s[1] for s in self._metric_samples) / len(self._metric_samples)
            tif = sum(s[2] for s in self._metric_samples) / len(self._metric_samples)
            current = len(self.replicas) + self.pending_starts
            want = self.hpa.desired(self.env.now, current, {"queue_depth": (qd, a.target_queue_depth),
                                                            "tokens_in_flight": (tif, a.target_tokens_in_flight)})
            while current < want:
                self.pending_starts += 1
                current += 1
                self.env.process(self._start_replica())
            while current > want and len(self.replicas) > a.min_replicas:
                self.remove_replica()
                current -= 1

    def _start_replica(self):
        """A new pod: start-up, base load, then it pulls its owned adapters (remote -> disk -> RAM,
        `load_concurrency` at a time; the first `slots` mounted) and only then reports ready."""
        a, c = self.cfg.autoscale, self.cfg
        rid = self._new_id()
        yield self.env.timeout(a.startup_s + a.base_load_s)
        owned = self._owned([*self.replicas, rid])[rid]
        yield self.env.timeout(len(owned) * c.load_s["remote"] / c.load_concurrency)
        self.pending_starts -= 1
        self.add_replica(rid, owned)

    # -- run ---------------------------------------------------------------------------------

    def run(self) -> SimResult:
        c = self.cfg
        t0 = time.perf_counter()
        ids = [self._new_id() for _ in range(c.replicas)]
        owned = self._owned(ids)
        for rid in ids:
            self.add_replica(rid, owned[rid])
        env = self.env
        env.process(self._poller())
        env.process(self._stats())
        env.process(self._sampler())
        env.process(self._arrivals(False))
        if c.hot_tokens_per_s > 0:
            env.process(self._arrivals(True))
        if c.hostile_rate > 0:
            env.process(self._hostile())
        if self.hpa is not None:
            env.process(self._autoscaler())
        base_ev = {}
        bar = None
        if c.progress:
            from tqdm import tqdm

            bar = tqdm(total=int(c.duration), unit="sim-s", desc="simulate", leave=False)
        t = 0.0
        while t < c.duration:
            t = min(c.duration, t + 10.0)
            if not base_ev and t > c.warmup_s:
                base_ev = {id(r): r.policy.counters.evictions for r in self.all_replicas}
            env.run(until=t)
            if bar is not None:
                bar.update(int(t) - bar.n)
        # let the requests in flight finish (no new arrivals) so late ones are counted
        env.run(until=c.duration + 120.0)
        if bar is not None:
            bar.close()
        return self._result(base_ev, time.perf_counter() - t0)

    def _result(self, base_ev: dict, wall: float) -> SimResult:
        c = self.cfg
        done = [r for r in self.done if r.arrival < c.duration]
        ttft = np.array([r.ttft for r in done]) if done else np.array([math.nan])
        by_tier = {}
        share = {}
        for tier in TIERS:
            x = np.array([r.ttft for r in done if r.tier == tier])
            share[tier] = len(x) / max(1, len(done))
            if len(x):
                by_tier[tier] = {"n": int(len(x)), "p50_s": float(np.percentile(x, 50)),
                                 "p95_s": float(np.percentile(x, 95))}
        minutes = (c.duration - c.warmup_s) / 60
        evictions = sum(r.policy.counters.evictions - base_ev.get(id(r), 0) for r in self.all_replicas)
        per_rep = defaultdict(int)
        for r in done:
            per_rep[r.replica] += 1
        measured_s = c.duration - c.warmup_s
        out_tokens = sum(r.output for r in done)
        all_tokens = sum(r.output + r.prompt for r in done)
        mean_reps = self.replica_seconds / max(1e-9, self.series["t"][-1]) if self.series["t"] else c.replicas
        cost_per_h = mean_reps * c.gpu_price_per_h
        hours = measured_s / 3600
        prompt_tokens = sum(r.prompt for r in done)
        with_system = [r for r in done if r.system]
        hot = None
        if c.hot_tokens_per_s > 0:
            hx = np.array([r.ttft for r in done if r.hot])
            hot = {"tokens_per_s": c.hot_tokens_per_s, "requests": int(len(hx)),
                   "p95_ttft_s": float(np.percentile(hx, 95)) if len(hx) else math.nan,
                   "max_owners": max(self.series["hot_owners"]) if self.series["hot_owners"] else c.owners_k,
                   "replicas_used": len({r.replica for r in done if r.hot})}
        tenants = None
        if c.tenants or c.hostile_rate > 0:
            groups: dict = defaultdict(list)
            for r in done:
                groups[str(r.tenant)].append(r)
                if r.tenant != HOSTILE_TENANT:
                    groups["victims"].append(r)
            arrived = dict(self.arrived)
            arrived["victims"] = sum(n for t, n in self.arrived.items() if t != HOSTILE_TENANT)
            tenants = {}
            for name in sorted(set(groups) | {t for t, n in arrived.items() if n}):
                rs = groups.get(name, [])
                x = np.array([r.ttft for r in rs] or [math.nan])
                tenants[name] = {"rows": len(rs), "p50_ttft_s": float(np.percentile(x, 50)),
                                 "p95_ttft_s": float(np.percentile(x, 95)), "max_ttft_s": float(x.max()),
                                 "output_tokens_per_s": sum(r.output for r in rs) / measured_s,
                                 # arrived in the measured window, not finished 120 s after the last arrival
                                 "unfinished": max(0, arrived.get(name, 0) - len(rs))}
        return SimResult(
            config={k: v for k, v in asdict(c).items() if k not in ("rate_curve", "trace")},
            requests=len(done),
            p50_ttft_s=float(np.percentile(ttft, 50)),
            p95_ttft_s=float(np.percentile(ttft, 95)),
            p99_ttft_s=float(np.percentile(ttft, 99)),
            ttft_by_tier=by_tier,
            tier_share=share,
            device_hit_rate=share["gpu"],
            ram_hit_rate=share["ram"],
            evictions_per_min=evictions / minutes,
            evictions_in_use=sum(r.policy.counters.evictions_in_use for r in self.all_replicas),
            slot_waits=sum(r.policy.counters.slot_waits for r in self.all_replicas),
            replicas=len(self.replicas),
            mean_replicas=mean_reps,
            replica_requests=dict(sorted(per_rep.items())),
            replica_busy={r.rid: r.busy_time / (c.duration + 120.0) for r in self.all_replicas},
            output_tokens_per_s=out_tokens / measured_s,
            prefix_hit_rate=sum(r.cached for r in done) / prompt_tokens if prompt_tokens else math.nan,
            prefix_request_hit_rate=(sum(1 for r in with_system if r.cached) / len(with_system)
                                     if with_system else math.nan),
            prefix_evictions=sum(r.prefix.evictions for r in self.all_replicas),
            cost_per_h=cost_per_h,
            cost_per_m_tokens=cost_per_h * hours / (all_tokens / 1e6) if all_tokens else math.inf,
            cost_per_m_output_tokens=cost_per_h * hours / (out_tokens / 1e6) if out_tokens else math.inf,
            hot=hot,
            tenants=tenants,
            preemptions=sum(r.preemptions for r in self.all_replicas),
            series=dict(self.series),
            wall_s=wall,
        )


def simulate(cfg: SimConfig) -> SimResult:
    return Simulation(cfg).run()


def diurnal(period_s: float, low: float = 0.25) -> Callable[[float], float]:
    """A day compressed into `period_s`: share of the peak rate, from `low` at t=0 to 1 at mid-period."""
    return lambda t: low + (1 - low) * 0.5 * (1 - math.cos(2 * math.pi * t / period_s))


def seed_config(**kw) -> SimConfig:
    """The seed's fleet (26 replicas, 5,000 adapters, 40 req/s) with sizes from lorafarm.capacity."""
    r = cap.compute()
    base = dict(replicas=r.replicas, adapters=5000, rate=40.0, slots=r.slot_cache_adapters,
                ram_adapters=r.adapters_per_replica, adapter_bytes=r.adapter_bytes)
    base.update(kw)
    return SimConfig(**base)
