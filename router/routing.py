"""Replica choice as a pure function: `choose(request, view, strategy, k) -> ranked replicas`.

No I/O and no clock: the same inputs give the same ranking (the `random` strategy takes its
generator as an argument), so the fleet simulator runs this exact code.

Rules (DESIGN.md section 5):
- candidates are the replicas that serve the request's base model (by base_model_hash, or a base
  model name listed in the replica's models) and are healthy; replicas whose state could not be
  fetched keep their last known state ("possibly warm") and stay candidates until their health
  check fails;
- classes: adapter on the device (gpu), in host RAM (ram), on local disk (disk), rendezvous owner
  (top-k over the candidates with the registry's owners_k), any other candidate (cold);
- the replicas that hold the adapter or own it, under their load threshold, are ordered by the
  expected time to first token:

      expected_ttft_ms = queue_wait_ms + load_ms (+ owner_bias_ms for a non-owner that must fetch it)
      queue_wait_ms    = engine_waiting * view.queue_ms_per_request   (requests queued for the batch:
                         not those waiting for another adapter's load; queue_depth when not reported)
      load_ms          = 0 on the device; the replica's reported expected_load_ms for its RAM or
                         disk copy; its moving average for a remote load when it holds none
                         (the seed's 8 ms / 40 ms / 400 ms when it reports nothing)

  so a loaded-idle replica beats a busy one holding it on the device only when the queue costs
  more than the load, and a replica with the adapter on disk beats an owner that must fetch it;
  with empty queues and the default figures this is the class order gpu > ram > disk > owner. Ties (equal
  expected TTFT) go to the class order, then to the strategy: least_tokens (default),
  least_connections, weighted (tokens in flight per unit of capacity), random;
- `view.score == "class-order"` drops the expected-TTFT term: the fixed class order gpu > ram >
  disk > owner, then the strategy (the rule before issue 13, kept for the A/B comparison);
- other candidates (cold, not owners) follow as failover, by the same key;
- a base model (no adapter): replicas and foreign workers reporting it loaded (base) before foreign
  workers that list it but do not report it loaded, or whose catalog could not be fetched
  (installed); the strategy orders within each; a worker that does not list the model is never a
  candidate;
- a replica over its load threshold drops behind the warm and owner replicas that are not; when
  every warm or owner replica is over it, the least loaded candidate is tried first (spill);
- if no candidate is healthy, the unhealthy ones are returned as a last resort (a replica whose
  health checks failed may have come back; a refused connection costs little).
"""

from __future__ import annotations

import random as _random
from collections.abc import Sequence
from dataclasses import dataclass, field

from lorafarm.rendezvous import owners as rendezvous_owners
from lorafarm.rendezvous import score as rendezvous_score

STRATEGIES = ("least_tokens", "least_connections", "weighted", "random")
# how warm/owner replicas are ordered: expected time to first token, or the fixed class order
EXPECTED_TTFT, CLASS_ORDER = "expected-ttft", "class-order"
SCORES = (EXPECTED_TTFT, CLASS_ORDER)

# readiness classes, best first
GPU, RAM, DISK, OWNER, ANY, BASE = "gpu", "ram", "disk", "owner", "any", "base"
# a foreign worker that lists the base model but does not report it loaded, or whose catalog could
# not be fetched (possibly warm)
INSTALLED = "installed"
_CLASS_RANK = {GPU: 0, RAM: 1, DISK: 2, OWNER: 3, BASE: 3, INSTALLED: 4, ANY: 5}
# routing class as reported in metrics and logs
ROUTE_CLASS = {GPU: "warm", RAM: "warm", DISK: "warm", BASE: "warm", OWNER: "owner", INSTALLED: "installed",
               ANY: "cold"}
# expected load time per source tier when a replica reports none (the seed's budgets, 80 MB adapter)
DEFAULT_LOAD_MS = {GPU: 0.0, RAM: 8.0, DISK: 40.0, "remote": 400.0}


@dataclass(frozen=True)
class ReplicaSnapshot:
    """What the router knows about one replica at one instant."""

    replica_id: str
    url: str = ""
    base_model_hash: str = ""
    models: frozenset[str] = frozenset()
    capacity_weight: float = 1.0
    gpu_adapters: frozenset[str] = frozenset()
    ram_adapters: frozenset[str] = frozenset()
    disk_adapters: frozenset[str] = frozenset()
    # adapter -> expected load ms from the tier it is held in (ram/disk); per-tier moving averages
    load_ms: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    tier_load_ms: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    tokens_in_flight: int = 0  # max(replica's last report, this router's own in-flight estimate)
    connections: int = 0  # requests in flight (router's count or the replica's running + queued)
    queue_depth: int = 0
    engine_waiting: int | None = None  # queued for the batch (adapter ready); None: use queue_depth
    healthy: bool = True  # False after N health checks failed in a row
    state_fresh: bool = True  # False: last state fetch failed; lists above are the last known
    only_adapter: str | None = None  # a merged-mode replica: it serves this adapter and nothing else
    # foreign workers only: the models they report loaded (None: a lorafarm replica, whose base is loaded)
    loaded_models: frozenset[str] | None = None
    started: bool = True  # False until its first state report reached this router (a replica still starting)

    def batch_queue(self) -> int:
        """Requests ahead of a new one in the engine's queue. Requests waiting for another adapter's
        load do not delay it (they wait for their own copy), so they are not counted when the replica
        reports the difference."""
        return self.queue_depth if self.engine_waiting is None else self.engine_waiting

    def expected_load_ms(self, adapter_id: str, tier: str) -> float:
        """What a request for `adapter_id` waits for its load here, from `tier` (gpu/ram/disk/remote)."""
        if tier == GPU:
            return 0.0
        if tier != "remote" and adapter_id in self.load_ms:
            return self.load_ms[adapter_id]
        return self.tier_load_ms.get(tier, DEFAULT_LOAD_MS[tier])

    def serves(self, request: RouteRequest) -> bool:
        if self.only_adapter is not None:  # same base hash, but the base weights carry one adapter
            return request.adapter_id == self.only_adapter
        if request.base_model_hash and self.base_model_hash == request.base_model_hash:
            return True
        return bool(request.model_name) and request.model_name in self.models


@dataclass(frozen=True)
class ViewSnapshot:
    """All replicas plus the load thresholds the router applies."""

    replicas: tuple[ReplicaSnapshot, ...] = ()
    load_threshold_tokens: int = 8192  # per unit of capacity_weight
    load_threshold_queue: int = 16
    queue_ms_per_request: float = 100.0  # expected-TTFT: wait per request queued ahead
    owner_bias_ms: float = 50.0  # expected-TTFT: added for a non-owner that would fetch the adapter
    score: str = EXPECTED_TTFT  # class-order: ignore the expected-TTFT term (SCORES)

    def overloaded(self, r: ReplicaSnapshot) -> bool:
        limit = self.load_threshold_tokens * max(r.capacity_weight, 1e-9)
        return r.tokens_in_flight >= limit or r.queue_depth >= self.load_threshold_queue


@dataclass(frozen=True)
class RouteRequest:
    """One request as routing sees it. For an adapter request set adapter_id and its
    base_model_hash; for a base model request set model_name (and its hash when known)."""

    adapter_id: str | None = None
    base_model_hash: str | None = None
    model_name: str | None = None
    owners_k: int = 2
    tokens: int = 0  # estimated cost (prompt + max_tokens); informational


@dataclass(frozen=True)
class RankedReplica:
    replica: ReplicaSnapshot
    klass: str  # gpu | ram | owner | any | base
    route_class: str  # warm | owner | spill | cold (metrics label)
    overloaded: bool = False

    @property
    def replica_id(self) -> str:
        return self.replica.replica_id


@dataclass
class _Scored:
    replica: ReplicaSnapshot
    klass: str
    overloaded: bool
    tiebreak: float = field(default=0.0)
    expected_ms: float = 0.0  # expected time to first token (module docstring)


def _load(r: ReplicaSnapshot) -> float:
    return r.tokens_in_flight / max(r.capacity_weight, 1e-9)


def _strategy_key(strategy: str, s: _Scored) -> tuple:
    r = s.replica
    if strategy == "least_tokens":
        return (r.tokens_in_flight, r.connections, s.tiebreak)
    if strategy == "least_connections":
        return (r.connections, r.tokens_in_flight, s.tiebreak)
    if strategy == "weighted":
        # tokens in flight per unit of capacity; when idle the bigger replica wins
        return ((r.tokens_in_flight + 1) / max(r.capacity_weight, 1e-9), r.connections, s.tiebreak)
    if strategy == "random":
        return (s.tiebreak,)
    raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")


def choose(
    request: RouteRequest,
    view: ViewSnapshot | Sequence[ReplicaSnapshot],
    strategy: str = "least_tokens",
    k: int | None = None,
    *,
    affinity: bool = True,
    rng: _random.Random | None = None,
) -> list[RankedReplica]:
    """Every replica worth trying for `request`, best first (the proxy fails over down the list).

    `k` is the owner count (defaults to request.owners_k). `affinity=False` ignores the warm and
    owner classes (the base strategy alone: the A/B baseline). `rng` feeds the random strategy and
    the random tie-break; without it ties break by the rendezvous score, so equal replicas are not
    always resolved in favour of the same one across adapters."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    if not isinstance(view, ViewSnapshot):
        view = ViewSnapshot(replicas=tuple(view))
    if view.score not in SCORES:
        raise ValueError(f"unknown score {view.score!r}; one of {', '.join(SCORES)}")
    k = request.owners_k if k is None else k
    serving = [r for r in view.replicas if r.serves(request)]
    pool = [r for r in serving if r.healthy] or serving  # last resort: unhealthy ones
    if not pool:
        return []
    if strategy == "random" and rng is None:
        rng = _random.Random()
    key_seed = request.adapter_id or request.model_name or ""

    def tiebreak(r: ReplicaSnapshot) -> float:
        return rng.random() if rng is not None else -rendezvous_score(key_seed, r.replica_id)

    adapter = request.adapter_id
    owner_ids: set[str] = set()
    if adapter and affinity:
        weights = {r.replica_id: r.capacity_weight for r in pool}
        owner_ids = set(rendezvous_owners(adapter, weights, max(1, k)))

    scored: list[_Scored] = []
    for r in pool:
        if not adapter:
            klass = BASE if _warm_base(r, request, affinity) else INSTALLED
        elif not affinity:
            klass = ANY
        elif adapter in r.gpu_adapters:
            klass = GPU
        elif adapter in r.ram_adapters:
            klass = RAM
        elif adapter in r.disk_adapters:
            klass = DISK
        elif r.replica_id in owner_ids:
            klass = OWNER
        else:
            klass = ANY
        expected = 0.0
        if adapter and affinity and view.score == EXPECTED_TTFT:
            tier = klass if klass in (GPU, RAM, DISK) else "remote"
            expected = r.batch_queue() * view.queue_ms_per_request + r.expected_load_ms(adapter, tier)
            if tier == "remote" and r.replica_id not in owner_ids:
                expected += view.owner_bias_ms
        scored.append(_Scored(r, klass, view.overloaded(r), tiebreak(r), expected))

    def by_strategy(s: _Scored) -> tuple:
        return _strategy_key(strategy, s)

    if not affinity or not adapter:
        # base models: warm (lorafarm replicas, workers reporting the model loaded) before installed
        # or possibly-warm foreign workers; the strategy within each; replicas over their threshold last
        ordered = sorted(scored, key=lambda s: (s.overloaded, _CLASS_RANK[s.klass], by_strategy(s)))
        return [_ranked(s) for s in ordered]

    def by_class(s: _Scored) -> tuple:
        return (s.overloaded, s.expected_ms, _CLASS_RANK[s.klass], by_strategy(s))

    ok = sorted((s for s in scored if s.klass != ANY and not s.overloaded), key=by_class)
    if ok:
        # warm/owner replicas under their threshold, then the others as failover
        rest = sorted((s for s in scored if s.klass == ANY or s.overloaded), key=by_class)
        return [_ranked(s) for s in ok + rest]
    # every warm/owner replica is over its threshold: spill to the least loaded candidate
    spill = min(scored, key=lambda s: (s.overloaded, _load(s.replica), s.replica.connections, s.tiebreak))
    rest = sorted((s for s in scored if s is not spill), key=lambda s: (s.overloaded, _CLASS_RANK[s.klass], by_strategy(s)))
    return [_ranked(spill, route_class="spill" if spill.klass == ANY else None)] + [_ranked(s) for s in rest]


def _warm_base(r: ReplicaSnapshot, request: RouteRequest, affinity: bool) -> bool:
    """Is `r` known to hold the requested base model loaded? Lorafarm replicas always do; a foreign
    worker does when its fresh catalog reports the model loaded (warm-first across kinds)."""
    if r.loaded_models is None or not affinity:
        return True
    return r.state_fresh and bool(request.model_name) and request.model_name in r.loaded_models


def _ranked(s: _Scored, route_class: str | None = None) -> RankedReplica:
    return RankedReplica(
        replica=s.replica,
        klass=s.klass,
        route_class=route_class or ROUTE_CLASS[s.klass],
        overloaded=s.overloaded,
    )


# -- alias traffic splits (issue 38) -------------------------------------------------------------

def _unit_hash(*parts: str) -> float:
    """A uniform number in (0, 1) from the parts (sha256; the same everywhere, every run)."""
    import hashlib

    digest = hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).digest()
    return (int.from_bytes(digest[:8], "big") + 0.5) / 2.0**64


def pick_version(alias: str, split: Sequence[tuple[str, float]], user: str | None = None,
                 rng: _random.Random | None = None) -> str:
    """The version of a split alias that serves one request: weight-proportional.

    With a `user` (the request's OpenAI `user` field or its x-lorafarm-user header) the choice is
    sticky: weighted rendezvous hashing, the version with the highest weight / -ln(hash(alias, user,
    version)) wins, which picks each version with probability weight / sum of weights, gives the same
    user the same version for as long as the split stays, and when a version's weight grows only moves
    users *to* it (a user on the canary at 10% stays on it at 50%). Without a user each request is
    drawn independently from `rng`. Only versions of the split are ever returned."""
    import math

    items = [(a, float(w)) for a, w in split if w > 0]
    if not items:
        raise ValueError("an empty split")
    if len(items) == 1:
        return items[0][0]
    if user is None:
        r = (rng or _random).random() * sum(w for _, w in items)
        for a, w in items:
            r -= w
            if r < 0:
                return a
        return items[-1][0]
    return max(items, key=lambda aw: (aw[1] / -math.log(_unit_hash(alias, user, aw[0])), aw[0]))[0]
