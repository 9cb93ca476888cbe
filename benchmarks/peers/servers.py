"""Each peer's server on 127.0.0.1 on a free port: started, waited on until it answers, stopped.

Every server gets the same intra-op thread count (`threads`, recorded with its version and exact
command) and the same float32 weights; each is otherwise configured as its own docs recommend:

- ours: `lorafarm up --replicas 1 --base DIR --adapters ...` (registry, router, replica); requests go
  through the router and name an adapter by its alias (demo/<folder>:prod), uploaded through the
  registry at start-up. Device slots for every adapter; the router's stream timeouts raised so 32
  cold adapters at once do not cut streams. W6's 1,000 adapters: `lorafarm up` without them, then
  the same registry upload from here, UPLOAD_CONCURRENCY at a time (OursServer.wait_ready).
- vllm: `python -m vllm.entrypoints.openai.api_server --model DIR --enable-lora --max-loras N --lora-modules name=path ...`; an adapter is a
  model name. CPU: VLLM_CPU_OMP_THREADS_BIND pins `threads` cores, VLLM_CPU_KVCACHE_SPACE in GiB.
  Each --lora-modules entry is loaded into its CPU cache (--max-cpu-loras) at start-up.
- llamacpp: `llama-server -m base.gguf --lora a.gguf,... --lora-init-without-apply --parallel 32`;
  a request picks its adapter with `"lora": [{"id": i, "scale": 1}, ...]` (every adapter listed).
- transformers: `transformers serve DIR --continuous-batching`; base model only (no per-request LoRA).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.peers.install import Installed
from lorafarm.errors import CliError
from lorafarm.farm import FarmPorts, _free_port

KV_TOKENS_PER_REQUEST = 512  # prompt + 64 new tokens fit with room; llama.cpp's per-slot context
UPLOAD_CONCURRENCY = 4  # ours' registry uploads in flight while registering W6's set
LORA_ARG_CHUNK = 200  # GGUF paths per --lora argument: 1,000 in one would near Linux's 128 KiB per argument


@dataclass
class Server:
    peer: str
    installed: Installed
    command: list[str]
    env: dict[str, str]
    ready_url: str
    base_url: str  # OpenAI base URL (.../v1)
    base_model: str  # the model name a base request sends
    adapters: dict[str, tuple[str, dict]] = field(default_factory=dict)  # adapter -> (model, extra_body)
    threads: int = 0
    api_key: str = "none"
    log: Path | None = None
    proc: subprocess.Popen | None = None
    started_s: float | None = None  # seconds from start to ready

    base_extra: dict = field(default_factory=dict)  # extra_body of a base request
    paused: bool = False
    settle_s: float = 0.0  # after a resume, before asking whether it answers

    def request(self, adapter: str | None) -> tuple[str, dict]:
        """(model, extra_body) for a request on the base (None) or an adapter."""
        return (self.base_model, self.base_extra) if adapter is None else self.adapters[adapter]

    def supports_adapters(self) -> bool:
        return bool(self.adapters)

    def launch(self) -> "Server":
        """Start the process (in its own group: vLLM's engine processes stop with it); see wait_ready."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        out = open(self.log, "w")
        self.proc = subprocess.Popen(self.command, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 900.0) -> "Server":
        self._wait_ready(timeout)
        self.started_s = time.monotonic() - self._t0
        return self

    def _wait_ready(self, timeout: float, url: str | None = None) -> None:
        """Until `url` (default: the server's ready URL) answers 200; CliError if the server exits or
        `timeout` passes."""
        url = url or self.ready_url
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-1500:]
                raise CliError(f"{self.peer} exited with status {self.proc.returncode} while starting; "
                               f"{self.log} ends:\n{tail}")
            try:
                if httpx.get(url, timeout=2.0, headers={"Authorization": f"Bearer {self.api_key}"}).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise CliError(f"{self.peer} did not answer {url} within {timeout:.0f} s; see {self.log}")

    def _tree(self) -> list:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def pause(self) -> None:
        """SIGSTOP the server and every process under it (ours: registry, router, replica): an idle
        server takes no CPU from the one measured (vLLM's CPU worker spins at ~50% of a core idle)."""
        import psutil

        if not self.paused:
            for p in self._tree():
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.suspend()
            self.paused = True

    def resume(self, timeout: float = 120.0, wait: bool = True) -> None:
        """SIGCONT them all; then wait until it answers again (ours: its router polls the replica's
        state every second, so a short settle first)."""
        import psutil

        if self.paused:
            for p in reversed(self._tree()):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.resume()
            self.paused = False
            if wait:
                time.sleep(self.settle_s)
                self._wait_ready(timeout)

    def ask_stop(self) -> None:
        """SIGINT to the group we started (start_new_session); stop() waits for it."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        self.resume(wait=False)  # a stopped process cannot act on SIGINT
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGINT)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT, then after `timeout` SIGKILL to every process under it: ours' registry, router and
        replica run in sessions of their own, so killing our group alone would orphan them."""
        import psutil

        p = self.proc
        if p is None or p.poll() is not None:
            return
        tree = self._tree()
        self.ask_stop()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        _, alive = psutil.wait_procs(tree, timeout=5)
        for q in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                q.kill()
        p.wait()

    def describe(self) -> dict:
        return {"peer": self.peer, "version": self.installed.version, "how": self.installed.how,
                "threads": self.threads, "command": shlex.join(self.command),
                "env": {k: v for k, v in self.env.items() if k.startswith(("OMP_", "VLLM_", "MKL_", "LORAFARM_", "LD_PRELOAD"))},
                "startup_s": round(self.started_s, 1) if self.started_s else None}


def _threads_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def ours(installed: Installed, model: Path, adapters: list[Path], state: Path, threads: int,
         replica_flags: str, router_flags: str, upload: bool = False, progress: bool = True,
         parallel_products: str = "") -> "OursServer":
    """upload: the adapters registered from here once the farm is up (W6's 1,000), not by `lorafarm up`.
    parallel_products: LORAFARM_PARALLEL_PRODUCTS for the replica; empty (default) leaves the replica at
    its own default, as a user meets it (`all` was the bench's setting before issue 39)."""
    ports = FarmPorts.free(1)
    name = model.resolve().name
    listed = adapters if adapters and not upload else []
    cmd = [sys.executable, "-m", "lorafarm", "up", "--replicas", "1", "--state-dir", str(state),
           "--port", str(ports.router), "--registry-port", str(ports.registry), "--replica-port", str(ports.replica_base),
           "--base", f"{name}={model.resolve()}", *(["--adapters", *map(str, listed)] if listed else []),
           f"--replica-flags={replica_flags}", f"--router-flags={router_flags}"]  # '=': a value may start with '--'
    env = {**_threads_env(threads), **({"LORAFARM_PARALLEL_PRODUCTS": parallel_products} if parallel_products else {})}
    return OursServer("ours", installed, cmd, env, f"http://127.0.0.1:{ports.router}/health",
                      f"http://127.0.0.1:{ports.router}/v1", name, threads=threads, log=state / "up.log", settle_s=3.0,
                      model_dir=model.resolve(), uploads=adapters if upload else [], progress=progress)


@dataclass
class OursServer(Server):
    """`lorafarm up`: ready once it prints its examples (the farm is seeded) and `uploads` are
    registered; names from farm.json."""

    model_dir: Path | None = None
    uploads: list[Path] = field(default_factory=list)
    progress: bool = True

    def _wait_ready(self, timeout: float) -> None:
        super()._wait_ready(timeout)  # the router answers /health ...
        deadline = time.monotonic() + timeout
        while "Ctrl-C stops the farm" not in self.log.read_text(errors="replace"):  # ... and seeding is done
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise CliError(f"ours did not finish seeding; see {self.log}")
            time.sleep(0.5)

    def wait_ready(self, timeout: float = 900.0) -> "OursServer":
        self._wait_ready(timeout)
        farm = json.loads((Path(self.log).parent / "farm.json").read_text())
        self._wait_replicas_ready(farm, timeout)
        tenant = farm["tenants"][0]
        self.api_key = tenant["api_key"]
        if self.uploads:
            from lorafarm.farm import wait_router_ready

            tenant["aliases"] = asyncio.run(self._upload(farm))
            wait_router_ready(farm, timeout)
        self.adapters = {alias.split("/", 1)[1].rsplit(":", 1)[0]: (alias, {}) for alias in tenant["aliases"]}
        self.started_s = time.monotonic() - self._t0
        return self

    def _wait_replicas_ready(self, farm: dict, timeout: float) -> None:
        """Until every replica's /ready says 200: its first pull of the adapters it owns is done, as a
        Kubernetes readiness probe would wait, so that pull does not run inside a measured window."""
        for url in [r["url"] for r in farm.get("replicas", []) if r.get("url")]:
            super()._wait_ready(timeout, f"{url}/ready")  # Server's poll (this class's own waits for seeding)

    async def _upload(self, farm: dict) -> dict[str, str]:
        """`uploads` through the registry as `lorafarm up --adapters` sends them (same call, same
        alias), several at a time: it sends them one by one with a log line each, and the registry took
        0.3-0.5 s per 19.5 MB adapter (the main set): minutes for 1,000 with no progress shown.
        -> alias: adapter id."""
        from tqdm import tqdm

        from archives.basehash import base_model_hash
        from lorafarm.realbase import alias_name
        from lorafarm.registry_client import RegistryClient

        tenant = farm["tenants"][0]["tenant_id"]
        trained_on = await asyncio.to_thread(base_model_hash, self.model_dir)
        sem = asyncio.Semaphore(UPLOAD_CONCURRENCY)
        aliases: dict[str, str] = {}
        async with RegistryClient(farm["registry_url"], farm["admin_token"], timeout=120.0) as reg:
            # a farm restarted over its state dir keeps what it registered: only the aliases it lacks are sent
            # (the registry took ~0.5 s per adapter on a busy 2-core box: 40 min for 5,000, issue 39)
            have = {a["alias"]: a["adapter_id"] for a in await reg.list_aliases(tenant)}
            wanted = {f: f"{tenant}/{alias_name(f)}:prod" for f in self.uploads}
            todo = [f for f, alias in wanted.items() if alias not in have]
            aliases.update({alias: have[alias] for alias in wanted.values() if alias in have})
            with tqdm(total=len(todo), desc="ours: registering adapters", unit="adapter",
                      disable=not self.progress) as bar:

                async def one(folder: Path) -> None:
                    alias = f"{tenant}/{alias_name(folder)}:prod"
                    async with sem:
                        got = await reg.upload_adapter(folder, tenant, alias=alias, base_model=self.base_model,
                                                       base_model_hash=trained_on)
                    aliases[alias] = got["adapter_id"]
                    bar.update(1)

                await asyncio.gather(*(one(f) for f in todo))
        return aliases


def vllm(installed: Installed, model: Path, adapters: list[Path], logs: Path, threads: int,
         kv_gib: int = 4, rank: int = 16, max_loras: int | None = None, cpu_loras: int | None = None) -> Server:
    """max_loras: adapters in one batch (default: all of them); cpu_loras: its CPU cache of loaded
    adapters (default: vLLM's, max_loras)."""
    port = _free_port()
    # the API server module rather than the `vllm` CLI: vllm-cpu's CLI asks for the metadata of a
    # distribution named "vllm" and exits (PackageNotFoundError) when only "vllm-cpu" is installed
    python = str(Path(installed.exe).with_name("python"))
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.resolve()),
           "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "base", "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "32",
           "--uvicorn-log-level", "warning"]
    if adapters:
        cmd += ["--enable-lora", "--max-loras", str(max_loras or len(adapters)), "--max-lora-rank", str(rank),
                *(["--max-cpu-loras", str(cpu_loras)] if cpu_loras else []),
                "--lora-modules", *[f"{a.name}={a.resolve()}" for a in adapters]]
    env = vllm_cpu_env(installed, threads, kv_gib)
    return Server("vllm", installed, cmd, env, f"http://127.0.0.1:{port}/v1/models", f"http://127.0.0.1:{port}/v1",
                  "base", {a.name: (a.name, {}) for a in adapters}, threads, log=logs / "vllm.log")


TCMALLOC_GLOBS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_preloads(installed: Installed) -> list[str]:
    """What vLLM's CPU installation docs ask to LD_PRELOAD ("set LD_PRELOAD": tcmalloc, then Intel's
    OpenMP, libiomp5, which `vllm-cpu` installs with intel-openmp into its venv's lib/): the ones found
    here. Without them its worker logs "libtcmalloc is not found in LD_PRELOAD" (and libiomp)."""
    found = [p for p in TCMALLOC_GLOBS if Path(p).exists()][:1]
    iomp = Path(installed.exe).parent.parent / "lib" / "libiomp5.so"
    return found + ([str(iomp)] if iomp.exists() else [])


def vllm_cpu_env(installed: Installed, threads: int, kv_gib: int) -> dict[str, str]:
    """vLLM CPU as its installation docs set it up: the preloads, `threads` cores bound by
    VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE GiB of KV cache."""
    env = {**_threads_env(threads), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if preloads := vllm_preloads(installed):
        env["LD_PRELOAD"] = ":".join(preloads)
    return env


def vllm_longtail(installed: Installed, model: Path, folder: Path, names: list[str], logs: Path, threads: int,
                  kv_gib: int = 4, rank: int = 32, max_loras: int = 8, cpu_loras: int = 256) -> Server:
    """vLLM on its long-tail path: no adapter named at start; an unknown model name is resolved from
    `folder`/<name> on first use (its filesystem LoRA resolver plugin, with runtime LoRA updating on),
    loaded into its CPU cache (--max-cpu-loras, LRU) and `max_loras` at a time into the batch's slots.
    The resolver accepts a folder whose adapter_config.json names the served model in
    base_model_name_or_path: the model is served under its path (no --served-model-name)."""
    port = _free_port()
    python = str(Path(installed.exe).with_name("python"))
    served = str(model.resolve())
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", served,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
           "--max-num-seqs", "32", "--uvicorn-log-level", "warning",
           "--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(rank),
           "--max-cpu-loras", str(cpu_loras)]
    env = {**vllm_cpu_env(installed, threads, kv_gib), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "VLLM_PLUGINS": "lora_filesystem_resolver", "VLLM_LORA_RESOLVER_CACHE_DIR": str(folder.resolve())}
    return Server("vllm", installed, cmd, env, f"http://127.0.0.1:{port}/v1/models", f"http://127.0.0.1:{port}/v1",
                  served, {n: (n, {}) for n in names}, threads, log=logs / "vllm.log")


def llamacpp(installed: Installed, base_gguf: Path, loras: dict[str, Path], logs: Path, threads: int,
             parallel: int = 32) -> Server:
    port = _free_port()
    cmd = [installed.exe, "-m", str(base_gguf.resolve()), "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(parallel),
           "--ctx-size", str(parallel * KV_TOKENS_PER_REQUEST), "--alias", "base", "--no-webui"]
    names = list(loras)
    for i in range(0, len(names), LORA_ARG_CHUNK):  # every adapter loaded once (ids in this order)
        cmd += ["--lora", ",".join(str(loras[n].resolve()) for n in names[i:i + LORA_ARG_CHUNK])]
    if names:  # none applied unless a request asks
        cmd.append("--lora-init-without-apply")
    zeros = [{"id": i, "scale": 0.0} for i in range(len(names))]  # shared: 1,000 lists of 1,000, not 10^6 dicts

    def scales(on: int | None) -> dict:
        listed = zeros.copy()
        if on is not None:
            listed[on] = {"id": on, "scale": 1.0}
        return {"lora": listed}

    adapters = {n: ("base", scales(i)) for i, n in enumerate(names)}
    server = Server("llamacpp", installed, cmd, _threads_env(threads), f"http://127.0.0.1:{port}/health",
                    f"http://127.0.0.1:{port}/v1", "base", adapters, threads, log=logs / "llamacpp.log")
    # every request lists every adapter's scale: with no "lora" field, or "lora": [], this llama-server
    # applied the loaded adapters to a base request (checked: other text than the base, and slower);
    # with all of them listed at 0 its base text is the other servers' exactly
    server.base_extra = scales(None) if names else {}
    return server


def transformers(installed: Installed, model: Path, logs: Path, threads: int) -> Server:
    port = _free_port()
    block = 32
    cmd = [installed.exe, "serve", str(model.resolve()), "--continuous-batching", "--device", "cpu",
           "--dtype", "float32", "--cb-block-size", str(block), "--cb-num-blocks", str(32 * KV_TOKENS_PER_REQUEST // block),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    return Server("transformers", installed, cmd, _threads_env(threads), f"http://127.0.0.1:{port}/health",
                  f"http://127.0.0.1:{port}/v1", str(model.resolve()), {}, threads, log=logs / "transformers.log")
