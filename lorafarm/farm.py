"""`lorafarm up`: the whole farm on one machine (registry, router, N replicas as child processes).

On first run it prepares everything a newcomer needs offline: the dev model, demo canary adapters,
the registry's signing key and an admin token; it then seeds a demo tenant, uploads the demo
adapters through the registry as a training job would, sets aliases and writes
`<state-dir>/farm.json` (DESIGN.md section 3). A second run on the same state dir reuses all of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lorafarm.errors import CliError

BASE_MODEL_NAME = "lorafarm-dev-tiny"
REAL_MODEL_NAME = "smollm2-135m-instruct"  # `lorafarm up` without --dev: lorafarm.realmodel
EMBEDDING_MODEL_NAME = "lorafarm-dev-embed"
DEMO_TENANT = "demo"
DEMO_ADAPTERS = 4


@dataclass
class FarmPorts:
    router: int = 8000
    registry: int = 8100
    replica_base: int = 8200

    @classmethod
    def free(cls, replicas: int) -> "FarmPorts":
        """Ports the OS says are free now: for tests and `lorafarm demo`, which must not collide."""
        ports = [_free_port() for _ in range(2)]
        base = _free_port_range(replicas)
        return cls(router=ports[0], registry=ports[1], replica_base=base)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_range(n: int) -> int:
    for _ in range(50):
        start = _free_port()
        if all(_port_is_free(start + i) for i in range(n)):
            return start
    raise CliError("no free range of ports for the replicas")


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class Farm:
    """The child processes of one farm and the files that describe it."""

    state_dir: Path
    replicas: int = 2
    ports: FarmPorts = field(default_factory=FarmPorts)
    host: str = "127.0.0.1"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    progress: bool = True
    demo_adapters: int = DEMO_ADAPTERS
    router_args: list[str] = field(default_factory=list)  # extra `lorafarm router` flags
    replica_args: list[str] = field(default_factory=list)  # extra `lorafarm replica` flags
    registry_args: list[str] = field(default_factory=list)  # extra `lorafarm registry` flags
    # A mixed farm: more base models (name -> checkpoint dir) and, per replica, the base it serves
    # (default: every replica serves the dev model, whose demo adapters are seeded).
    extra_bases: dict[str, Path] = field(default_factory=dict)
    replica_bases: list[str] = field(default_factory=list)
    # `lorafarm up --embeddings`: one embedding worker (replica e0, port replica_base + replicas)
    embeddings: bool = False
    # `lorafarm up --base`: real checkpoints (name -> dir) instead of the dev model, and the PEFT
    # adapters to seed (instead of the canaries); replicas serve the bases round robin.
    bases: dict[str, Path] = field(default_factory=dict)
    adapter_dirs: list[Path] = field(default_factory=list)
    assume_base: bool = False
    # `lorafarm up` (not --dev): the real model (SmolLM2-135M-Instruct, lorafarm.realmodel) and the
    # demo adapters trained on it (lorafarm.demo_adapters) instead of the dev model and canaries.
    real: bool = False
    # where the models and demo adapters are made and cached (default: the state dir); `lorafarm demo`
    # keeps them in the user cache so a temporary state dir does not retrain them every run
    assets_dir: Path | None = None
    # `lorafarm up`: print ready and write farm.json only once a chat through the router to the base
    # and to one demo alias has been answered (wait_answering); Farm users in tests and benchmarks
    # get farm.json as soon as the aliases are seeded
    answer_check: bool = False
    pending_demos: list[str] = field(default_factory=list)  # demo adapters to train after the farm answers
    # the replicas' compile caches (`lorafarm replica --cache-dir`: C and inductor kernels), shared by
    # them and kept across restarts; default the farm's cache dir. Test farms share one across runs.
    compile_cache: Path | None = None

    # -- files ------------------------------------------------------------------------------
    @property
    def model_dir(self) -> Path:
        return (self.assets_dir or self.state_dir) / "models" / self.base_name

    @property
    def base_name(self) -> str:
        return REAL_MODEL_NAME if self.real else BASE_MODEL_NAME

    @property
    def cache_dir(self) -> Path:
        """Downloads (the model wheel), base hashes and (by default) the replicas' compile caches."""
        return (self.assets_dir or self.state_dir) / "cache"

    @property
    def base_models(self) -> dict[str, Path]:
        first = {n: Path(d).resolve() for n, d in self.bases.items()} or {self.base_name: self.model_dir.resolve()}
        return {**first, **{n: Path(d).resolve() for n, d in self.extra_bases.items()}}

    @property
    def embedding_dir(self) -> Path:
        return self.state_dir / "models" / EMBEDDING_MODEL_NAME

    @property
    def embedding_models(self) -> dict[str, Path]:
        return {EMBEDDING_MODEL_NAME: self.embedding_dir.resolve()} if self.embeddings else {}

    @property
    def embedding_url(self) -> str:
        return self.url(self.ports.replica_base + self.replicas)

    def replica_base(self, i: int) -> str:
        if i < len(self.replica_bases):
            return self.replica_bases[i]
        return list(self.bases)[i % len(self.bases)] if self.bases else self.base_name

    def ports_wanted(self) -> list[tuple[str, int]]:
        wanted = [("router", self.ports.router), ("registry", self.ports.registry),
                  *[(f"replica r{i}", self.ports.replica_base + i) for i in range(self.replicas)]]
        if self.embeddings:
            wanted.append(("embedding worker e0", self.ports.replica_base + self.replicas))
        return wanted

    def check_ports(self) -> None:
        """Before anything starts: every port free, else one line naming the port and its holder."""
        wanted = self.ports_wanted()
        seen: dict[int, str] = {}
        for name, port in wanted:
            if port in seen:
                raise CliError(f"the {name} and the {seen[port]} would both use port {port}: choose other ports")
            if not 0 < port < 65536:
                raise CliError(f"the {name} port {port} is not a TCP port")
            seen[port] = name
        taken = [(name, port) for name, port in wanted if not _can_listen(self.host, port)]
        if taken:
            what = "; ".join(f"{name} port {port} is in use by {port_holder(port) or 'another process'}"
                             for name, port in taken)
            raise CliError(f"{what}. Stop it, or choose free ports (--port, --registry-port, --replica-port)")

    @property
    def adapters_dir(self) -> Path:
        return (self.assets_dir or self.state_dir) / ("demo-adapters-" + REAL_MODEL_NAME if self.real else "demo-adapters")

    @property
    def keys_dir(self) -> Path:
        return self.state_dir / "keys"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def farm_json(self) -> Path:
        return self.state_dir / "farm.json"

    def url(self, port: int) -> str:
        return f"http://{self.host}:{port}"

    @property
    def registry_url(self) -> str:
        return self.url(self.ports.registry)

    @property
    def router_url(self) -> str:
        return self.url(self.ports.router)

    def replica_url(self, i: int) -> str:
        return self.url(self.ports.replica_base + i)

    def prepare(self) -> None:
        """Dev model, demo canaries, signing key, admin token: made once, reused after."""
        from lorafarm.dev.adapters import write_dev_adapters
        from lorafarm.dev.model import write_dev_model

        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self.logs_dir.mkdir(exist_ok=True)
        except OSError as e:
            raise CliError(f"--state-dir {self.state_dir}: {e.strerror}") from None
        if self.bases:
            self._check_real()
        elif self.real:
            from lorafarm.realmodel import ensure_real_model, is_complete

            if not is_complete(self.model_dir):
                self._say(f"fetching the real model (SmolLM2-135M-Instruct) into {self.model_dir}")
                ensure_real_model(self.model_dir, self.cache_dir, progress=self.progress)
        elif not (self.model_dir / "model.safetensors").exists():
            self._say(f"generating the dev model in {self.model_dir}")
            write_dev_model(self.model_dir, size="tiny", seed=0, force=True)
        if self.embeddings and not (self.embedding_dir / "modules.json").exists():
            from lorafarm.dev.embedding import write_dev_embedding_model

            self._say(f"generating the dev embedding model in {self.embedding_dir}")
            write_dev_embedding_model(self.embedding_dir, force=True)
        self.pending_demos = []
        if self.demo_adapters and self.real and not self.bases:
            # shipped in the package (or trained before) for this recipe and base: uploaded as they are.
            # Any other is trained after the farm answers (train_pending_demos), never before.
            from archives.basehash import base_model_hash
            from lorafarm.demo_adapters import DEMO_ADAPTERS as REAL_DEMOS, ready_folders, write_index

            names = [a.name for a in REAL_DEMOS[: self.demo_adapters]]
            with _env(LORAFARM_BASEHASH_CACHE_DIR=str(self.cache_dir / "basehash")):
                folders = ready_folders(base_model_hash(self.model_dir), self.adapters_dir, names)
            write_index(self.adapters_dir, folders)
            self.pending_demos = [n for n in names if n not in folders]
            if self.pending_demos:
                self._say(f"demo adapters {', '.join(self.pending_demos)} do not match this base or recipe: "
                          "they are trained once the base answers")
        elif self.demo_adapters and not self.bases:  # 0: no canaries (load tests upload synthetic adapters instead)
            self._say("preparing demo adapters (trained once with PEFT, then cached)")
            write_dev_adapters(self.model_dir, self.adapters_dir, count=self.demo_adapters, progress=self.progress)
        if not (self.keys_dir / "private.pem").exists():
            from archives.keys import generate_keypair

            generate_keypair(self.keys_dir)
        token_file = self.state_dir / "admin_token"
        if not token_file.exists():
            token_file.write_text(secrets.token_urlsafe(32) + "\n")
            token_file.chmod(0o600)
        self.admin_token = token_file.read_text().strip()

    def _check_real(self) -> None:
        """--base / --adapters: checkpoints loadable, each adapter's trained-on base known (or waived)."""
        from archives.basehash import base_model_hash
        from archives.errors import ArchiveError
        from lorafarm.realbase import check_checkpoint, find_adapters, trained_on

        if self.replicas < len(self.bases):
            raise CliError(f"{len(self.bases)} base models need at least {len(self.bases)} replicas (--replicas)")
        hashes: dict[str, tuple[Path, str]] = {}
        for name, folder in self.bases.items():
            check_checkpoint(name, Path(folder))
            self._say(f"hashing base {name} ({folder}; cached after the first time)")
            try:
                hashes[name] = (Path(folder), base_model_hash(folder, progress=self.progress))
            except ArchiveError as e:
                raise CliError(f"--base {name}={folder}: {e}") from None
        self.base_hashes = {name: h for name, (_, h) in hashes.items()}
        self.seed_plan = []
        for adapter in find_adapters([Path(a) for a in self.adapter_dirs]):
            h = trained_on(adapter, hashes)
            if h is None and not (self.assume_base and len(hashes) == 1):
                raise CliError(f"--adapters {adapter}: it does not say which base it was trained on; record it "
                               f"(`lorafarm archive basehash BASE_DIR --write {adapter}`) or pass --assume-base "
                               "(one --base only)")
            base = next((n for n, (_, bh) in hashes.items() if bh == h), None) if h else next(iter(hashes))
            if base is None:
                raise CliError(f"--adapters {adapter}: trained on base {h}, which none of the --base folders is "
                               f"({', '.join(f'{n}: {bh}' for n, (_, bh) in hashes.items())})")
            self.seed_plan.append((adapter, base, h))

    # -- processes --------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.logs_dir / f"{name}.log", "ab")
        env = {**os.environ, "LORAFARM_ADMIN_TOKEN": self.admin_token, "PYTHONUNBUFFERED": "1"}
        # base hashes in the farm's cache, not in the model folder nor /tmp (the caller's setting wins);
        # the replicas' compile caches: start_replica's --cache-dir
        env.setdefault("LORAFARM_BASEHASH_CACHE_DIR", str((self.cache_dir / "basehash").resolve()))
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "lorafarm", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C reaches us; we stop the children in order
        )

    def start(self) -> None:
        self.start_registry()
        for i in range(self.replicas):
            self.start_replica(i, wait=False)
        if self.embeddings:
            self.start_embedding(wait=False)
        self.start_router()
        for i in range(self.replicas):
            self.wait_healthy(f"replica-r{i}", self.replica_url(i))
        if self.embeddings:
            self.wait_healthy("replica-e0", self.embedding_url)
        self.wait_healthy("router", self.router_url)

    def start_registry(self) -> None:
        """The registry on its port and state (sqlite, store, key): also a restart after a stop/kill."""
        state = self.state_dir.resolve()
        self._spawn(
            "registry",
            [
                "registry",
                "--host", self.host,
                "--port", str(self.ports.registry),
                "--database-url", f"sqlite+aiosqlite:///{state / 'registry.db'}",
                "--store-url", f"file://{state / 'store'}",
                "--signing-key", str(state / "keys" / "private.pem"),
                *[a for name, d in self.base_models.items() for a in ("--base-model", f"{name}={d}")],
                *self.registry_args,
            ],
        )  # fmt: skip
        self.wait_healthy("registry", self.registry_url)

    def start_replica(self, i: int, *, wait: bool = True) -> None:
        """Replica r<i> on its port and disk dir: also a restart after a kill."""
        state = self.state_dir.resolve()
        rid = f"r{i}"
        self._spawn(
            f"replica-{rid}",
            [
                "replica",
                "--id", rid,
                "--host", self.host,
                "--port", str(self.ports.replica_base + i),
                "--base", str(self.base_models[self.replica_base(i)]),
                "--model-name", self.replica_base(i),
                "--registry", self.registry_url,
                "--store-url", f"file://{state / 'store'}",
                "--trust", str(state / "keys" / "public.pem"),
                "--disk-dir", str(state / "replicas" / rid),
                "--cache-dir", str((self.compile_cache or self.cache_dir).resolve()),
                *self.replica_args,
            ],
        )  # fmt: skip
        if wait:
            self.wait_healthy(f"replica-{rid}", self.replica_url(i))

    def start_embedding(self, *, wait: bool = True) -> None:
        """The embedding worker e0 (`lorafarm up --embeddings`)."""
        self._spawn(
            "replica-e0",
            [
                "replica", "--task", "embed",
                "--id", "e0",
                "--host", self.host,
                "--port", str(self.ports.replica_base + self.replicas),
                "--base", str(self.embedding_dir.resolve()),
                "--model-name", EMBEDDING_MODEL_NAME,
                "--registry", self.registry_url,
            ],
        )  # fmt: skip
        if wait:
            self.wait_healthy("replica-e0", self.embedding_url)

    def start_router(self) -> None:
        args = ["router", "--host", self.host, "--port", str(self.ports.router), "--registry", self.registry_url]
        self._spawn("router", [*args, *self.router_args])

    def restart_router(self, router_args: list[str]) -> None:
        """Same farm, other router flags (e.g. a routing strategy): for A/B runs over identical replicas."""
        proc = self.procs.pop("router")
        proc.terminate()
        proc.wait(timeout=15)
        self.router_args = router_args
        self.start_router()
        self.wait_healthy("router", self.router_url)

    def wait_healthy(self, name: str, url: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if proc.poll() is not None:
                tail = (self.logs_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise CliError(f"{name} exited with status {proc.returncode}; log tail:\n{tail}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise CliError(f"{name} did not become healthy at {url} within {timeout:.0f} s")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every child (router first, registry last), then SIGKILL what is left."""
        order = ["router", *[n for n in self.procs if n.startswith("replica-")], "registry"]
        for name in order:
            proc = self.procs.get(name)
            if proc and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in order:
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def up(self) -> dict:
        """Prepare, start every process, seed the demo tenant; return farm.json's content once
        the router lists the demo aliases."""
        self.check_ports()
        self.prepare()
        self.start()
        info = self.seed(write=not self.answer_check)
        wait_router_ready(info)
        if self.answer_check:
            wait_answering(info, self.first_models(info))
            self.write_farm_json(info)
        return info

    def first_models(self, info: dict) -> list[str]:
        """What `wait_answering` asks: the base replica r0 serves and one alias on it (a demo adapter whose
        effect shows when there is one)."""
        if not self.replicas:
            return []
        base = self.replica_base(0)
        aliases = sorted(info["tenants"][0]["aliases"])
        from lorafarm.realbase import alias_name

        on_base = [f"{DEMO_TENANT}/{alias_name(f)}:prod" for f, b, _ in getattr(self, "seed_plan", []) if b == base]
        pick = next((a for a in [f"{DEMO_TENANT}/support:prod", *on_base] if a in aliases), None)
        if pick is None and aliases and not self.bases:
            pick = aliases[0]
        return [base, *([pick] if pick else [])]

    def train_pending_demos(self) -> dict | None:
        """Train the demo adapters `prepare` found missing (another recipe or base), with a progress bar,
        while the farm already serves; then upload them and rewrite farm.json. Returns the new farm.json
        content, or None when nothing was pending."""
        pending = self.pending_demos
        if not pending:
            return None
        self._say(f"training demo adapter(s) {', '.join(pending)} in the background; the base already answers")
        env = {**os.environ, "LORAFARM_BASEHASH_CACHE_DIR": str((self.cache_dir / "basehash").resolve())}
        proc = subprocess.run([sys.executable, "-m", "lorafarm", "demo-adapters", "--base", str(self.model_dir),
                               "--out", str(self.adapters_dir), "--names", *pending],
                              env=env, stdout=subprocess.DEVNULL, stderr=None if self.progress else subprocess.DEVNULL)
        if proc.returncode != 0:
            raise CliError(f"training the demo adapters failed (exit status {proc.returncode})")
        self.pending_demos = []
        info = self.seed()
        wait_router_ready(info)
        self._say(f"demo adapter(s) {', '.join(pending)} trained and uploaded")
        return info

    # -- seeding ----------------------------------------------------------------------------
    def seed(self, *, write: bool = True) -> dict:
        """Demo tenant, its key and aliases; adapters uploaded as a training job would. Writes farm.json
        unless `write` is False (then `write_farm_json` does, later)."""
        farm = asyncio.run(self._seed())
        if write:
            self.write_farm_json(farm)
        return farm

    def write_farm_json(self, farm: dict) -> None:
        tmp = self.farm_json.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(farm, indent=2) + "\n")
        tmp.chmod(0o600)  # holds the admin token and an API key
        os.replace(tmp, self.farm_json)

    async def _seed(self) -> dict:
        from lorafarm.registry_client import RegistryClient

        previous = json.loads(self.farm_json.read_text()) if self.farm_json.exists() else {}
        tenants_before = {t["tenant_id"]: t for t in previous.get("tenants", [])}
        from archives.basehash import base_model_hash

        markers_file = self.adapters_dir / "markers.json"
        use_demo = self.demo_adapters and not self.bases and not self.real and markers_file.exists()
        markers = json.loads(markers_file.read_text()) if use_demo else {}
        trained_on = base_model_hash(self.model_dir) if markers else None  # the canaries' base: the dev model
        from archives.basehash import read_trained_base

        demo_file = self.adapters_dir / "demo.json"
        use_real = self.demo_adapters and not self.bases and self.real and demo_file.exists()
        demos = json.loads(demo_file.read_text()) if use_real else {}
        async with RegistryClient(self.registry_url, self.admin_token) as reg:
            known = {t["tenant_id"] for t in await reg.list_tenants()}
            if DEMO_TENANT in known and DEMO_TENANT in tenants_before:
                api_key = tenants_before[DEMO_TENANT]["api_key"]
            elif DEMO_TENANT in known:
                api_key = (await reg.create_key(DEMO_TENANT))["api_key"]
            else:
                api_key = (await reg.create_tenant(DEMO_TENANT))["api_key"]
            aliases = {}
            for name, info in sorted(markers.items()):
                alias = f"{DEMO_TENANT}/{name}:prod"
                adapter = await reg.upload_adapter(
                    self.adapters_dir / info["path"], DEMO_TENANT, alias=alias, base_model=BASE_MODEL_NAME,
                    base_model_hash=trained_on,
                )
                aliases[alias] = adapter["adapter_id"]
            for name, info in demos.items():
                alias = f"{DEMO_TENANT}/{name}:prod"
                adapter = await reg.upload_adapter(
                    self.adapters_dir / info["path"], DEMO_TENANT, alias=alias, base_model=self.base_name,
                    base_model_hash=read_trained_base(self.adapters_dir / info["path"]),
                )
                aliases[alias] = adapter["adapter_id"]
            if self.bases:
                from lorafarm.realbase import alias_name

                for folder, base, h in getattr(self, "seed_plan", []):
                    alias = f"{DEMO_TENANT}/{alias_name(folder)}:prod"
                    adapter = await reg.upload_adapter(folder, DEMO_TENANT, alias=alias, base_model=base,
                                                       base_model_hash=h, assume_base=h is None)
                    aliases[alias] = adapter["adapter_id"]
                    self._say(f"{alias} -> {adapter['adapter_id']} (base {base})")
        farm = {
            "router_url": self.router_url,
            "registry_url": self.registry_url,
            "admin_token": self.admin_token,
            "tenants": [{"tenant_id": DEMO_TENANT, "api_key": api_key, "aliases": aliases}],
            "replicas": [
                {"replica_id": f"r{i}", "url": self.replica_url(i), "pid": self.procs[f"replica-r{i}"].pid}
                for i in range(self.replicas)
            ]
            + ([{"replica_id": "e0", "url": self.embedding_url, "pid": self.procs["replica-e0"].pid, "task": "embed"}]
               if self.embeddings else []),
            "base_models": {name: str(d) for name, d in self.base_models.items()},
            "embedding_models": {name: str(d) for name, d in self.embedding_models.items()},
            "markers": {f"{DEMO_TENANT}/{n}:prod": m["marker"] for n, m in markers.items()},
            # the real model's demo adapters: what each does and a prompt that shows it
            "demo_adapters": {f"{DEMO_TENANT}/{n}:prod": {"behaviour": d["behaviour"], "example_prompt": d["example_prompt"]}
                              for n, d in demos.items()},
        }
        return farm

    def _say(self, msg: str) -> None:
        if self.progress:
            print(f"lorafarm: {msg}", file=sys.stderr, flush=True)


@contextmanager
def _env(**values: str):
    """Environment variables set for the block (unless the caller already set them), then restored."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _can_listen(host: str, port: int) -> bool:
    """Can a server listen on host:port now? SO_REUSEADDR as uvicorn sets it, so a port with only
    closed connections in TIME_WAIT counts as free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def port_holder(port: int) -> str | None:
    """'python -m lorafarm router (pid 4242)': who listens on `port`, when the OS tells us."""
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                p = psutil.Process(c.pid)
                cmd = " ".join(p.cmdline()[:4]) or p.name()
                return f"{cmd} (pid {c.pid})"
    except Exception:  # no permission to see other users' sockets, or no psutil: say less
        return None
    return None


def wait_router_ready(farm: dict, timeout: float = 60.0) -> None:
    """Until the router's catalog lists the demo aliases (its first registry poll has landed)."""
    tenant = farm["tenants"][0]
    want = set(tenant["aliases"]) | set(farm.get("embedding_models") or {})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(
                f"{farm['router_url']}/v1/models",
                headers={"Authorization": f"Bearer {tenant['api_key']}"},
                timeout=2.0,
            )
            if r.status_code == 200 and want <= {m["id"] for m in r.json()["data"]}:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise CliError("the router did not list the demo aliases in time")


def wait_answering(farm: dict, models: list[str], timeout: float = 600.0) -> None:
    """Until a chat through the router to each of `models` has been answered (200): "ready" means a
    client's first request is answered, not a 503 from replicas still starting."""
    tenant = farm["tenants"][0]
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "temperature": 0}
    deadline = time.monotonic() + timeout
    last = ""
    for model in models:
        while True:
            try:
                r = httpx.post(f"{farm['router_url']}/v1/chat/completions", json={**body, "model": model},
                               headers={"Authorization": f"Bearer {tenant['api_key']}"}, timeout=120.0)
                if r.status_code == 200:
                    break
                last = f"{r.status_code} {r.text[:300]}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise CliError(f"the farm did not answer a chat to {model} within {timeout:.0f} s (last: {last})")
            time.sleep(0.5)


def examples(farm: dict) -> str:
    tenant = farm["tenants"][0]
    alias = sorted(tenant["aliases"])[0] if tenant["aliases"] else sorted(farm["base_models"])[0]
    if f"{DEMO_TENANT}/support:prod" in tenant["aliases"]:
        alias = f"{DEMO_TENANT}/support:prod"
    # a question the demo adapter never saw in training (lorafarm/data/demo_adapters/heldout.json)
    prompt = (farm.get("demo_adapters") or {}).get(alias, {}).get("example_prompt", "hello")
    base = farm["router_url"] + "/v1"
    return f"""
lorafarm is up.
  router (OpenAI API)   {base}
  registry              {farm['registry_url']}   (admin token in farm.json)
  API key (tenant {tenant['tenant_id']})  {tenant['api_key']}
  aliases               {', '.join(sorted(tenant['aliases']))}

curl:
  curl -N {base}/chat/completions \\
    -H "Authorization: Bearer {tenant['api_key']}" -H "Content-Type: application/json" \\
    -d '{{"model": "{alias}", "messages": [{{"role": "user", "content": "{prompt}"}}], "max_tokens": 48, "temperature": 0, "stream": true}}'

python (openai client):
  from openai import OpenAI
  client = OpenAI(base_url="{base}", api_key="{tenant['api_key']}")
  r = client.chat.completions.create(model="{alias}", messages=[{{"role": "user", "content": "{prompt}"}}],
                                     max_tokens=48, temperature=0)  # temperature 0: the greedy answer, every time
  print(r.choices[0].message.content)

{_demo_examples(farm)}{_embedding_example(farm, base, tenant['api_key'])}Ctrl-C stops the farm.
"""


def _demo_examples(farm: dict) -> str:
    """The real model's demo adapters: one line each (alias, what it does) and a loop that shows them."""
    demos = farm.get("demo_adapters") or {}
    if not demos:
        return ""
    base = sorted(farm["base_models"])[0]
    lines = [f"  {alias:<22} {d['behaviour']}" for alias, d in sorted(demos.items())]
    question = next(iter(sorted(demos.items())))[1]["example_prompt"]
    return ("demo adapters (the same new question to the base and to each; greedy with temperature 0):\n"
            + "\n".join(lines) + f"""
  for m in ["{base}", {", ".join(f'"{a}"' for a in sorted(demos))}]:
      r = client.chat.completions.create(model=m, messages=[{{"role": "user", "content": "{question}"}}],
                                         max_tokens=48, temperature=0)
      print(m, "->", r.choices[0].message.content)

""")


def _embedding_example(farm: dict, base: str, api_key: str) -> str:
    models = sorted(farm.get("embedding_models") or {})
    if not models:
        return ""
    return f"""embeddings (same router, same key):
  r = client.embeddings.create(model="{models[0]}", input=["hello", "world"])
  print(len(r.data[0].embedding))

"""
