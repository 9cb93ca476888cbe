"""The slot policy of a replica's adapter cache: pure bookkeeping, no torch, no I/O.

One `SlotPolicy` decides, for one replica, where every adapter sits and what to evict; the
mechanics (read, verify, mount, unmount: `handler.adapters.cache.AdapterCache`) and the fleet simulator
(`loadtests/simulate.py`) both drive it, so the simulator runs the policy the replicas run.

Tiers, fastest first: ``gpu`` (a device slot of a rank pool), ``ram``, ``disk``, ``remote`` (only in
the store; the policy holds no entry). An adapter is in the fastest tier that holds it; the tiers are
inclusive where the mechanics make them so (a mounted adapter normally also has a RAM copy).

Contract
- Device: `pools` maps a pool rank to its slot count. An adapter of rank r goes to the smallest pool
  whose rank is >= r and that has slots (`pool_for`). A slot holds one adapter with a reference count
  (running requests). An adapter whose count is > 0, or that is held (`hold`: a caller is about to
  take a reference, or it is draining), is never chosen as a victim; among the idle, unheld adapters
  of the pool the least recently used (by `clock`) goes first. `evictions_in_use` counts evictions of
  an adapter with references and must stay 0 (it can only move if a caller `evict`s by hand).
- A mount goes in three steps: `plan_mount(adapter_id, pool)` says ``("free", None)`` (a slot is
  free; it is now reserved for this adapter), ``("evict", victim)`` (evict `victim` first, then ask
  again) or ``("wait", None)`` (every slot of the pool is busy or reserved: wait for a `release`,
  then ask again). Then `on_mounted(adapter_id, pool)` turns the reservation into a resident slot
  (refs 0), or `cancel_mount(adapter_id)` gives the reservation back when the mount failed.
- `evict(victim)` removes the victim's slot and counts it; `undo_evict(entry)` puts it back and
  un-counts it when the mechanics could not unmount.
- RAM and disk: byte-bounded LRU lists. `put(tier, id, nbytes)` adds (or touches) an entry and
  returns the victims it pushed out (already removed here; the caller frees their bytes). An entry
  larger than the whole tier is not stored (returns None). Disk victims skip pinned entries
  (`pin_disk`: being read) and the entry just put; RAM victims skip the entry just put and are
  taken from adapters not in a device slot first (a mounted adapter keeps its RAM copy while the
  budget allows, so an eviction from the device demotes it to RAM).
- Popularity: `note_request(id)` counts requests per adapter as an exponentially decayed rate
  (half-life `popularity_half_life_s`); `popular(n)` gives the n most requested, for prefetch.
- `acquire(adapter_id, rank, size)` composes the above for a caller without its own mechanics
  (the simulator): it returns a `Plan` whose `action` is ``"hit"`` (resident: a reference was
  taken), ``"join"`` (a load of it is in flight: wait for that load's `on_loaded`, then acquire
  again with ``retry=True``), ``"wait"`` (its pool is all busy: acquire again with ``retry=True``
  after a `release` in that pool), or ``"load"`` (a slot is reserved; `victim`, if set, was
  evicted; load it from `tier`, then call `on_loaded`, which mounts it with one reference and puts
  it in RAM and disk). `tier` is where the request found it, counted once per request
  (``retry=True`` does not count again).
- Counters (`SlotCounters`): loads per source tier, load errors, device/RAM/disk evictions,
  in-use evictions, slot hits/misses, slot waits, and the last 256 device evictions.

Everything runs on one thread (the replica's event loop, or the simulator's); nothing here blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

TIERS = ("gpu", "ram", "disk", "remote")


@dataclass
class SlotCounters:
    loads: dict[str, int] = field(default_factory=lambda: {"ram": 0, "disk": 0, "remote": 0})
    load_errors: int = 0
    evictions: int = 0  # device-slot evictions
    evictions_in_use: int = 0  # must stay 0: an adapter with running requests evicted
    ram_evictions: int = 0
    disk_evictions: int = 0
    slot_hits: int = 0
    slot_misses: int = 0
    slot_waits: int = 0  # a load had to wait for a busy pool's slot to become idle
    eviction_log: list[tuple[float, str, int]] = field(default_factory=list)  # (time, id, refs) last 256


@dataclass
class Slot:
    """A resident device slot."""

    adapter_id: str
    pool: int
    refs: int = 0
    last_used: float = 0.0
    mounted_at: float = 0.0


@dataclass(frozen=True)
class Plan:
    """What `SlotPolicy.acquire` decided: see the module docstring."""

    adapter_id: str
    action: str  # hit | join | wait | load
    tier: str  # where the request found the adapter
    pool: int
    victim: str | None = None


class SlotPolicy:
    """See the module docstring (it is the contract)."""

    def __init__(self, pools: dict[int, int], *, ram_bytes: int, disk_bytes: int,
                 clock: Callable[[], float] = time.monotonic, popularity_half_life_s: float = 300.0):
        self.pools = {int(r): int(s) for r, s in sorted(pools.items())}
        self.clock = clock
        self.counters = SlotCounters()
        self._slots: dict[str, Slot] = {}
        self._reserved: dict[str, int] = {}  # adapter_id -> pool: a mount in flight
        self._held: dict[str, int] = {}  # adapter_id -> holders: not evictable
        self._lists: dict[str, OrderedDict[str, int]] = {"ram": OrderedDict(), "disk": OrderedDict()}
        self._used = {"ram": 0, "disk": 0}
        self._budget = {"ram": int(ram_bytes), "disk": int(disk_bytes)}
        self._pinned_disk: dict[str, int] = {}
        self._load_size: dict[str, int] = {}  # acquire(): sizes of loads in flight
        self.popularity_half_life_s = float(popularity_half_life_s)
        self._pop: dict[str, tuple[float, float]] = {}  # adapter_id -> (decayed count, at)

    # -- popularity ---------------------------------------------------------------------------

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        score, at = entry
        return score * 0.5 ** ((now - at) / self.popularity_half_life_s)

    def note_request(self, adapter_id: str) -> None:
        """One request for `adapter_id` (its popularity: a count decayed with the half-life)."""
        now = self.clock()
        entry = self._pop.get(adapter_id)
        self._pop[adapter_id] = ((self._decayed(entry, now) if entry else 0.0) + 1.0, now)
        if len(self._pop) > 100_000:  # bounded: keep the more popular half
            keep = sorted(self._pop, key=lambda a: self._decayed(self._pop[a], now), reverse=True)[:50_000]
            self._pop = {a: self._pop[a] for a in keep}

    def forget(self, adapter_id: str) -> None:
        """Drop its popularity (an explicit unload is not to be undone by prefetch)."""
        self._pop.pop(adapter_id, None)

    def popular(self, n: int) -> list[str]:
        """The `n` adapters with the most (decayed) requests, most popular first."""
        now = self.clock()
        return sorted(self._pop, key=lambda a: (-self._decayed(self._pop[a], now), a))[: max(0, n)]

    # -- queries ---------------------------------------------------------------------------

    def pool_for(self, rank: int) -> int:
        """The rank of the smallest pool with slots that fits `rank`; ValueError if none does."""
        for r, s in self.pools.items():
            if r >= rank and s > 0:
                return r
        raise ValueError(f"no rank pool fits rank {rank} (pools {self.pools})")

    def tier_of(self, adapter_id: str) -> str:
        if adapter_id in self._slots:
            return "gpu"
        for tier in ("ram", "disk"):
            if adapter_id in self._lists[tier]:
                return tier
        return "remote"

    def slot(self, adapter_id: str) -> Slot | None:
        return self._slots.get(adapter_id)

    def refcount(self, adapter_id: str) -> int:
        s = self._slots.get(adapter_id)
        return s.refs if s else 0

    def resident(self, tier: str) -> list[str]:
        """Adapters in a tier, least recently used first (gpu: in mount order)."""
        return list(self._slots) if tier == "gpu" else list(self._lists[tier])

    def used_bytes(self, tier: str) -> int:
        return self._used[tier]

    def count(self, tier: str) -> int:
        return len(self._slots) if tier == "gpu" else len(self._lists[tier])

    def nbytes(self, tier: str, adapter_id: str) -> int | None:
        return self._lists[tier].get(adapter_id)

    def free_slots(self, pool: int) -> int:
        """Slots of the pool neither resident nor reserved."""
        taken = sum(1 for s in self._slots.values() if s.pool == pool)
        taken += sum(1 for p in self._reserved.values() if p == pool)
        return self.pools.get(pool, 0) - taken

    def is_loading(self, adapter_id: str) -> bool:
        return adapter_id in self._reserved

    # -- references -------------------------------------------------------------------------

    def take_ref(self, adapter_id: str) -> bool:
        """One more running request on a resident adapter; False if it is not resident."""
        s = self._slots.get(adapter_id)
        if s is None:
            return False
        s.refs += 1
        s.last_used = self.clock()
        return True

    def release(self, adapter_id: str) -> bool:
        """One request fewer. Returns True when it became idle (evictable; wake slot waiters);
        False for a release without a reference (nothing changes)."""
        s = self._slots.get(adapter_id)
        if s is None or s.refs <= 0:
            return False
        s.refs -= 1
        s.last_used = self.clock()
        return s.refs == 0

    def touch(self, adapter_id: str, tier: str = "gpu") -> None:
        """Mark as just used in `tier` (LRU order)."""
        if tier == "gpu":
            s = self._slots.get(adapter_id)
            if s is not None:
                s.last_used = self.clock()
        elif adapter_id in self._lists[tier]:
            self._lists[tier].move_to_end(adapter_id)

    def hold(self, adapter_id: str) -> None:
        """Not evictable until a matching `unhold` (a reference is about to be taken, or a drain)."""
        self._held[adapter_id] = self._held.get(adapter_id, 0) + 1

    def unhold(self, adapter_id: str) -> None:
        n = self._held.get(adapter_id, 1) - 1
        if n <= 0:
            self._held.pop(adapter_id, None)
        else:
            self._held[adapter_id] = n

    def count_request(self, tier: str) -> None:
        """A request found its adapter in `tier` (gpu: a hit, else a miss)."""
        if tier == "gpu":
            self.counters.slot_hits += 1
        else:
            self.counters.slot_misses += 1

    def count_load(self, tier: str, ok: bool = True) -> None:
        """A load from `tier` finished (an adapter found in a slot that had to be remounted counts
        as a RAM load)."""
        if ok:
            self.counters.loads["ram" if tier == "gpu" else tier] += 1
        else:
            self.counters.load_errors += 1

    # -- device slots ------------------------------------------------------------------------

    def lru_idle(self, pool: int) -> str | None:
        """The least recently used idle, unheld resident adapter of the pool (the next victim)."""
        best: Slot | None = None
        for aid, s in self._slots.items():
            if s.pool == pool and s.refs == 0 and aid not in self._held:
                if best is None or s.last_used < best.last_used:
                    best = s
        return best.adapter_id if best else None

    def plan_mount(self, adapter_id: str, pool: int) -> tuple[str, str | None]:
        """("free", None): a slot is now reserved for `adapter_id`; ("evict", victim); ("wait", None)."""
        if adapter_id in self._reserved:
            return "free", None
        if self.free_slots(pool) > 0:
            self._reserved[adapter_id] = pool
            return "free", None
        victim = self.lru_idle(pool)
        if victim is not None:
            return "evict", victim
        return "wait", None

    def count_wait(self) -> None:
        self.counters.slot_waits += 1

    def on_mounted(self, adapter_id: str, pool: int) -> Slot:
        self._reserved.pop(adapter_id, None)
        now = self.clock()
        s = self._slots[adapter_id] = Slot(adapter_id, pool, 0, now, now)
        return s

    def cancel_mount(self, adapter_id: str) -> None:
        self._reserved.pop(adapter_id, None)
        self._load_size.pop(adapter_id, None)

    def evict(self, adapter_id: str) -> Slot:
        """Remove a resident slot (no new reference can land on it) and count the eviction."""
        s = self._slots.pop(adapter_id)
        c = self.counters
        if s.refs > 0:  # never happens through plan_mount; counted so tests and alerts can prove it
            c.evictions_in_use += 1
        c.evictions += 1
        c.eviction_log.append((time.time(), adapter_id, s.refs))
        del c.eviction_log[:-256]
        return s

    def restore(self, s: Slot) -> None:
        """Put back a slot removed by `unmount` (the mechanics could not unmount it)."""
        self._slots[s.adapter_id] = s

    def undo_evict(self, s: Slot) -> None:
        """The mechanics could not unmount: the slot is resident again, the eviction un-counted."""
        self.restore(s)
        c = self.counters
        c.evictions -= 1
        if s.refs > 0:
            c.evictions_in_use -= 1
        for i in range(len(c.eviction_log) - 1, -1, -1):
            if c.eviction_log[i][1] == s.adapter_id:
                del c.eviction_log[i]
                break

    def unmount(self, adapter_id: str) -> Slot | None:
        """Remove a resident slot without counting an eviction (an explicit unload)."""
        return self._slots.pop(adapter_id, None)

    # -- RAM and disk ------------------------------------------------------------------------

    @property
    def ram_bytes(self) -> int:
        return self._budget["ram"]

    @property
    def disk_bytes(self) -> int:
        return self._budget["disk"]

    def set_budget(self, tier: str, nbytes: int) -> list[str]:
        """Change `tier`'s byte budget; returns the LRU victims pushed out by a smaller one."""
        self._budget[tier] = int(nbytes)
        return self.trim(tier)

    def put(self, tier: str, adapter_id: str, nbytes: int) -> list[str] | None:
        """Add (or touch) `adapter_id` in `tier` ("ram" or "disk"); return the LRU victims pushed out
        (removed here, counted), or None when it is larger than the whole tier (not stored)."""
        lst = self._lists[tier]
        if adapter_id in lst:
            lst.move_to_end(adapter_id)
            return []
        if nbytes > self._budget[tier]:
            return None
        lst[adapter_id] = int(nbytes)
        self._used[tier] += int(nbytes)
        return self.trim(tier, keep=adapter_id)

    def trim(self, tier: str, keep: str | None = None) -> list[str]:
        """Evict LRU entries of `tier` until it fits its budget (skipping `keep` and pinned disk
        entries); returns the victims (removed here, counted). RAM evicts the copies of adapters not
        in a device slot first: a mounted adapter's RAM copy is what it is demoted to when its slot
        is taken (device -> RAM, not to nothing)."""
        lst = self._lists[tier]
        victims = []
        order = list(lst)
        if tier == "ram":
            order = [a for a in order if a not in self._slots] + [a for a in order if a in self._slots]
        for victim in order:
            if self._used[tier] <= self._budget[tier]:
                break
            if victim == keep or (tier == "disk" and victim in self._pinned_disk):
                continue
            self.drop(tier, victim)
            victims.append(victim)
            if tier == "ram":
                self.counters.ram_evictions += 1
            else:
                self.counters.disk_evictions += 1
        return victims

    def drop(self, tier: str, adapter_id: str) -> int | None:
        """Remove an entry without counting an eviction; returns its bytes (None if absent)."""
        nbytes = self._lists[tier].pop(adapter_id, None)
        if nbytes is not None:
            self._used[tier] -= nbytes
        return nbytes

    def pin_disk(self, adapter_id: str) -> None:
        """Not evicted from disk until a matching `unpin_disk` (being read)."""
        self._pinned_disk[adapter_id] = self._pinned_disk.get(adapter_id, 0) + 1

    def unpin_disk(self, adapter_id: str) -> None:
        n = self._pinned_disk.get(adapter_id, 1) - 1
        if n <= 0:
            self._pinned_disk.pop(adapter_id, None)
        else:
            self._pinned_disk[adapter_id] = n

    def is_pinned_disk(self, adapter_id: str) -> bool:
        return adapter_id in self._pinned_disk

    # -- composed, for callers without mechanics (the simulator) ----------------------------

    def acquire(self, adapter_id: str, rank: int, size: int = 0, *, retry: bool = False) -> Plan:
        """See the module docstring: hit, join, wait or load (a slot reserved, a victim evicted)."""
        tier = self.tier_of(adapter_id)
        pool = self.pool_for(rank)
        if not retry:
            self.count_request(tier)
            self.note_request(adapter_id)
        if self.take_ref(adapter_id):
            return Plan(adapter_id, "hit", tier, pool)
        if adapter_id in self._reserved:
            return Plan(adapter_id, "join", tier, pool)
        while True:
            step, victim = self.plan_mount(adapter_id, pool)
            if step == "free":
                self._load_size[adapter_id] = int(size)
                return Plan(adapter_id, "load", tier, pool, victim=None)
            if step == "wait":
                if not retry:
                    self.count_wait()
                return Plan(adapter_id, "wait", tier, pool)
            self.evict(victim)
            step, _ = self.plan_mount(adapter_id, pool)
            if step == "free":
                self._load_size[adapter_id] = int(size)
                return Plan(adapter_id, "load", tier, pool, victim=victim)

    def on_loaded(self, plan: Plan, ok: bool = True) -> dict[str, list[str]]:
        """The load of an `acquire` plan finished: on success mount it with one reference and keep it
        in RAM and disk; returns the RAM/disk victims it pushed out. On failure free the reservation."""
        aid = plan.adapter_id
        size = self._load_size.pop(aid, 0)
        self.count_load(plan.tier, ok)
        if not ok:
            self.cancel_mount(aid)
            return {"ram": [], "disk": []}
        self.on_mounted(aid, plan.pool)
        self.take_ref(aid)
        out = {}
        for tier in ("ram", "disk"):
            out[tier] = self.put(tier, aid, size) or []
        return out


SEED_LOAD_MS = {"gpu": 0.0, "ram": 8.0, "disk": 40.0, "remote": 400.0}  # the seed's budgets, 80 MB adapter
SEED_BYTES = 80 * 1024 * 1024


class LoadTimes:
    """Expected load time per source tier and size: exponential moving averages, per tier, of the
    load time per byte (and of the load time itself, for an adapter whose size is not known here).

        per_byte[t] <- (1 - w) * per_byte[t] + w * seconds / bytes      (w = `weight`)
        expected_ms(t, bytes) = 1000 * per_byte[t] * bytes               (gpu: 0)

    Until a tier has been measured its estimate is the seed's budget (8 ms RAM, 40 ms disk, 0.4 s
    remote for an 80 MB adapter), scaled by size."""

    def __init__(self, weight: float = 0.2, defaults_ms: dict[str, float] | None = None):
        self.weight = float(weight)
        d = dict(SEED_LOAD_MS, **(defaults_ms or {}))
        self._per_byte = {t: d[t] / 1000.0 / SEED_BYTES for t in ("ram", "disk", "remote")}
        self._ms = {t: d[t] for t in ("ram", "disk", "remote")}
        self.samples = {t: 0 for t in ("ram", "disk", "remote")}

    def observe(self, tier: str, seconds: float, nbytes: int) -> None:
        if tier not in self._ms or seconds < 0:
            return
        w = self.weight if self.samples[tier] else 1.0
        self._ms[tier] += w * (seconds * 1000.0 - self._ms[tier])
        if nbytes > 0:
            self._per_byte[tier] += w * (seconds / nbytes - self._per_byte[tier])
        self.samples[tier] += 1

    def expected_ms(self, tier: str, nbytes: int | None = None) -> float:
        if tier == "gpu":
            return 0.0
        if not nbytes:
            return self._ms[tier]
        return 1000.0 * self._per_byte[tier] * nbytes

    def averages_ms(self) -> dict[str, float]:
        """The moving average of one load per tier (ms)."""
        return {t: round(v, 3) for t, v in self._ms.items()}
