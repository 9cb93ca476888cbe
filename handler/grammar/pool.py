"""Untrusted grammar work behind a process boundary.

A request's `response_format` JSON schema or `tools` are untrusted input to llguidance, a native
library: a `$defs` chain of 1,000 `$ref` links overflows its stack and kills the process (SIGSEGV),
an object of 10,000 optional properties takes tens of seconds to compile, a large enum takes tens
of MB. So the replica never compiles one in its own process or on its event loop:

    pool = GrammarPool(constrained.tokenizer_spec(tokenizer, vocab), workers=2, timeout_s=4,
                       memory_bytes=1 << 30)
    await pool.start()
    compiled = await pool.compile({"kind": "json_schema", "schema": {...}}, tenant="t1")
    # -> WorkerResult(grammar, cost, compile_s), or GrammarError (-> 400 invalid_schema)

Each worker is a small Python process (`python -c ... _worker_main`; llguidance only: no torch, no
transformers) at a lower CPU priority (nice 10, the decode loop wins a shared core). Per job it:

  1. builds the grammar string (handler.grammar.constrained.json_schema_grammar / tools_grammar);
  2. compiles it into a matcher on a thread with an 8 MiB stack (WORKER_STACK_BYTES);
  3. test-runs it (`_probe`): up to PROBE_STEPS masks and advances along a deterministic walk of
     allowed tokens, with llguidance's executor, as the engine computes masks. This is where
     parser limits show (an object of >= 1,000 optional properties: "Current row has 4,003 items;
     max is 2,000" after the first `{`; a recursive required `$ref` with no finite instance: "Too
     many items"), so such a schema is a 400 before generation;
  4. answers the grammar string and the bytes the compile took (RSS growth), which the replica uses
     as the entry's cost in its byte-bounded cache.

Limits, each failing only its own request with `GrammarError` (a 400 `invalid_schema` naming the
limit) while the pool respawns the worker: the wall time (`timeout_s`: the worker is killed), the
memory (`memory_bytes`: RLIMIT_DATA set to the worker's baseline + this; an allocation past it
aborts the worker or raises MemoryError), a crash (any signal: SIGSEGV, SIGABRT). A worker is also
recycled after MAX_JOBS jobs or when it grew by half its memory budget (fragmentation).

Fair by tenant (issue 35): compiles wait in per-tenant queues (handler.threads.TenantQueues) and a
free worker goes to the next tenant in round robin, never to the oldest compile. Per tenant at most
`max(1, workers - 1)` compiles run at once (a worker is always left to the others) and at most
`tenant_waiting` wait (`GrammarBusy`, a 429, above: the tenant's own backlog); `max_waiting` caps the
compiles waiting in all, but a tenant holding less than its share of it (`max_waiting` / tenants
waiting) is still admitted, so one tenant's backlog never refuses another's. A compile whose caller
is cancelled (its client went away) leaves its queue at once; one already running is stopped by
killing its worker, and that tenant's running slot stays taken until the replacement worker is up
(so cancelling in a loop cannot take every worker away from the others). `stats()` says who waits
and who runs.

The replica then builds its own matcher from the validated grammar (handler.grammar.constrained.
GrammarBuilder): llguidance drops the GIL while it compiles, so that runs on one background thread
(niced, REPLICA_STACK_BYTES of stack, 8x the worker's: the compile is deterministic, so a grammar
that compiled in the worker cannot overflow the replica's stack). What the engine does with the
matcher afterwards is bounded by llguidance's limits (LLParserLimits defaults but the lexer fuel,
constrained.INITIAL_LEXER_FUEL; the same in worker and replica): a mask costs at most step_lexer_fuel (200k, ~14 ms) + step_max_items (50k,
~2.5 ms); a limit hit mid-generation puts the matcher in an error state, and the engine ends that
row with a grammar error (never "stop" with a broken document).

Test-only fault (read only in the worker): LORAFARM_TEST_GRAMMAR_FAULT=segv|hang|memory makes a job
whose schema's "title" is FAULT_TITLE kill its worker with SIGSEGV, hang, or allocate without bound.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import shutil
import signal
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# a worker builds its grammar strings with constrained's functions; importing it stays light (no
# torch, llguidance only once called), so a worker is still a small process
from handler.grammar import constrained
from handler.grammar.constrained import REPLICA_STACK_BYTES, malloc_trim  # noqa: F401 (importable here too)
from handler.threads import TenantQueues

log = logging.getLogger("lorafarm.replica.grammar")

WORKER_STACK_BYTES = 8 * 1024**2  # the compile thread in a worker (the replica's: REPLICA_STACK_BYTES)
PROBE_STEPS = 24  # test-run steps per grammar
MAX_JOBS = 200  # a worker is replaced after this many jobs
FAULT_ENV = "LORAFARM_TEST_GRAMMAR_FAULT"
FAULT_TITLE = "lorafarm-test-grammar-fault"
_HEADER = struct.Struct(">I")
_MAX_FRAME = 256 * 1024**2


class GrammarError(Exception):
    """A grammar the replica will not serve: the message says why (which limit)."""

    def __init__(self, message: str, limit: str = "invalid"):
        super().__init__(message)
        self.limit = limit  # invalid | parser_limit | timeout | memory | crash | unavailable


class GrammarBusy(Exception):
    """Too many compiles already wait (429)."""


@dataclass
class WorkerResult:
    grammar: str
    cost: int  # bytes the compiled matcher took in the worker (RSS growth), >= 0
    compile_s: float


# ------------------------------------------------------------------------------------------ worker


def _read_frame(f) -> dict | None:
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    data = f.read(n)
    if len(data) < n:
        return None
    return json.loads(data)


def _write_frame(f, obj: dict) -> None:
    data = json.dumps(obj).encode()
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def _statm_bytes(field: int) -> int:
    try:
        return int(open("/proc/self/statm").read().split()[field]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _rss() -> int:
    return _statm_bytes(1)


def _vm_data() -> int:
    return _statm_bytes(5)  # data + stack: what RLIMIT_DATA counts (near enough)


def _allowed(mask: bytearray, n_vocab: int) -> list[int]:
    out = []
    for w, byte in enumerate(mask):
        if byte:
            base = w * 8
            out.extend(base + b for b in range(8) if byte >> b & 1 and base + b < n_vocab)
    return out


def _probe(matcher, executor, n_vocab: int, eos: set[int], steps: int) -> str | None:
    """Test-run a compiled matcher: masks (on llguidance's executor, as the engine computes them) and
    advances along a deterministic walk (forced tokens first, else a seeded pick among the allowed
    non-EOS tokens). The error of the first step that fails, else None."""
    import random

    rng = random.Random(0)
    width = (n_vocab + 31) // 32
    mask = bytearray(width * 4)
    import ctypes

    ptr = ctypes.addressof((ctypes.c_char * len(mask)).from_buffer(mask))
    for _ in range(steps):
        if matcher.is_error():
            return matcher.get_error()
        if matcher.is_stopped():
            return None
        executor.unsafe_compute_mask_ptr([(matcher, 0)], ptr, width * 4, 1)
        if matcher.is_error():
            return matcher.get_error()
        allowed = _allowed(mask, n_vocab)
        if not allowed:
            return "the grammar allows no token"
        choices = [t for t in allowed if t not in eos]
        if not choices:
            return None  # only the end remains: a complete document
        matcher.consume_token(rng.choice(choices))
    return matcher.get_error() if matcher.is_error() else None


def _first_line(err: str) -> str:
    return (err or "").strip().split("\n", 1)[0][:500]


def _limit_name(err: str) -> str:
    low = err.lower()
    return "parser_limit" if any(w in low for w in ("items", "limit", "fuel", "too many", "max is")) else "invalid"


class _Compiler:
    """The worker's compile thread: a fixed stack size, jobs handed over one at a time."""

    def __init__(self, setup: dict):
        import threading

        from llguidance import LLExecutor, LLTokenizer

        self.n_vocab = int(setup["n_vocab"])
        eos = setup.get("eos")
        self.llt = LLTokenizer(setup["tokenizer"], n_vocab=self.n_vocab, eos_token=eos)
        self.eos = set(self.llt.eos_tokens)
        self.executor = LLExecutor()
        self.probe_steps = int(setup.get("probe_steps", PROBE_STEPS))
        self._jobs: collections.deque = collections.deque()
        self._cv = threading.Condition()
        old = threading.stack_size()
        threading.stack_size(WORKER_STACK_BYTES)
        try:
            self._thread = threading.Thread(target=self._run, name="grammar-compile", daemon=True)
            self._thread.start()
        finally:
            threading.stack_size(old)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job, box, done = self._jobs.popleft()
            try:
                box.append(self._compile(job))
            except MemoryError:
                box.append({"ok": False, "limit": "memory", "error": "the compile ran out of its memory limit"})
            except Exception as e:  # noqa: BLE001 - any failure is this job's 400
                box.append({"ok": False, "limit": "invalid", "error": f"{type(e).__name__}: {e}"})
            done.set()

    def submit(self, job: dict) -> dict:
        import threading

        box: list = []
        done = threading.Event()
        with self._cv:
            self._jobs.append((job, box, done))
            self._cv.notify()
        done.wait()
        return box[0]

    def _grammar(self, job: dict) -> tuple[str, list[dict]]:
        """The grammar string, and the JSON schemas to test-run on their own (a tool's parameters,
        which a walk of a tools grammar rarely reaches)."""
        kind = job["kind"]
        if kind == "json_schema":
            schema = job["schema"]
            try:
                return constrained.json_schema_grammar(schema), []
            except (ValueError, TypeError, RuntimeError) as e:
                raise _Refused(f"the JSON schema is invalid: {e}", "invalid") from None
        if kind == "json_object":
            return constrained.json_object_grammar(), []
        if kind == "tools":
            tools = job["tools"]
            try:
                g = constrained.tools_grammar(tools, job["choice"], bool(job.get("parallel", True)))
            except (ValueError, TypeError, RuntimeError, KeyError) as e:
                raise _Refused(f"the tools cannot be compiled: {e}", "invalid") from None
            params = [t["function"].get("parameters") or {"type": "object"} for t in tools]
            return g, [p for p in params if isinstance(p, dict)]
        raise _Refused(f"unknown grammar kind {kind!r}", "invalid")

    def _check(self, grammar: str) -> None:
        m = constrained.new_base_matcher(self.llt, grammar)
        if m.is_error():
            err = m.get_error()
            raise _Refused(f"the grammar does not compile: {_first_line(err)}", _limit_name(err))
        err = _probe(m, self.executor, self.n_vocab, self.eos, self.probe_steps)
        if err:
            raise _Refused(f"the grammar hits a parser limit: {_first_line(err)}", _limit_name(err))

    def _compile(self, job: dict) -> dict:
        t0 = time.perf_counter()
        fault = os.environ.get(FAULT_ENV, "")
        if fault:
            schemas = [job.get("schema")] + [(t.get("function") or {}).get("parameters") for t in job.get("tools") or []]
            if any(isinstance(x, dict) and x.get("title") == FAULT_TITLE for x in schemas):
                _fault(fault)
        r0 = _rss()
        try:
            grammar, extra = self._grammar(job)
            self._check(grammar)
            for schema in extra:
                self._check(constrained.json_schema_grammar(schema))
        except _Refused as e:
            return {"ok": False, "limit": e.limit, "error": str(e)}
        cost = max(0, _rss() - r0)
        return {"ok": True, "grammar": grammar, "cost": cost, "compile_s": time.perf_counter() - t0}


class _Refused(Exception):
    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


def _fault(kind: str) -> None:
    if kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "hang":
        time.sleep(3600)
    elif kind == "memory":
        hog = []
        while True:
            hog.append(bytearray(64 * 1024**2))


def _worker_main() -> None:
    """A worker process: setup frame on stdin, then one job frame -> one answer frame. Frames go
    over a private copy of fd 1; fd 1 itself is pointed at stderr (nothing else may write frames)."""
    import resource

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    setup = _read_frame(inp)
    if setup is None:
        return
    compiler = _Compiler(setup)
    budget = int(setup.get("memory_bytes", 0))
    baseline = _vm_data()
    if budget > 0:
        limit = baseline + budget
        try:
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        except (ValueError, OSError) as e:
            print(f"grammar worker: cannot set RLIMIT_DATA: {e}", file=sys.stderr, flush=True)
    _write_frame(out, {"ready": True, "pid": os.getpid()})
    jobs = 0
    while True:
        job = _read_frame(inp)
        if job is None:
            return
        answer = compiler.submit(job)
        malloc_trim()
        jobs += 1
        grown = _vm_data() - baseline
        answer["recycle"] = jobs >= MAX_JOBS or (budget > 0 and grown > budget // 2)
        _write_frame(out, answer)
        if answer["recycle"]:
            return


# ------------------------------------------------------------------------------------------ pool


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.stderr: collections.deque[str] = collections.deque(maxlen=20)
        self.reader = asyncio.ensure_future(self._read_stderr())

    async def _read_stderr(self) -> None:
        try:
            while True:
                line = await self.proc.stderr.readline()
                if not line:
                    return
                self.stderr.append(line.decode(errors="replace").rstrip())
        except Exception:  # noqa: BLE001
            return

    async def send(self, obj: dict | bytes) -> None:
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        await self.proc.stdin.drain()

    async def recv(self) -> dict:
        head = await self.proc.stdout.readexactly(_HEADER.size)
        (n,) = _HEADER.unpack(head)
        if n > _MAX_FRAME:
            raise ValueError("oversized frame from a grammar worker")
        return json.loads(await self.proc.stdout.readexactly(n))

    async def kill(self, grace_s: float = 0.0) -> int | None:
        """Its exit status (negative: the signal), killing it first if it still runs after `grace_s`.
        os.kill, not Popen.kill: that polls (reaps) the child on the loop's thread, racing asyncio's
        child watcher, which then reports status 255 instead of the signal the worker died of."""
        if grace_s > 0 and self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except asyncio.TimeoutError:
                pass
        if self.proc.returncode is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            rc = await asyncio.wait_for(self.proc.wait(), 10)
        except asyncio.TimeoutError:
            rc = None
        try:
            await asyncio.wait_for(self.reader, 1)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001
            self.reader.cancel()
        return rc


class GrammarPool:
    """A pool of grammar worker processes (see the module doc)."""

    def __init__(self, tokenizer_spec: dict, *, workers: int = 2, timeout_s: float = 4.0,
                 memory_bytes: int = 1024**3, max_waiting: int = 64, tenant_waiting: int = 16, nice: int = 10,
                 probe_steps: int = PROBE_STEPS, start_timeout_s: float = 60.0):
        if workers < 1:
            raise ValueError("a grammar pool needs at least one worker")
        self.workers = int(workers)
        self.timeout_s = float(timeout_s)
        self.memory_bytes = int(memory_bytes)
        self.max_waiting = int(max_waiting)
        self.tenant_waiting = int(tenant_waiting)
        self.start_timeout_s = float(start_timeout_s)
        self.per_tenant = max(1, self.workers - 1)
        self._setup = {**tokenizer_spec, "memory_bytes": self.memory_bytes, "nice": int(nice),
                       "probe_steps": int(probe_steps)}
        self._started = False
        self._idle: collections.deque[_Worker] = collections.deque()
        self._all: set[_Worker] = set()
        # waiting compiles (futures that get a worker), per tenant, round robin
        self._queues = TenantQueues(tenant_cap=self.tenant_waiting, total_cap=self.max_waiting,
                                    running_cap=self.per_tenant)
        self._closed = False
        self._spawns: set[asyncio.Task] = set()
        # counters (exported by the replica's metrics/state)
        self.compiles = 0
        self.failures: collections.Counter = collections.Counter()  # by limit
        self.respawns = 0
        self.busy = 0  # compiles refused with GrammarBusy (a tenant's queue full)
        self.cancelled = 0  # compiles whose caller went away (waiting or running)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, wait: bool = True) -> None:
        """Start the workers. wait=False (a replica's start): in the background, so that a busy
        machine's slow interpreter starts at the workers' nice do not hold the replica's readiness;
        a compile that comes first waits in its tenant's queue for the first worker up (within
        `start_timeout_s`), as it does for a replacement after a crash."""
        self._started = True
        if not wait:
            for _ in range(self.workers):
                self._spawn_later(respawn=False)
            return
        results = await asyncio.gather(*(self._spawn() for _ in range(self.workers)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if len(failed) == self.workers:
            raise RuntimeError(f"no grammar worker started: {failed[0]}")
        for _ in failed:
            self._respawn_later()

    async def close(self) -> None:
        self._closed = True
        for t in list(self._spawns):
            t.cancel()
        for w in list(self._all):
            await w.kill()
        self._all.clear()
        self._idle.clear()
        while (nxt := self._queues.pop()) is not None:  # waiting compiles: "not running"
            tenant, fut = nxt
            self._queues.done(tenant)
            if not fut.done():
                fut.set_exception(GrammarError("the grammar workers are not running", "unavailable"))

    @property
    def alive(self) -> int:
        return sum(1 for w in self._all if w.proc.returncode is None)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._all if w.proc.returncode is None]

    async def _spawn(self) -> None:
        repo = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "RAYON_NUM_THREADS": os.environ.get("RAYON_NUM_THREADS", "1")}
        # started at its nice already (`nice`): its interpreter start-up and imports (a respawn after
        # a crash) yield the CPU to the decode loop too, not only its compiles
        nice = shutil.which("nice")
        prefix = [nice, "-n", str(self._setup["nice"])] if nice and self._setup["nice"] > 0 else []
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-c", "from handler.grammar.pool import _worker_main; _worker_main()",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, limit=_MAX_FRAME)
        w = _Worker(proc)
        self._all.add(w)
        try:
            await w.send(self._setup)
            hello = await asyncio.wait_for(w.recv(), self.start_timeout_s)
            if not hello.get("ready"):
                raise RuntimeError(f"unexpected hello {hello!r}")
        except BaseException as e:
            self._all.discard(w)
            await w.kill()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise RuntimeError(f"grammar worker did not start: {e}; stderr: {' | '.join(w.stderr)}") from None
        if self._closed:
            self._all.discard(w)
            await w.kill()
            return
        self._give_back(w)

    def _give_back(self, w: _Worker) -> None:
        """A free worker: to the next waiting compile in round robin across tenants, else idle."""
        self._idle.append(w)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._idle:
            nxt = self._queues.pop()
            if nxt is None:
                return
            tenant, fut = nxt
            if fut.done():  # its caller went away just now
                self._queues.done(tenant)
                continue
            fut.set_result(self._idle.popleft())

    def _finish(self, tenant: str) -> None:
        """A compile of `tenant` no longer holds a worker: its next compile may run."""
        self._queues.done(tenant)
        self._dispatch()

    def _respawn_later(self, then=None) -> None:
        """Start a replacement worker in the background; `then()` once the first attempt ended."""
        self._spawn_later(then)

    def _spawn_later(self, then=None, respawn: bool = True) -> None:
        """Start a worker in the background, retrying; `then()` once the first attempt ended."""
        if self._closed:
            if then is not None:
                then()
            return
        if respawn:
            self.respawns += 1

        async def again():
            delay = 0.0
            first = True
            try:
                while not self._closed:
                    try:
                        await self._spawn()
                        return
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:  # noqa: BLE001
                        if first and then is not None:
                            first = False
                            then()
                        delay = min(5.0, delay * 2 or 0.2)
                        log.error("grammar worker respawn failed (retry in %.1fs): %s", delay, e)
                        await asyncio.sleep(delay)
            finally:
                if first and then is not None:
                    then()

        t = asyncio.ensure_future(again())
        self._spawns.add(t)
        t.add_done_callback(self._spawns.discard)

    async def _retire(self, w: _Worker, grace_s: float = 0.0, then=None) -> int | None:
        """Kill `w` and replace it; `then()` once the replacement is up (or its first start failed)."""
        self._all.discard(w)
        try:
            rc = await w.kill(grace_s)
        finally:
            self._respawn_later(then)
        return rc

    def stats(self) -> dict:
        """Who waits and who runs: {"workers", "alive", "idle", "waiting", "busy", "cancelled",
        "tenants": {tenant: {"waiting": n, "running": n}}} (running: holding a worker, or the slot
        of a worker killed for it that is not back yet)."""
        return {"workers": self.workers, "alive": self.alive, "idle": len(self._idle),
                "waiting": self._queues.waiting, "busy": self.busy, "cancelled": self.cancelled,
                "tenants": self._queues.tenants()}

    def admits(self, tenant: str) -> bool:
        """Whether a new compile of `tenant` would be queued now (else `compile` raises GrammarBusy)."""
        return self._queues.admits(tenant)

    def count_busy(self) -> None:
        """Count a compile refused because its tenant's queue is full (`busy`): `compile` does, and so
        does a caller that refuses before calling it."""
        self.busy += 1

    # -- compiling ----------------------------------------------------------------------------

    async def compile(self, job: dict | bytes, tenant: str = "-") -> WorkerResult:
        """Compile and test-run one grammar job (a dict, or its JSON encoded already) in a worker, in
        `tenant`'s turn. GrammarError when it is refused or a limit is hit (that worker is replaced);
        GrammarBusy when the tenant already has too many compiles waiting."""
        if not self._started or self._closed:
            raise GrammarError("the grammar workers are not running", "unavailable")
        if not self._queues.admits(tenant):
            self.count_busy()
            raise GrammarBusy()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queues.push(tenant, fut)
        self._dispatch()
        try:
            if not fut.done():
                await asyncio.wait({fut}, timeout=max(self.timeout_s, self.start_timeout_s))
        except asyncio.CancelledError:
            self._leave_queue(tenant, fut)
            raise
        if not fut.done():
            self._leave_queue(tenant, fut)
            raise GrammarError("no grammar worker became free in time", "unavailable")
        w = fut.result()  # a GrammarError when the pool closed meanwhile
        return await self._run(w, job, tenant)

    def _leave_queue(self, tenant: str, fut: asyncio.Future) -> None:
        """The caller stopped waiting (cancelled or timed out): out of the queue; a worker handed to
        it meanwhile goes to the next compile."""
        self.cancelled += 1
        if fut.done():
            if not fut.cancelled() and fut.exception() is None:
                self._queues.done(tenant)
                self._give_back(fut.result())
            return
        fut.cancel()
        self._queues.remove(tenant, fut)

    async def _run(self, w: _Worker, job: dict | bytes, tenant: str = "-") -> WorkerResult:
        """Run the job on `w` (which `tenant` holds); give the worker and the tenant's slot back."""
        self.compiles += 1
        t0 = time.perf_counter()
        release = True  # the tenant's slot is freed on the way out (else: once a replacement is up)
        try:
            try:
                await w.send(job)
                answer = await asyncio.wait_for(w.recv(), self.timeout_s)
            except asyncio.TimeoutError:
                release = False
                await self._retire(w, then=lambda: self._finish(tenant))
                self.failures["timeout"] += 1
                raise GrammarError(f"compiling the grammar exceeded the time limit of {self.timeout_s:g} s "
                                   f"(--grammar-timeout-s)", "timeout") from None
            except asyncio.CancelledError:  # the caller went away mid-compile: stop it (the worker is busy)
                self.cancelled += 1
                release = False
                await self._retire(w, then=lambda: self._finish(tenant))
                raise
            except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError, ValueError) as e:
                release = False
                rc = await self._retire(w, grace_s=2.0, then=lambda: self._finish(tenant))  # its exit status says why
                raise self._death(w, rc, e) from None
            if answer.get("recycle"):
                await self._retire(w)
                self.respawns -= 1  # a planned replacement, not a failure
            else:
                self._idle.append(w)
        finally:
            if release:
                self._finish(tenant)
        if not answer.get("ok"):
            limit = answer.get("limit", "invalid")
            self.failures[limit] += 1
            msg = answer.get("error") or "the grammar was refused"
            if limit == "memory":
                msg = f"compiling the grammar exceeded the memory limit of {self.memory_bytes} bytes " \
                      f"(--grammar-memory-bytes)"
            raise GrammarError(msg[:2000], limit)
        return WorkerResult(answer["grammar"], int(answer.get("cost", 0)),
                            float(answer.get("compile_s", time.perf_counter() - t0)))

    def _death(self, w: _Worker, rc: int | None, exc: Exception) -> GrammarError:
        tail = " | ".join(w.stderr)
        if rc is not None and rc < 0:
            try:
                sig = signal.Signals(-rc).name
            except ValueError:
                sig = f"signal {-rc}"
        else:
            sig = f"exit status {rc}"
        if "memory allocation" in tail or "MemoryError" in tail or "Cannot allocate" in tail:
            self.failures["memory"] += 1
            log.warning("grammar worker %d ran out of memory (%s)", w.proc.pid, sig)
            return GrammarError(f"compiling the grammar exceeded the memory limit of {self.memory_bytes} bytes "
                                f"(--grammar-memory-bytes)", "memory")
        self.failures["crash"] += 1
        log.warning("grammar worker %d died compiling a grammar (%s): %s", w.proc.pid, sig, tail[-500:] or exc)
        return GrammarError(f"compiling the grammar crashed the grammar worker ({sig}); the schema is too deeply "
                            f"nested or too large to be enforced", "crash")
