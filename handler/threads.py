"""Thread priority for background work that must yield to serving (adapter loads, grammar
matchers), fair shares of the work a tenant can pile up (`TenantQueues`, `FairThreadPool`), and
the hand-over of the engine thread's events to the serving loop (`LoopInbox`).
Imports nothing of handler/: every room may use it."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading


def lower_thread_priority(nice: int) -> None:
    """Run the calling thread at `nice` (Linux: per thread; threads it starts, such as an OpenMP
    team, inherit it). Never raises: a platform without it keeps the default priority."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(int(nice), current))
    except (AttributeError, OSError):
        pass


# ------------------------------------------------------------------------------ fair shares
#
# Work that one tenant can pile up (large-body parsing and tokenizing, grammar compiles and matcher
# builds) waits in per-tenant queues, served by deficit round robin, never first come first served:
# one tenant's backlog waits behind its own work only. `TenantQueues` is the bookkeeping (pure, no
# I/O, no locks: unit-tested on its own in tests/handler/test_fair_share.py); `FairThreadPool` runs
# jobs from it on a few threads (handler.serving.prep, handler.grammar.constrained.GrammarBuilder);
# handler.grammar.pool hands grammar worker processes out from one. Embeddings keep their own
# batch-forming deficit round robin (handler.embed.model.FairQueue).


class QueueFull(Exception):
    """The tenant's own queue is full (or the shared cap is reached and the tenant already holds its
    share of it): answered 429 by the caller."""


class TenantQueues:
    """Per-tenant FIFO queues served by deficit round robin (DRR) by cost, with a cap on what a tenant
    may have running and on what it may have waiting.

    - `admits(tenant)`: the tenant has fewer than `tenant_cap` waiting, and either the shared count
      of waiting items is under `total_cap` or the tenant holds less than its fair share of it
      (`total_cap` / tenants with waiting items, it included). So a tenant's backlog never counts
      against another: a tenant with nothing waiting is always admitted.
    - `pop()`: the next item by DRR among the tenants with fewer than `running_cap` items running
      (`running_cap` below the number of servers keeps one for the others). A tenant whose turn
      comes gets `quantum` of credit and is served while its head item's cost fits its credit; then
      the turn passes on. A tenant whose queue empties leaves the round with its credit reset (idle
      time is not banked). `pop` counts the item running; `done(tenant)` when it ends.
    - `remove(tenant, item)`: a waiting item whose requester went away.

    With every cost 1 and quantum 1 this is plain round robin across tenants."""

    def __init__(self, *, tenant_cap: int = 16, total_cap: int = 64, running_cap: int = 1, quantum: int = 1):
        self.tenant_cap = max(1, int(tenant_cap))
        self.total_cap = max(1, int(total_cap))
        self.running_cap = max(1, int(running_cap))
        self.quantum = max(1, int(quantum))
        # the tenants with waiting items, in turn order
        self._queues: dict[str, collections.deque] = collections.OrderedDict()
        self._credit: dict[str, int] = {}
        self._turn: str | None = None  # the tenant whose turn is under way (its credit already given)
        self._running: collections.Counter = collections.Counter()
        self.waiting = 0  # items waiting, all tenants

    def __len__(self) -> int:
        return self.waiting

    def waiting_of(self, tenant: str) -> int:
        q = self._queues.get(tenant)
        return len(q) if q else 0

    def running_of(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    def tenants(self) -> dict[str, dict[str, int]]:
        """{tenant: {"waiting": n, "running": n}} of every tenant with something waiting or running."""
        names = list(self._queues) + [t for t in self._running if t not in self._queues]
        return {t: {"waiting": self.waiting_of(t), "running": self.running_of(t)} for t in names}

    def admits(self, tenant: str) -> bool:
        mine = self.waiting_of(tenant)
        if mine >= self.tenant_cap:
            return False
        if self.waiting < self.total_cap:
            return True
        sharing = len(self._queues) + (0 if mine else 1)
        return mine < self.total_cap // max(1, sharing)

    def push(self, tenant: str, item, cost: int = 1) -> None:
        """Queue `item` (whether the tenant is admitted is the caller's check: `admits`)."""
        q = self._queues.get(tenant)
        if q is None:
            q = self._queues[tenant] = collections.deque()
            self._credit[tenant] = 0
        q.append((max(1, int(cost)), item))
        self.waiting += 1

    def remove(self, tenant: str, item) -> bool:
        q = self._queues.get(tenant)
        if not q:
            return False
        for i, (_, it) in enumerate(q):
            if it is item:
                del q[i]
                self.waiting -= 1
                if not q:
                    self._leave(tenant)
                return True
        return False

    def _leave(self, tenant: str) -> None:
        del self._queues[tenant]
        self._credit.pop(tenant, None)
        if self._turn == tenant:
            self._turn = None

    def pop(self):
        """(tenant, item) to run next, counted running; None when nothing waiting may run now."""
        if not any(self._running.get(t, 0) < self.running_cap for t in self._queues):
            return None
        while True:
            tenant = next(iter(self._queues))
            q = self._queues[tenant]
            if self._running.get(tenant, 0) >= self.running_cap:
                self._queues.move_to_end(tenant)  # at its cap: skipped, no credit (it is not served)
                if self._turn == tenant:
                    self._turn = None
                continue
            if self._turn != tenant:
                self._turn = tenant
                self._credit[tenant] += self.quantum
            cost, item = q[0]
            if cost <= self._credit[tenant]:
                q.popleft()
                self.waiting -= 1
                self._credit[tenant] -= cost
                self._running[tenant] += 1
                if not q:
                    self._leave(tenant)
                return tenant, item
            self._queues.move_to_end(tenant)  # its turn is over: credit kept for the next round
            self._turn = None

    def done(self, tenant: str) -> None:
        n = self._running.get(tenant, 0) - 1
        if n > 0:
            self._running[tenant] = n
        else:
            self._running.pop(tenant, None)


class _ThreadJob:
    __slots__ = ("fn", "args", "future", "loop")

    def __init__(self, fn, args, future, loop):
        self.fn, self.args, self.future, self.loop = fn, args, future, loop


class FairThreadPool:
    """A few threads that run blocking jobs (`await pool.run(tenant, cost, fn, *args)`) taken from
    `TenantQueues`: per-tenant queues by deficit round robin of `cost`, at most `running_cap`
    threads per tenant (default: all but one, so one tenant's stream of large jobs leaves a thread to
    the others), at most `tenant_cap` jobs waiting per tenant (`QueueFull` above: the caller's 429).
    A job whose awaiting coroutine is cancelled before it starts is dropped; one already running
    finishes on its thread and its result is dropped. Each thread runs at `nice` (when given) with
    `stack_bytes` of stack (when given)."""

    def __init__(self, threads: int = 2, *, name: str = "lorafarm-fair", tenant_cap: int = 8, total_cap: int = 64,
                 running_cap: int | None = None, quantum: int = 1, nice: int | None = None,
                 stack_bytes: int | None = None):
        self.threads = max(1, int(threads))
        self.name = name
        self.nice = nice
        self.stack_bytes = stack_bytes
        self.queues = TenantQueues(tenant_cap=tenant_cap, total_cap=total_cap, quantum=quantum,
                                   running_cap=running_cap if running_cap is not None else max(1, self.threads - 1))
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closed = False
        # counters (metrics, stats)
        self.jobs = 0  # jobs run to the end
        self.refused = 0  # QueueFull
        self.cancelled = 0  # dropped before they ran

    def start(self) -> "FairThreadPool":
        if self._threads:
            return self
        old = threading.stack_size()
        if self.stack_bytes:
            threading.stack_size(self.stack_bytes)
        try:
            for i in range(self.threads):
                t = threading.Thread(target=self._loop, name=f"{self.name}-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        finally:
            if self.stack_bytes:
                threading.stack_size(old)
        return self

    def close(self) -> None:
        with self._cv:
            self._closed = True
            while True:
                nxt = self.queues.pop()
                if nxt is None:
                    break
                tenant, job = nxt
                self.queues.done(tenant)
                job.loop.call_soon_threadsafe(_cancel, job.future)
            self._cv.notify_all()

    def stats(self) -> dict:
        with self._cv:
            return {"threads": self.threads, "waiting": self.queues.waiting, "jobs": self.jobs,
                    "refused": self.refused, "cancelled": self.cancelled, "tenants": self.queues.tenants()}

    async def run(self, tenant: str, cost: int, fn, *args):
        """`fn(*args)` on one of the threads, in the tenant's turn; its result or exception."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        job = _ThreadJob(fn, args, fut, loop)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if not self.queues.admits(tenant):
                self.refused += 1
                raise QueueFull(tenant)
            self.queues.push(tenant, job, cost)
            self._cv.notify()
        try:
            return await fut
        except BaseException:
            if not fut.done():
                fut.cancel()
            with self._cv:
                if self.queues.remove(tenant, job):
                    self.cancelled += 1
            raise

    def _loop(self) -> None:
        if self.nice is not None:
            lower_thread_priority(self.nice)
        while True:
            with self._cv:
                while True:
                    if self._closed:
                        return
                    nxt = self.queues.pop()
                    if nxt is not None:
                        break
                    self._cv.wait()
            tenant, job = nxt
            ran = not job.future.cancelled()
            result = error = None
            if ran:
                try:
                    result = job.fn(*job.args)
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                    error = e
            with self._cv:  # counted done before its caller hears of it
                self.queues.done(tenant)
                if ran:
                    self.jobs += 1
                else:
                    self.cancelled += 1
                self._cv.notify_all()  # the tenant may be under its cap again
            if ran:
                try:
                    job.loop.call_soon_threadsafe(_settle, job.future, result, error)
                except RuntimeError:  # the loop is closed (shutdown)
                    pass
            del job, result, error


def _settle(fut, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _cancel(fut) -> None:
    if not fut.done():
        fut.cancel()


class LoopInbox:
    """Calls posted from other threads (the engine's events), run on an asyncio loop in the order
    posted, with one wake-up of the loop per batch: the engine posts one event per row and step, and
    a wake-up per event (a self-pipe write, a GIL hand-over) would cost the loop and the engine
    thread more than the events do. A post after the loop closed is dropped (shutdown)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list = []
        self._scheduled = False

    def post(self, fn, arg) -> None:
        with self._lock:
            self._items.append((fn, arg))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for fn, arg in items:
            try:
                fn(arg)
            except Exception:  # noqa: BLE001 - one receiver's failure loses no other's event
                logging.getLogger(__name__).exception("posted call %r failed", fn)
