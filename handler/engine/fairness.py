"""The fairness policy of the engine's batch: pure bookkeeping, no torch, no I/O, no threads.

One `FairPolicy` decides, for one engine, which tenant's request the batch admits next, how many
batch rows each tenant is guaranteed, and whose row gives way; the engine's scheduler
(`handler.engine.scheduler.Scheduler`) runs it, and so can a fleet simulator (like
`handler.adapters.slots.SlotPolicy`, nothing here needs a model). A client is a tenant (the
router's `x-lorafarm-tenant`; None: one anonymous client); a request is one batch row, so a request
with `n` choices (n engine requests) counts as n rows.

The Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024),
with weights, plus a row share:

- Counters. Each client c has a weight phi_c > 0 (default 1) and a counter C_c of the weighted
  tokens it was served:

      C_c <- C_c + (w_p * p + w_q * q) / phi_c

  for p prompt tokens prefilled and q tokens generated for c (w_p = 1, w_q = 2 by default: a decode
  token holds a row and its KV for a step). Prompt tokens taken from the prefix cache and the
  recompute of a preempted request are not charged: only work done once for the client counts.
- Admission. Among the backlogged clients (with waiting requests), the head of the client with the
  least counter is admitted next: first among the clients below their guaranteed rows (below),
  then among all (FIFO within a client; ties: the client whose head came first). When it does not
  fit the KV cache admission stops (nobody overtakes it, as first come first served does); a
  client whose head is deferred for a prefix block is passed over for the step.
- Lift. A client that becomes active (its first live request) is lifted to the least counter of
  the active clients, C_c <- max(C_c, min_a C_a) (the last such minimum when none is active): idle
  time is not banked, so a client cannot save up service and then take the box.
- Shares. With B = max_batch rows and A the active clients (live requests: waiting or admitted),
  client c's share is s_c = B * phi_c / sum_{a in A} phi_a and it is guaranteed g_c = floor(s_c)
  rows (sum_c g_c <= B).
- Share preemption. When no row is free and a backlogged client c holds h_c < g_c rows, the
  youngest request of the client most over its share (argmax_a h_a - s_a over the clients with
  h_a > s_a) is parked: it keeps its KV blocks and progress, waits at the head of its client's
  queue, and goes on where it stopped when readmitted (nothing recomputed). Parked blocks are the
  first freed when the cache runs short (the request is then recomputed at readmission). When c's
  head does not fit the KV cache, rows of clients over their share are preempted by recompute
  (blocks freed, output kept: greedy output is unchanged).
- Contended steps (the scheduler's, not a policy decision: the rows of one step). While two or
  more clients are active and one of them holds fewer rows than it is guaranteed (a light client
  beside a heavy one; when every client holds its share, steps stay whole) a step decodes at most R rows
  (`--contended-rows`; on a CPU, where a step's time grows with its rows, about as many as make a
  step as long as a newcomer's own prefill step), split between the clients by weight, each
  client's least recently decoded rows first, so that a step another client waits on stays short;
  and a step carrying a short prefill of a client below its share decodes only the rows of clients
  below their share (its first token then waits for its own prefill, as it does alone). Steps stay
  contended for a short while (the scheduler's CONTENDED_LINGER_S) after the light client's last
  request ends: its next one most likely comes soon, and would otherwise land in a whole-batch step.
- KV preemption. When a decode row cannot grow (the KV cache is full), the youngest request of the
  client most over its share goes (ties: the youngest request), never the oldest admitted request
  while another is admitted: the oldest always fits alone (prompt + max_tokens <= the cache), so
  something always advances.

Guarantees (B rows, every client with work active):

1. Work conservation: admission stops only when no row is free or at a request that does not fit
   the KV cache; rows a client does not use go to the others, and a client alone has s_c = B.
   With one client every choice is first come first served: the same admissions, victims and steps.
2. Rows: a client with waiting requests that holds fewer than g_c rows gets one at the next step's
   plan, unless its head waits for a prefix block its own earlier request is computing (published
   when that step ends), or its head (or the head of a less served client below its share, chosen
   first) does not fit the KV cache once every row over a share is preempted. A
   victim exists whenever the batch is full and c is below g_c: sum_{a in A} s_a = B = sum_a h_a and
   h_c < s_c, so some a has h_a > s_a. A client holding no more than its share is never preempted
   for another's share, and a preempted client keeps at least floor(s_a) rows, so rows do not
   oscillate. With k equal clients each gets floor(B / k) rows within a step of asking.
3. Service: among clients at or above their guaranteed rows the admission order is VTC's, for
   which Sheng et al. prove that two clients backlogged over an interval receive weighted service
   within a constant of each other (2U, U set by the longest prompt and the tokens a batch holds),
   work-conserving. The row guarantee (below-share clients first, share preemption) only moves rows
   from a client over its share to one below it; that bound is theirs for pure VTC, not re-proved
   here with the row rule.

Counters of idle clients are kept (bounded) so that a client cannot shed a high counter by pausing;
those at or below the least active counter are dropped (a lift would restore them anyway).

`TenantLedger` keeps each tenant's served tokens, admission waits and preemptions for metrics,
with at most `named` tenants by name (the most served recently, with hysteresis) and the rest
summed as one "other" entry, every total monotonic.

Everything is called under one lock (the engine's) or on one thread (a simulator); nothing blocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Callable

W_PREFILL = 1.0  # weight of a prompt token in the counters
W_DECODE = 2.0  # weight of a generated token
MIN_WEIGHT, MAX_WEIGHT = 1.0 / 1024, 1024.0  # a tenant's weight, clamped to this range
IDLE_KEEP = 4096  # counters of idle clients kept at most
QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
NAMED_TENANTS = 32  # tenants a ledger names; the rest are summed as "other"
RECENT_HALF_LIFE_S = 60.0  # the decay of "recently served" that picks the named tenants

Client = Hashable  # a tenant id, or None


def clamp_weight(weight: float | None) -> float:
    """A usable weight: 1 for None or a value that is not a positive finite number, else clamped to
    [MIN_WEIGHT, MAX_WEIGHT]."""
    try:
        w = float(weight) if weight is not None else 1.0
    except (TypeError, ValueError):
        return 1.0
    if not math.isfinite(w) or w <= 0:
        return 1.0
    return min(MAX_WEIGHT, max(MIN_WEIGHT, w))


@dataclass
class ClientState:
    """An active client: its counter, weight, waiting requests and admitted rows."""

    counter: float = 0.0
    weight: float = 1.0
    waiting: int = 0
    held: int = 0


@dataclass(frozen=True)
class ActiveClient:
    """One active client as `FairPolicy.active()` reports it."""

    client: Client
    counter: float
    weight: float
    waiting: int
    held: int
    share: float  # rows: max_batch * weight / the active clients' total weight
    guaranteed: int  # floor(share)


class FairPolicy:
    """See the module docstring (it is the contract)."""

    def __init__(self, max_batch: int, *, w_prefill: float = W_PREFILL, w_decode: float = W_DECODE,
                 clock: Callable[[], float] = time.monotonic, named: int = NAMED_TENANTS):
        if max_batch < 1 or w_prefill < 0 or w_decode < 0:
            raise ValueError("max_batch must be positive and the token weights >= 0")
        self.max_batch = int(max_batch)
        self.w_prefill, self.w_decode = float(w_prefill), float(w_decode)
        self.clients: dict[Client, ClientState] = {}  # the active ones
        self.idle: dict[Client, float] = {}  # counters of clients with nothing live
        self._floor = 0.0  # the least counter of the active clients (the last one while none is)
        self._weights = 0.0  # the active clients' total weight
        self.preemptions = {"kv": 0, "share": 0}
        self.ledger = TenantLedger(clock=clock, named=named)

    # -- a request's life -----------------------------------------------------------------------

    def arrive(self, client: Client, weight: float = 1.0) -> None:
        """A request of `client` is queued (its weight, clamped, applies from now on)."""
        st = self.clients.get(client)
        w = clamp_weight(weight)
        if st is None:  # becomes active: lifted to the least active counter, no banked idle time
            floor = self.floor()
            counter = max(self.idle.pop(client, floor), floor)
            st = self.clients[client] = ClientState(counter=counter, weight=w)
            self._weights += w
        elif st.weight != w:
            self._weights += w - st.weight
            st.weight = w
        st.waiting += 1

    def admit(self, client: Client) -> None:
        """A waiting request of `client` took a row."""
        st = self.clients[client]
        st.waiting -= 1
        st.held += 1

    def requeue(self, client: Client, reason: str) -> None:
        """An admitted request of `client` was preempted (`reason`: "kv" or "share") and waits again."""
        st = self.clients[client]
        st.held -= 1
        st.waiting += 1
        self.preemptions[reason] = self.preemptions.get(reason, 0) + 1
        self.ledger.preempted(client, reason)

    def leave(self, client: Client, admitted: bool) -> None:
        """A request of `client` ended (finished or cancelled), holding a row or waiting."""
        st = self.clients.get(client)
        if st is None:
            return
        if admitted:
            st.held -= 1
        else:
            st.waiting -= 1
        if st.held <= 0 and st.waiting <= 0:
            del self.clients[client]
            self._weights = sum(s.weight for s in self.clients.values())  # exact again, no drift
            floor = self.floor()
            if st.counter > floor:
                self.idle[client] = st.counter
            if len(self.idle) > IDLE_KEEP:
                self._prune_idle(floor)

    def _prune_idle(self, floor: float) -> None:
        """Drop idle counters a lift would restore (<= the floor); past IDLE_KEEP, the lowest."""
        self.idle = {c: v for c, v in self.idle.items() if v > floor}
        if len(self.idle) > IDLE_KEEP:
            keep = sorted(self.idle, key=self.idle.__getitem__, reverse=True)[: IDLE_KEEP // 2]
            self.idle = {c: self.idle[c] for c in keep}

    def charge(self, client: Client, prefill: int = 0, decode: int = 0) -> None:
        """`client` was served `prefill` prompt tokens and `decode` generated tokens."""
        if prefill <= 0 and decode <= 0:
            return
        st = self.clients.get(client)
        if st is not None:
            st.counter += (self.w_prefill * prefill + self.w_decode * decode) / st.weight
        self.ledger.served(client, prefill, decode)

    def queued(self, client: Client, seconds: float) -> None:
        """A request of `client` waited `seconds` from arrival to its first admission."""
        self.ledger.queued(client, seconds)

    # -- decisions ------------------------------------------------------------------------------

    def floor(self) -> float:
        """The least counter of the active clients (the last such value while none is active)."""
        if self.clients:
            self._floor = max(self._floor, min(s.counter for s in self.clients.values()))
        return self._floor

    def share(self, client: Client) -> float:
        """Rows: max_batch split by weight among the active clients (0 for an inactive one)."""
        st = self.clients.get(client)
        if st is None or self._weights <= 0:
            return 0.0
        return self.max_batch * st.weight / self._weights

    def guaranteed(self, client: Client) -> int:
        return int(math.floor(self.share(client) + 1e-9))

    def below_share(self, client: Client) -> bool:
        """Holds fewer rows than it is guaranteed."""
        st = self.clients.get(client)
        return st is not None and st.held < self.guaranteed(client)

    def any_below_share(self) -> bool:
        """Some active client holds fewer rows than it is guaranteed (a light client beside heavier ones)."""
        return any(st.held < self.guaranteed(c) for c, st in self.clients.items())

    def over_share(self, client: Client) -> float:
        """Rows held beyond the share (negative: below it)."""
        st = self.clients.get(client)
        return 0.0 if st is None else st.held - self.share(client)

    def pick(self, candidates: Iterable[Client]) -> Client | None:
        """The candidate with the least counter; ties: the first given (the caller gives them in
        the order their heads arrived). None when there is none."""
        best, best_c = None, math.inf
        for c in candidates:
            st = self.clients.get(c)
            v = st.counter if st is not None else self.floor()
            if v < best_c:
                best, best_c = c, v
        return best

    def most_over(self, clients: Iterable[Client], strictly: bool = False) -> Client | None:
        """The client most over its share among `clients` (first given on ties); with `strictly`,
        only one holding more rows than its share, else None."""
        best, best_v = None, -math.inf
        for c in clients:
            v = self.over_share(c)
            if strictly and v <= 1e-9:
                continue
            if v > best_v:
                best, best_v = c, v
        return best

    def active(self) -> list[ActiveClient]:
        """The active clients, least counter first."""
        out = [ActiveClient(c, s.counter, s.weight, s.waiting, s.held, self.share(c), self.guaranteed(c))
               for c, s in self.clients.items()]
        out.sort(key=lambda a: a.counter)
        return out

    def waiting_clients(self) -> int:
        """Active clients with waiting requests."""
        return sum(1 for s in self.clients.values() if s.waiting > 0)


# ------------------------------------------------------------------------------------- the ledger


@dataclass
class TenantUsage:
    """What one tenant (or the "other" sum) was served: cumulative, monotonic."""

    prompt_tokens: int = 0  # prompt tokens prefilled for it (not cache hits, not recompute)
    generated_tokens: int = 0
    queue_count: int = 0  # requests admitted (first admission)
    queue_seconds: float = 0.0  # their total wait from arrival to first admission
    # requests per QUEUE_BUCKETS bucket (not cumulative; past the last bucket: only in queue_count)
    queue_buckets: list[int] = field(default_factory=lambda: [0] * len(QUEUE_BUCKETS))
    preempted: dict[str, int] = field(default_factory=lambda: {"kv": 0, "share": 0})

    def add(self, other: TenantUsage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.generated_tokens += other.generated_tokens
        self.queue_count += other.queue_count
        self.queue_seconds += other.queue_seconds
        self.queue_buckets = [a + b for a, b in zip(self.queue_buckets, other.queue_buckets)]
        for k, v in other.preempted.items():
            self.preempted[k] = self.preempted.get(k, 0) + v

    def copy(self) -> TenantUsage:
        out = TenantUsage()
        out.add(self)
        return out


@dataclass(frozen=True)
class TenantReport:
    """What `Engine.tenant_stats` reports: usage of the named tenants and of the others summed, and
    the active clients' fairness state."""

    named: dict[Client, TenantUsage]
    other: TenantUsage
    active: list[ActiveClient]
    scheduling: str = "fair"


class TenantLedger:
    """Per-tenant usage with a bounded set of named tenants (module docstring).

    A tenant is named while there is room (at most `named`); past that its usage goes to "other",
    and at each `snapshot` an unnamed tenant served more than twice as much recently (tokens decayed
    with a `half_life_s` half-life) as the least served named one takes its place: the named one's
    totals are folded into "other" (which only grows) and the newcomer starts at 0. Every reported
    total is monotonic, and the sum over names and "other" is the total served."""

    CANDIDATES = 1024  # unnamed tenants whose recent service is tracked

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, named: int = NAMED_TENANTS,
                 half_life_s: float = RECENT_HALF_LIFE_S):
        self.clock, self.capacity, self.half_life_s = clock, max(0, int(named)), float(half_life_s)
        self.named: dict[Client, TenantUsage] = {}
        self.other = TenantUsage()
        self._recent: dict[Client, tuple[float, float]] = {}  # tenant -> (decayed tokens, at)

    def _usage(self, client: Client) -> TenantUsage:
        u = self.named.get(client)
        if u is None:
            if len(self.named) < self.capacity:
                u = self.named[client] = TenantUsage()
            else:
                u = self.other
        return u

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        v, at = entry
        return v * 0.5 ** ((now - at) / self.half_life_s)

    def served(self, client: Client, prompt: int, generated: int) -> None:
        u = self._usage(client)
        u.prompt_tokens += max(0, prompt)
        u.generated_tokens += max(0, generated)
        now = self.clock()
        entry = self._recent.get(client)
        self._recent[client] = ((self._decayed(entry, now) if entry else 0.0) + prompt + generated, now)
        if len(self._recent) > self.capacity + self.CANDIDATES:
            unnamed = [c for c in self._recent if c not in self.named]
            unnamed.sort(key=lambda c: self._decayed(self._recent[c], now), reverse=True)
            keep = unnamed[: self.CANDIDATES // 2]
            self._recent = {c: self._recent[c] for c in (*self.named, *keep) if c in self._recent}

    def queued(self, client: Client, seconds: float) -> None:
        u = self._usage(client)
        s = max(0.0, float(seconds))
        u.queue_count += 1
        u.queue_seconds += s
        for i, b in enumerate(QUEUE_BUCKETS):
            if s <= b:
                u.queue_buckets[i] += 1
                break

    def preempted(self, client: Client, reason: str) -> None:
        u = self._usage(client)
        u.preempted[reason] = u.preempted.get(reason, 0) + 1

    def rebalance(self) -> None:
        """Name the most recently served tenants (module docstring); at most `capacity` swaps."""
        if not self.named or len(self.named) < self.capacity:
            return
        now = self.clock()
        rate = {c: self._decayed(e, now) for c, e in self._recent.items()}
        outside = sorted((c for c in rate if c not in self.named), key=lambda c: rate[c], reverse=True)
        for c in outside:
            low = min(self.named, key=lambda n: rate.get(n, 0.0))
            if rate[c] <= 2.0 * rate.get(low, 0.0):
                break
            self.other.add(self.named.pop(low))
            self.named[c] = TenantUsage()

    def snapshot(self) -> tuple[dict[Client, TenantUsage], TenantUsage]:
        """(named tenant -> usage, the other tenants' sum), copies."""
        self.rebalance()
        return {c: u.copy() for c, u in self.named.items()}, self.other.copy()
