"""The tiered adapter cache of a replica: device slot <- host RAM <- local disk <- object store.

Tiers
- gpu: mounted in one of the engine's device slots (one slot pool per rank class). LRU among idle
  adapters; an adapter with running requests (reference count > 0) is never evicted: a request that
  needs a slot when every slot of its pool is busy waits for one to become idle.
- ram: verified adapter tensors in host memory (`LoadedAdapter`), bounded in bytes, LRU.
- disk: verified, extracted archive folders under `<disk_dir>/adapters/<adapter_id>/`, bounded in
  bytes, LRU.
- remote: the signed `.lar` in the object store (its `weights_uri` must lie inside the configured
  store) or, without a store, the registry's archive download. An `AdapterSource` says where. From
  a remote (S3) store the archive is verified and extracted while it downloads (archives/stream.py),
  never written whole; a local store's file is read in place.

Every archive is verified (Ed25519 signature, checksums, base_model_hash == the served base, rank <=
the limit) by `archives.extract.extract_archive` before a byte of it is used, and the tensors are
checked against the base model's module shapes before anything is mounted.

Layout: what is where, the LRU orders, reference counts, victims and counters are the pure policy
in `handler.adapters.slots.SlotPolicy` (the fleet simulator runs the same one); the sources of the remote tier
are `handler.adapters.sources` (registry, catalog, store); this module is the mechanics: read, verify, mount,
unmount.

Concurrency: everything here runs on the replica's event loop; file work (download, verify, extract,
read) runs in a small thread pool and engine mounts in one dedicated thread, so loads run beside
the decode loop. Loads are single-flight per adapter (concurrent requests for one cold adapter share
one load) and a request waits only for its own adapter. A failed load fails the waiters of that
adapter only, with an `AdapterLoadError` that says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from archives.digest import file_sha256
from archives.errors import SignatureError
from archives.extract import extract_archive_one_pass
from archives.safetensors_header import read_header
from archives.store.pipe import ChunkPipe
from archives.stream import extract_archive_stream
from handler.model.lora import SlotImage, SlotImageFile, pread_into
from handler.threads import lower_thread_priority
from handler.adapters.errors import SAFE_ID_RE, AdapterLoadError, AdapterNotFoundError, check_adapter_id, error_code
from handler.adapters.slots import LoadTimes, SlotCounters, SlotPolicy
from handler.adapters.sources import AdapterSource, CatalogSource, NoSource, RegistrySource

if TYPE_CHECKING:  # the serving room owns the metrics; the cache only counts into them
    from handler.serving.metrics import ReplicaMetrics

__all__ = [
    "AdapterCache", "AdapterLoadError", "AdapterNotFoundError", "AdapterSource", "CacheCounters",
    "CatalogSource", "LoadedAdapter", "NoSource", "RegistrySource", "check_adapter_id",
    "check_adapter_tensors", "module_shapes",
]

log = logging.getLogger("lorafarm.replica.cache")


def free_bytes(path: Path) -> int:
    """Free space of the filesystem holding `path`."""
    return shutil.disk_usage(path).free

CacheCounters = SlotCounters  # the counters live with the policy (handler/adapters/slots.py)
VERIFIED_STAMP = ".lorafarm-verified.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
IMAGE_FILE = "slot-image.safetensors"  # the adapter in the slot layout (written after verification)
_IMAGE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_KEY_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_([AB])(?:\.default)?\.weight$"
)


# ---------------------------------------------------------------------------------- entries


@dataclass
class LoadedAdapter:
    """A verified adapter in host RAM: a `handler.model.lora.SlotImage` (the slot layout, pinned on CUDA)
    when the engine offers `prepare_adapter`, else PEFT tensor names -> tensors."""

    adapter_id: str
    weights: Any
    rank: int
    alpha: float
    target_modules: list[str]
    nbytes: int
    manifest: dict = field(default_factory=dict)


def module_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-targetable projection of a Llama-family config."""
    get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (
        lambda k, d=None: getattr(config, k, d))
    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or hidden // heads
    inter = get("intermediate_size")
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def check_adapter_tensors(adapter_id: str, weights: dict[str, torch.Tensor], *, rank: int,
                          target_modules: list[str], config: Any) -> None:
    """Every tensor must be a LoRA A/B of a target module of an existing layer with the base's shapes
    and the manifest's rank; each A must have its B. Raises AdapterLoadError(invalid_adapter)."""
    shapes = module_shapes(config)
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    layers = get("num_hidden_layers")
    seen: dict[tuple[int, str], set[str]] = {}

    def bad(msg: str):
        raise AdapterLoadError(adapter_id, "invalid_adapter", msg)

    if not weights:
        bad("the weights file holds no tensors")
    for name, t in weights.items():
        m = _KEY_RE.match(name)
        if not m:
            bad(f"unexpected tensor {name!r} (only LoRA A/B weights of attention/MLP projections)")
        layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in shapes or (block == "self_attn") != (module in ATTN_MODULES):
            bad(f"tensor {name!r}: unknown module {block}.{module}")
        if module not in target_modules:
            bad(f"tensor {name!r}: module {module} is not in target_modules {target_modules}")
        if layer >= layers:
            bad(f"tensor {name!r}: layer {layer} >= the base's {layers} layers")
        if not t.is_floating_point():
            bad(f"tensor {name!r}: dtype {t.dtype} is not floating point")
        k_in, d_out = shapes[module]
        want = (rank, k_in) if ab == "A" else (d_out, rank)
        if tuple(t.shape) != want:
            bad(f"tensor {name!r}: shape {tuple(t.shape)} != {want} (rank {rank}, base {module})")
        seen.setdefault((layer, module), set()).add(ab)
    for (layer, module), abs_ in seen.items():
        if abs_ != {"A", "B"}:
            bad(f"layer {layer} {module}: lora_A and lora_B must both be present")


def save_slot_image(image: SlotImage, path: Path) -> None:
    """Write a SlotImage as safetensors (tmp + rename, so a torn file is never adopted)."""
    from safetensors.torch import save_file

    tmp = path.with_name(f"{path.name}.{threading.get_native_id()}.part")  # two writers never share one
    save_file(image.tensors, str(tmp), metadata={"pool_rank": str(image.pool_rank)})
    tmp.replace(path)


def open_slot_image(path: Path) -> SlotImageFile:
    """The header of a saved slot image: where each stack lies in the file (nothing else is read)."""
    with open(path, "rb", buffering=0) as f:
        size = f.seek(0, 2)
        f.seek(0)
        header = read_header(f, size)
    dtypes = {_IMAGE_DTYPES[info.dtype] for info in header.tensors.values()}
    if len(dtypes) != 1:
        raise OSError(f"{path}: not a slot image (dtypes {sorted(map(str, dtypes))})")
    entries = {name: (info.start, info.end - info.start, tuple(info.shape)) for name, info in header.tensors.items()}
    return SlotImageFile(int(header.metadata["pool_rank"]), dtypes.pop(), {}, path=path, entries=entries)


def read_slot_image(image: SlotImageFile, *, pin_memory: bool = False) -> SlotImage:
    """The rest of an opened slot image in one read: the file's tensor bytes go straight into one
    (pinned) host buffer; every stack is a view of it."""
    start = min((off for off, _, _ in image.entries.values()), default=0)
    end = max((off + n for off, n, _ in image.entries.values()), default=0)
    buf = torch.empty(end - start, dtype=torch.uint8, pin_memory=pin_memory)
    with open(image.path, "rb", buffering=0) as f:
        if pread_into(f.fileno(), buf, start) < end - start:
            raise OSError(f"{image.path}: truncated")
    tensors = {name: buf[off - start : off - start + n].view(image.dtype).view(shape)
               for name, (off, n, shape) in image.entries.items()}
    return SlotImage(image.pool_rank, image.dtype, tensors)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# ---------------------------------------------------------------------------------- the cache


class AdapterCache:
    """See the module docstring. `engine` follows docs/contracts.md (mount_adapter, unmount_adapter,
    mounted_adapters, free_slots, pool_rank_for)."""

    def __init__(
        self,
        engine,
        *,
        base_config: Any,
        base_model_hash: str,
        trusted_keys: list | None,
        source: AdapterSource | None = None,
        disk_dir: str | Path,
        ram_bytes: int = 4 * 1024**3,
        disk_bytes: int = 32 * 1024**3,
        rank_limit: int = 64,
        metrics: ReplicaMetrics | None = None,
        io_threads: int = 2,
        dtype: torch.dtype | None = None,
        pin_memory: bool = False,
        load_nice: int = 10,
    ):
        self.engine = engine
        self.base_config = base_config
        self.base_model_hash = base_model_hash
        self.trusted_keys = list(trusted_keys or [])
        self.source: AdapterSource = source or NoSource()
        self.disk_dir = Path(disk_dir)
        self.adapters_dir = self.disk_dir / "adapters"
        self.tmp_dir = self.disk_dir / "tmp"
        self.rank_limit = int(rank_limit)
        self.metrics = metrics
        self.dtype = dtype
        self.pin_memory = pin_memory
        lora = getattr(engine, "lora", None)
        pools = {int(r): int(n) for r, n in (getattr(lora, "pools", None) or [])}
        self.policy = SlotPolicy(pools, ram_bytes=int(ram_bytes), disk_bytes=int(disk_bytes))  # the tiers' budgets
        self.counters = self.policy.counters
        self.load_times = LoadTimes()
        self.prefetch_hits = 0
        self.streamed_loads = 0  # remote loads verified and extracted while downloading (no archive file)
        self._prefetched: set[str] = set()  # brought in by prefetch/load, not yet asked for
        # Loads are background work: their threads run at a lower CPU priority (nice) than the decode
        # loop, so on a busy host a cold load slows itself down, not the running batch's tokens.
        self._io = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="lorafarm-io",
                                      initializer=lower_thread_priority, initargs=(load_nice,))
        self._mount_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorafarm-mount",
                                                initializer=lower_thread_priority, initargs=(load_nice,))
        self._image_writes: dict[str, asyncio.Task] = {}  # slot images being written after a fetch
        self._ram_fills: dict[str, asyncio.Task] = {}  # RAM copies being read after a disk -> slot mount
        # tiers: the policy keeps what is where (and the LRU orders); this keeps the RAM tensors
        self._ram: dict[str, LoadedAdapter] = {}
        # in flight
        self._mounting: dict[str, asyncio.Task] = {}  # -> device slot
        self._fetching: dict[str, asyncio.Task] = {}  # remote/disk -> ram
        self._pool_locks: dict[int, asyncio.Lock] = {}
        self._slot_freed: asyncio.Condition | None = None
        self._draining: dict[str, asyncio.Future] = {}
        self._unverified: set[str] = set()  # adopted from a previous run: checksums checked on first read
        self._images: set[str] = set()  # slot-image files this run wrote (an adopted one is rebuilt)

    # -- setup ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the folders and re-adopt adapters verified by a previous run (their checksums are
        checked again on first read, so a restart does not hash the whole disk tier up front)."""
        self._slot_freed = asyncio.Condition()
        self.adapters_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        found = await asyncio.get_running_loop().run_in_executor(self._io, self._scan_disk)
        for aid, nbytes, mtime in sorted(found, key=lambda x: x[2]):
            self.policy.put("disk", aid, nbytes)  # nothing is trimmed until every folder is in
            self._unverified.add(aid)
        self._fit_disk_budget()
        self._trim_disk()
        self._update_gauges()

    @property
    def ram_bytes(self) -> int:
        return self.policy.ram_bytes

    @property
    def disk_bytes(self) -> int:
        return self.policy.disk_bytes

    def has_room(self, tier: str, share: float = 0.9, pending: int = 0) -> bool:
        """Whether `tier` ("ram" or "disk") holds less than `share` of its budget, counting `pending`
        pulls already under way at the tier's mean entry size. Background pulls stop there: pulling
        more than fits would only evict what they pulled a moment before."""
        used, n = self.policy.used_bytes(tier), self.policy.count(tier)
        budget = self.ram_bytes if tier == "ram" else self.disk_bytes
        return used + pending * (used / n if n else 0) < share * budget

    def _fit_disk_budget(self) -> None:
        """The disk tier never takes more than half of what it could have (what it holds plus the
        filesystem's free space): a default budget larger than the disk would otherwise fill it for
        every process on the host, the registry's store included. Half of held + free, not held +
        half of free: the cap stays put over restarts instead of ratcheting up each time."""
        usable = (self.policy.used_bytes("disk") + free_bytes(self.adapters_dir)) // 2
        if usable < self.disk_bytes:
            log.warning("disk tier budget %.1f GiB capped at %.1f GiB: half of what it holds plus the free space of %s",
                        self.disk_bytes / 2**30, usable / 2**30, self.adapters_dir)
            self._disk_evicted(self.policy.set_budget("disk", usable))

    def _scan_disk(self) -> list[tuple[str, int, float]]:
        """Adopt `<disk_dir>/adapters/<id>/` folders whose verification stamp matches this base and
        rank limit and whose files have the manifest's sizes; remove the rest."""
        out = []
        for d in self.adapters_dir.iterdir():
            ok = False
            try:
                stamp = json.loads((d / VERIFIED_STAMP).read_text())
                man = stamp["manifest"]
                ok = (
                    d.is_dir() and SAFE_ID_RE.match(d.name) is not None
                    and stamp.get("adapter_id") == d.name
                    and man.get("base_model_hash") == self.base_model_hash
                    and int(man.get("rank", 0)) <= self.rank_limit
                )
                files = man.get("files") or {}
                for name in (CONFIG_FILE, WEIGHTS_FILE):
                    info = files.get(name)
                    if not ok or not isinstance(info, dict) or (d / name).stat().st_size != info.get("size"):
                        ok = False
                        break
            except Exception:
                ok = False
            if ok:
                (d / IMAGE_FILE).unlink(missing_ok=True)  # rebuilt from the re-checked originals
                out.append((d.name, _dir_bytes(d), d.stat().st_mtime))
            else:
                log.warning("removing unverifiable adapter folder %s", d)
                shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
        return out

    async def close(self) -> None:
        # background image writes and RAM fills: abandoned (the folder is re-checked on the next start)
        pending = [*self._image_writes.values(), *self._ram_fills.values()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        try:
            await self.source.close()
        finally:
            self._io.shutdown(wait=False, cancel_futures=True)
            self._mount_thread.shutdown(wait=False, cancel_futures=True)

    # -- queries ----------------------------------------------------------------------------

    def tier_of(self, adapter_id: str) -> str:
        return self.policy.tier_of(adapter_id)

    def gpu_adapters(self) -> list[str]:
        return self.policy.resident("gpu")

    def ram_adapters(self) -> list[str]:
        return self.policy.resident("ram")

    def disk_adapters(self) -> list[str]:
        return self.policy.resident("disk")

    def refcount(self, adapter_id: str) -> int:
        return self.policy.refcount(adapter_id)

    def is_local(self, adapter_id: str) -> bool:
        return self.policy.tier_of(adapter_id) != "remote"

    def held(self) -> dict[str, tuple[str, float]]:
        """Every adapter held here (device, RAM, disk) -> (tier, expected load ms from that tier)."""
        out: dict[str, tuple[str, float]] = {}
        for aid in self.policy.resident("disk"):
            out[aid] = ("disk", self.load_times.expected_ms("disk", self._image_bytes(aid)))
        for aid in self.policy.resident("ram"):
            out[aid] = ("ram", self.load_times.expected_ms("ram", self.policy.nbytes("ram", aid)))
        for aid in self.policy.resident("gpu"):
            out[aid] = ("gpu", 0.0)
        return out

    def _image_bytes(self, adapter_id: str) -> int | None:
        la = self._ram.get(adapter_id)
        if la is not None:
            return la.nbytes
        n = self.policy.nbytes("disk", adapter_id)
        return n // 2 if n and adapter_id in self._images else n  # the folder holds the image + originals

    @property
    def _ram_used(self) -> int:
        return self.policy.used_bytes("ram")

    @property
    def _disk_used(self) -> int:
        return self.policy.used_bytes("disk")

    async def exists(self, adapter_id: str) -> bool:
        """Known here or to the source (registry / catalog)."""
        try:
            check_adapter_id(adapter_id)
        except AdapterNotFoundError:
            return False
        if self.is_local(adapter_id) or adapter_id in self._mounting or adapter_id in self._fetching:
            return True
        return await self.source.exists(adapter_id)

    def stats(self) -> dict:
        c = self.counters
        m = self.metrics
        return {
            "gpu": len(self.gpu_adapters()), "ram": len(self.ram_adapters()), "disk": len(self.disk_adapters()),
            "ram_bytes": self._ram_used, "disk_bytes": self._disk_used,
            "loads": dict(c.loads), "load_errors": c.load_errors,
            "evictions": c.evictions, "evictions_in_use": c.evictions_in_use,
            "ram_evictions": c.ram_evictions, "disk_evictions": c.disk_evictions,
            "slot_hits": c.slot_hits, "slot_misses": c.slot_misses, "slot_waits": c.slot_waits,
            "prefetch_hits": self.prefetch_hits, "load_ms": self.load_times.averages_ms(),
            "loads_per_min": m.loads_per_min() if m else 0.0,
            "evictions_per_min": m.evictions_per_min() if m else 0.0,
            "refs": {a: self.refcount(a) for a in self.gpu_adapters() if self.refcount(a)},
        }

    # -- request path -----------------------------------------------------------------------

    async def acquire(self, adapter_id: str) -> str:
        """Make `adapter_id` resident in a device slot and take a reference on it (the caller must
        `release` it once its request finished). Returns the tier it was found in. Waits only for this
        adapter's own load; raises AdapterNotFoundError / AdapterLoadError."""
        check_adapter_id(adapter_id)
        tier = self.tier_of(adapter_id)
        counted = False
        while True:
            drain = self._draining.get(adapter_id)
            if drain is not None:
                await asyncio.shield(drain)
                continue
            if self.policy.take_ref(adapter_id):
                if not counted:
                    self._count_hit(adapter_id, tier)
                return tier
            if not counted:
                self._count_hit(adapter_id, tier)
                counted = True
            await self._ensure_mounted(adapter_id)

    def release(self, adapter_id: str) -> None:
        """Drop one reference (on the event loop). An idle adapter becomes evictable (LRU)."""
        if self.policy.refcount(adapter_id) <= 0:
            log.error("release of %s without a reference", adapter_id)
            return
        if self.policy.release(adapter_id):
            self._notify_slot_freed()

    def _count_hit(self, adapter_id: str, tier: str) -> None:
        self.policy.count_request(tier)
        self.policy.note_request(adapter_id)
        if adapter_id in self._prefetched:
            self._prefetched.discard(adapter_id)
            self.prefetch_hits += 1
            if self.metrics:
                self.metrics.prefetch_hits.labels(tier=tier).inc()
        if tier == "gpu":
            if self.metrics:
                self.metrics.adapter_slot_hits.inc()
        else:
            if self.metrics:
                self.metrics.adapter_slot_misses.labels(tier=tier).inc()

    def _notify_slot_freed(self) -> None:
        cond = self._slot_freed
        if cond is None:
            return

        async def _notify():
            async with cond:
                cond.notify_all()

        asyncio.get_running_loop().create_task(_notify())

    # -- admin path -------------------------------------------------------------------------

    async def load(self, adapter_id: str) -> str:
        """Pre-warm into a device slot (no reference kept). Returns the tier it was in."""
        check_adapter_id(adapter_id)
        tier = self.tier_of(adapter_id)
        while self.policy.slot(adapter_id) is None:
            drain = self._draining.get(adapter_id)
            if drain is not None:
                await asyncio.shield(drain)
                continue
            await self._ensure_mounted(adapter_id)
        self.policy.touch(adapter_id)
        if tier != "gpu":
            self._prefetched.add(adapter_id)
        return tier

    async def prefetch(self, adapter_id: str, *, to_ram: bool = True) -> str:
        """Pull to disk (and RAM when `to_ram`) without taking a slot. Returns the tier it was in."""
        check_adapter_id(adapter_id)
        tier = self.tier_of(adapter_id)
        try:
            if to_ram:
                if adapter_id not in self._ram:
                    la = await self._ensure_ram(adapter_id)
                    if self.policy.slot(adapter_id) is not None:
                        return tier
                    self._put_ram(la)
                    self._prefetched.add(adapter_id)
            else:
                await self._ensure_disk(adapter_id)
            await self._image_written(adapter_id)  # not on a request's path: leave the tiers settled
        except (AdapterLoadError, AdapterNotFoundError, asyncio.CancelledError):
            raise
        except Exception as e:  # a refused archive: say why, as a load would
            raise AdapterLoadError(adapter_id, error_code(e), str(e) or e.__class__.__name__) from e
        return tier

    async def prefetch_popular(self, n: int, *, fill_slots: bool = True) -> dict[str, str]:
        """Pre-warm the `n` adapters this replica's own traffic asks for most (decayed counts): into
        RAM from disk or the store, and into device slots while their pool has a free one (never
        evicting for it). Returns {adapter_id: tier it was in} for those it moved."""
        moved: dict[str, str] = {}
        for aid in self.policy.popular(n):
            tier = self.tier_of(aid)
            if tier == "gpu" or aid in self._mounting or aid in self._draining:
                continue
            try:
                if tier in ("disk", "remote"):
                    await self.prefetch(aid, to_ram=True)
                    moved[aid] = tier
                la = self._ram.get(aid)
                if fill_slots and la is not None and self.policy.slot(aid) is None:
                    pool = self.engine.pool_rank_for(la.rank)
                    if self.policy.free_slots(pool) > 0:
                        await self.load(aid)
                        moved[aid] = tier
            except (AdapterLoadError, AdapterNotFoundError) as e:
                log.info("prefetch of popular %s skipped: %s", aid, e)
        return moved

    async def unload(self, adapter_id: str, *, purge_disk: bool = False, timeout: float | None = None) -> dict:
        """Drain (new requests for it wait; running ones finish), then unmount it and drop it from RAM
        (and from disk with `purge_disk`). Returns what was removed."""
        check_adapter_id(adapter_id)
        while adapter_id in self._draining:
            await asyncio.shield(self._draining[adapter_id])
        done = asyncio.get_running_loop().create_future()
        self._draining[adapter_id] = done
        self.policy.hold(adapter_id)  # draining: never an eviction victim meanwhile
        self.policy.forget(adapter_id)  # and not brought back by popularity prefetch
        self._prefetched.discard(adapter_id)
        removed: list[str] = []
        try:
            while adapter_id in self._mounting:  # a load in flight: let it land, then remove it
                try:
                    await asyncio.shield(self._mounting[adapter_id])
                except Exception:
                    pass
            assert self._slot_freed is not None
            async with self._slot_freed:
                await asyncio.wait_for(
                    self._slot_freed.wait_for(lambda: self.refcount(adapter_id) == 0), timeout)
            if self.policy.slot(adapter_id) is not None:
                slot = self.policy.unmount(adapter_id)
                try:
                    await self._run_mount_thread(self.engine.unmount_adapter, adapter_id)
                except Exception:
                    self.policy.restore(slot)
                    raise
                removed.append("gpu")
                self._notify_slot_freed()
            fill = self._ram_fills.get(adapter_id)
            if fill is not None:  # a RAM copy being made: let it land (it checks draining), then drop it
                with contextlib.suppress(Exception):
                    await asyncio.shield(fill)
            if adapter_id in self._ram:
                self._drop_ram(adapter_id)
                removed.append("ram")
            if purge_disk:
                await self._image_written(adapter_id)  # never delete a folder being written
            if purge_disk and self.policy.nbytes("disk", adapter_id) is not None \
                    and not self.policy.is_pinned_disk(adapter_id):
                self._drop_disk(adapter_id)
                removed.append("disk")
        finally:
            self.policy.unhold(adapter_id)
            del self._draining[adapter_id]
            done.set_result(None)
            self._update_gauges()
        return {"adapter_id": adapter_id, "removed": removed}

    # -- loading ----------------------------------------------------------------------------

    async def _ensure_mounted(self, adapter_id: str) -> None:
        """Single-flight: one load task per adapter, not owned by any request (a caller that goes away
        never cancels the load for the others); every caller awaits it shielded."""
        task = self._mounting.get(adapter_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load_and_mount(adapter_id))
            self._mounting[adapter_id] = task

            def _done(t, aid=adapter_id):
                if self._mounting.get(aid) is t:
                    del self._mounting[aid]
                if not t.cancelled():
                    t.exception()  # retrieved here; callers get it from their own await

            task.add_done_callback(_done)
        self.policy.hold(adapter_id)
        try:
            await asyncio.shield(task)
        finally:
            # the caller takes its reference right after this returns, in the same loop turn
            self.policy.unhold(adapter_id)

    async def _load_and_mount(self, adapter_id: str) -> None:
        src_tier = self.tier_of(adapter_id)
        t0 = time.perf_counter()
        pinned = False  # the disk -> slot path (the folder is pinned while its image is read)
        try:
            la = self._ram.get(adapter_id)
            if la is not None:
                self.policy.touch(adapter_id, "ram")
            elif self._image_on_disk(adapter_id):
                # disk -> slot in one read: the stacks go from the image file straight into the slot
                # (RAM gets its copy afterwards, off this request's path); the folder stays meanwhile
                self.policy.pin_disk(adapter_id)
                pinned = True
                la = await asyncio.get_running_loop().run_in_executor(self._io, self._disk_image, adapter_id)
                self.policy.touch(adapter_id, "disk")
                if self.metrics:
                    self.metrics.bytes_moved.labels(tier="disk").inc(la.nbytes)
            else:
                la = await self._ensure_ram(adapter_id)
            waited = await self._mount(la)
        except BaseException as e:
            if pinned and not isinstance(e, asyncio.CancelledError):
                # a bad image file (cut short, changed): read the verified PEFT files the next time
                self._images.discard(adapter_id)
                with contextlib.suppress(OSError):
                    (self.adapters_dir / adapter_id / IMAGE_FILE).unlink()
            self.policy.count_load(src_tier, ok=False)
            if self.metrics:
                self.metrics.record_load(src_tier, time.perf_counter() - t0, ok=False)
            if isinstance(e, asyncio.CancelledError):
                raise AdapterLoadError(adapter_id, "cancelled", "the load was cancelled (shutdown)") from None
            if isinstance(e, (AdapterLoadError, AdapterNotFoundError)):
                log.warning("load of %s failed: %s", adapter_id, e)
                raise
            err = AdapterLoadError(adapter_id, error_code(e), str(e) or e.__class__.__name__)
            log.warning("load of %s failed: %s", adapter_id, err)
            raise err from e
        else:
            self.policy.count_load(src_tier)
            seconds = time.perf_counter() - t0
            self.load_times.observe("ram" if src_tier == "gpu" else src_tier, seconds - waited, la.nbytes)
            if self.metrics:
                self.metrics.record_load(src_tier, seconds, ok=True)
        finally:
            if pinned:
                self.policy.unpin_disk(adapter_id)
            self._update_gauges()

    def _image_on_disk(self, adapter_id: str) -> bool:
        """A slot image this run wrote (of a verified folder) is on disk, and no fetch is in flight."""
        return (adapter_id in self._images and adapter_id not in self._unverified
                and adapter_id not in self._fetching and self.policy.nbytes("disk", adapter_id) is not None)

    def _disk_image(self, adapter_id: str, man: dict | None = None) -> LoadedAdapter:
        """The verified folder's slot image, header only (`SlotImageFile`): mounting reads the rest.
        `man`: the folder's verified manifest when the caller has read it already."""
        d = self.adapters_dir / adapter_id
        man = man if man is not None else json.loads((d / VERIFIED_STAMP).read_text())["manifest"]
        self._check_manifest(adapter_id, man)
        image = open_slot_image(d / IMAGE_FILE)
        rank = int(man["rank"])
        return LoadedAdapter(adapter_id, image, rank, float(man.get("alpha", rank)),
                             list(man.get("target_modules") or []), image.nbytes, man)

    def _fill_ram_later(self, adapter_id: str) -> None:
        """After a disk -> slot mount: read the image into the RAM tier too (io pool, low priority),
        so a later eviction from the slot demotes it to RAM, not to disk."""
        if adapter_id in self._ram_fills:
            return

        async def fill() -> None:
            try:
                la = await asyncio.get_running_loop().run_in_executor(self._io, self._read_disk, adapter_id)
            except Exception as e:  # the folder was evicted meanwhile: it stays on its tier
                log.info("RAM copy of %s not made: %s", adapter_id, e)
                return
            # still mounted, or just demoted to disk (then RAM is exactly where it belongs); not unloaded
            if adapter_id not in self._ram and adapter_id not in self._draining \
                    and self.tier_of(adapter_id) in ("gpu", "disk"):
                self._put_ram(la)
                self._update_gauges()

        task = asyncio.get_running_loop().create_task(fill())
        self._ram_fills[adapter_id] = task
        task.add_done_callback(lambda t: self._ram_fills.pop(adapter_id, None))

    async def _mount(self, la: LoadedAdapter) -> float:
        """Take a slot in the adapter's rank pool (evicting the LRU idle adapter of that pool, or
        waiting for one to become idle) and mount it there. Returns the seconds spent waiting for a
        busy pool (not part of the load's own cost)."""
        pool = self.engine.pool_rank_for(la.rank)
        lock = self._pool_locks.setdefault(pool, asyncio.Lock())
        t_wait = time.perf_counter()
        async with lock:
            waited = False
            while True:
                step, victim = self.policy.plan_mount(la.adapter_id, pool)
                if step == "free":
                    wait_s = time.perf_counter() - t_wait
                    break
                if step == "evict":
                    try:
                        await self._evict_slot(victim)
                    except Exception as e:  # the engine still holds a row of it (a cancel in flight)
                        log.debug("eviction of %s deferred: %s", victim, e)
                        await asyncio.sleep(0.005)
                    continue
                if not waited:
                    self.policy.count_wait()
                    waited = True
                assert self._slot_freed is not None
                async with self._slot_freed:
                    # re-check under the condition; wake up at least every second as a safety net
                    if self.policy.lru_idle(pool) is None and self.policy.free_slots(pool) <= 0:
                        try:
                            await asyncio.wait_for(self._slot_freed.wait(), 1.0)
                        except asyncio.TimeoutError:
                            pass
            try:
                await self._run_mount_thread(
                    self.engine.mount_adapter, la.adapter_id, la.weights,
                    rank=la.rank, alpha=la.alpha, target_modules=list(la.target_modules))
            except BaseException:
                self.policy.cancel_mount(la.adapter_id)
                raise
            self.policy.on_mounted(la.adapter_id, pool)
            if isinstance(la.weights, SlotImageFile):
                self._fill_ram_later(la.adapter_id)
                return wait_s
            if self.metrics:
                self.metrics.bytes_moved.labels(tier="ram").inc(la.nbytes)
            if la.adapter_id not in self._ram:
                self._put_ram(la)
        return wait_s

    async def _evict_slot(self, adapter_id: str) -> None:
        slot = self.policy.evict(adapter_id)  # gone from the table first: no new reference can land
        in_use = slot.refs > 0
        try:
            await self._run_mount_thread(self.engine.unmount_adapter, adapter_id)
        except Exception:
            self.policy.undo_evict(slot)
            raise
        if self.metrics:
            self.metrics.record_eviction("gpu", in_use=in_use)
        log.info("evicted %s from its device slot (pool r%d)", adapter_id, slot.pool)

    async def _run_mount_thread(self, fn, *args, **kw):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._mount_thread, lambda: fn(*args, **kw))

    async def _ensure_ram(self, adapter_id: str) -> LoadedAdapter:
        """Single-flight (a task, shielded): disk (fetched from remote first when needed) -> verified
        tensors. The caller decides whether to keep them in the RAM tier."""
        la = self._ram.get(adapter_id)
        if la is not None:
            self.policy.touch(adapter_id, "ram")
            return la
        task = self._fetching.get(adapter_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._disk_to_ram(adapter_id))
            self._fetching[adapter_id] = task

            def _done(t, aid=adapter_id):
                if self._fetching.get(aid) is t:
                    del self._fetching[aid]
                if not t.cancelled():
                    t.exception()

            task.add_done_callback(_done)
        return await asyncio.shield(task)

    async def _disk_to_ram(self, adapter_id: str) -> LoadedAdapter:
        fresh = await self._ensure_disk(adapter_id)
        if fresh is not None:  # just fetched: verified, built and written; no read back
            return fresh
        loop = asyncio.get_running_loop()
        self.policy.pin_disk(adapter_id)
        try:
            if adapter_id in self._unverified:
                if await loop.run_in_executor(self._io, self._recheck_disk, adapter_id):
                    self._unverified.discard(adapter_id)
                else:  # changed on disk since it was verified: drop it and fetch a fresh copy
                    log.warning("adapter %s changed on disk since it was verified: fetching it again", adapter_id)
                    self.policy.unpin_disk(adapter_id)
                    self._drop_disk(adapter_id)
                    fresh = await self._ensure_disk(adapter_id)
                    if fresh is not None:
                        return fresh
                    self.policy.pin_disk(adapter_id)
            la = await loop.run_in_executor(self._io, self._read_disk, adapter_id)
            if self.metrics:
                self.metrics.bytes_moved.labels(tier="disk").inc(la.nbytes)
        finally:
            self.policy.unpin_disk(adapter_id)
        self.policy.touch(adapter_id, "disk")
        return la

    async def _ensure_disk(self, adapter_id: str) -> LoadedAdapter | None:
        """On disk already: None. Else fetch, verify, extract and build its slot image (the verified
        folder then holds the image file) and return the built adapter."""
        if self.policy.nbytes("disk", adapter_id) is not None:
            self.policy.touch(adapter_id, "disk")
            return None
        if not await self.source.exists(adapter_id):
            raise AdapterNotFoundError(adapter_id)
        loop = asyncio.get_running_loop()
        tmp = self.tmp_dir / f"{adapter_id}.{time.monotonic_ns()}"
        tmp.mkdir(parents=True)
        try:
            open_stream = getattr(self.source, "open_stream", None)
            chunks = await open_stream(adapter_id) if open_stream is not None else None
            if chunks is not None:  # a remote store: verified and extracted as it downloads, no archive file
                manifest, la, archive_bytes = await self._extract_stream(adapter_id, chunks, tmp / "x")
            else:
                # a local store's own file is read in place (no copy); a registry download lands in tmp
                lar = await self.source.fetch(adapter_id, tmp / "archive.lar") or tmp / "archive.lar"
                archive_bytes = lar.stat().st_size
                manifest, la = await loop.run_in_executor(self._io, self._extract, adapter_id, lar, tmp / "x")
            final = self.adapters_dir / adapter_id
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            (tmp / "x").rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if self.metrics:
            self.metrics.bytes_moved.labels(tier="remote").inc(archive_bytes)
        nbytes = _dir_bytes(final)
        victims = self.policy.put("disk", adapter_id, nbytes)
        log.info("fetched %s (%s bytes, version %s)", adapter_id, nbytes, manifest.get("version"))
        self._disk_evicted(victims or [])
        if isinstance(la.weights, SlotImage):
            self._write_image_later(adapter_id, la.weights)
        return la

    async def _image_written(self, adapter_id: str) -> None:
        """Wait for a pending slot-image write of this adapter (and its disk accounting) to finish."""
        fut = self._image_writes.get(adapter_id)
        if fut is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(fut)

    def _write_image_later(self, adapter_id: str, image: SlotImage) -> None:
        """Write the fresh adapter's slot image into its disk folder off the load's critical path
        (the waiting request mounts from RAM meanwhile); the next disk -> RAM read is then one read.
        Until it is written the folder is read the slow way, so a failed write costs only speed."""
        folder = self.adapters_dir / adapter_id

        async def write() -> None:
            try:
                await asyncio.get_running_loop().run_in_executor(self._io, save_slot_image, image, folder / IMAGE_FILE)
            except Exception as e:
                log.info("slot image of %s not written: %s", adapter_id, e)
                return
            if self.policy.nbytes("disk", adapter_id) is None or not (folder / IMAGE_FILE).exists():
                return  # evicted from disk meanwhile
            self._image_saved(adapter_id)

        # a task, not a future's callback: whoever awaits it sees the accounting done too
        task = asyncio.get_running_loop().create_task(write())
        self._image_writes[adapter_id] = task
        task.add_done_callback(lambda t: self._image_writes.pop(adapter_id, None) if self._image_writes.get(adapter_id) is t else None)

    async def _extract_stream(self, adapter_id: str, chunks, dest: Path) -> tuple[dict, LoadedAdapter, int]:
        """`_extract` of an archive streamed from the store: the io thread reads it through a bounded
        pipe while it downloads. A failed download fails the extraction; a failed extraction stops
        the download. Returns (manifest, adapter, archive bytes)."""
        pipe = ChunkPipe(depth=8)
        feeder = asyncio.get_running_loop().create_task(pipe.feed(chunks))
        try:
            manifest, la = await asyncio.get_running_loop().run_in_executor(
                self._io, self._extract, adapter_id, pipe, dest)
        finally:
            pipe.close()
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
        self.streamed_loads += 1
        return manifest, la, pipe.nbytes

    def _extract(self, adapter_id: str, lar, dest: Path) -> tuple[dict, LoadedAdapter]:
        """Verify (signature, checksums, base hash, rank limit) then extract the archive at path `lar`
        (or read from the stream `lar`); stamp the folder; check the tensors and build the slot image
        into it."""
        if not self.trusted_keys:
            raise SignatureError("no trusted public key configured (--trust): refusing unsigned trust")
        dest.mkdir(parents=True, exist_ok=True)
        extract = extract_archive_one_pass if isinstance(lar, Path) else extract_archive_stream
        manifest = extract(lar, dest, self.trusted_keys, base_model_hash=self.base_model_hash,
                           max_rank=self.rank_limit)
        man = manifest.model_dump(mode="json") if hasattr(manifest, "model_dump") else dict(manifest)
        if man.get("adapter_id") != adapter_id:
            raise AdapterLoadError(adapter_id, "invalid_adapter",
                                   f"the archive is signed for adapter {man.get('adapter_id')!r}, not {adapter_id!r}")
        stamp = {"adapter_id": adapter_id, "manifest": man, "verified_at": time.time()}
        (dest / VERIFIED_STAMP).write_text(json.dumps(stamp))
        return man, self._build(adapter_id, dest, man, save_image=False)

    def _recheck_disk(self, adapter_id: str) -> bool:
        """The files of an adopted folder still have their verified manifest's checksums."""
        d = self.adapters_dir / adapter_id
        try:
            files = json.loads((d / VERIFIED_STAMP).read_text())["manifest"]["files"]
            return all(file_sha256(d / name) == files[name]["sha256"] for name in (CONFIG_FILE, WEIGHTS_FILE))
        except Exception:
            return False

    def _read_disk(self, adapter_id: str) -> LoadedAdapter:
        """A verified folder into RAM: its slot image in one read when this run wrote it, else the
        PEFT files read, checked and laid out again (and the image written for next time)."""
        d = self.adapters_dir / adapter_id
        man = json.loads((d / VERIFIED_STAMP).read_text())["manifest"]
        if adapter_id in self._images and (d / IMAGE_FILE).exists():
            la = self._disk_image(adapter_id, man)
            la.weights = read_slot_image(la.weights, pin_memory=self.pin_memory)
            return la
        la = self._build(adapter_id, d, man)
        if (d / IMAGE_FILE).exists():
            self._image_saved(adapter_id)
        return la

    def _image_saved(self, adapter_id: str) -> None:
        """The folder now holds its slot image: next disk reads use it, and the disk tier counts the
        folder's grown size."""
        self._images.add(adapter_id)
        if self.policy.drop("disk", adapter_id) is not None:
            self._disk_evicted(self.policy.put("disk", adapter_id, _dir_bytes(self.adapters_dir / adapter_id)) or [])

    def _check_manifest(self, adapter_id: str, man: dict) -> None:
        rank = int(man["rank"])
        if rank > self.rank_limit:
            raise AdapterLoadError(adapter_id, "rank_limit", f"rank {rank} > the replica's limit {self.rank_limit}")
        if man.get("base_model_hash") != self.base_model_hash:
            raise AdapterLoadError(adapter_id, "base_mismatch",
                                   f"built for base {man.get('base_model_hash')}, this replica serves "
                                   f"{self.base_model_hash}")

    def _build(self, adapter_id: str, d: Path, man: dict, *, save_image: bool = True) -> LoadedAdapter:
        """Read the verified PEFT files of folder `d`, check the tensors against the base's shapes and
        lay them out for a slot (written to `d/IMAGE_FILE`, unless `save_image` is False, so the next
        disk read is one read)."""
        from safetensors.torch import load_file

        self._check_manifest(adapter_id, man)
        rank = int(man["rank"])
        cfg = json.loads((d / CONFIG_FILE).read_text())
        for unsupported in ("use_dora", "use_rslora"):
            if cfg.get(unsupported):
                raise AdapterLoadError(adapter_id, "invalid_adapter", f"{unsupported} adapters are not supported")
        for pattern in ("rank_pattern", "alpha_pattern"):
            if cfg.get(pattern):
                raise AdapterLoadError(adapter_id, "invalid_adapter", f"per-module {pattern} is not supported")
        weights = load_file(str(d / WEIGHTS_FILE))
        target_modules = list(man.get("target_modules") or cfg.get("target_modules") or [])
        check_adapter_tensors(adapter_id, weights, rank=rank, target_modules=target_modules,
                              config=self.base_config)
        alpha = float(man.get("alpha", cfg.get("lora_alpha", rank)))
        prepare = getattr(self.engine, "prepare_adapter", None)
        if prepare is not None:  # the slot layout: a mount is then one copy per stack
            image = prepare(weights, rank=rank, alpha=alpha, target_modules=target_modules,
                            pin_memory=self.pin_memory)
            if save_image:
                save_slot_image(image, d / IMAGE_FILE)
            return LoadedAdapter(adapter_id, image, rank, alpha, target_modules, image.nbytes, man)
        if self.dtype is not None:
            weights = {k: v.to(self.dtype) for k, v in weights.items()}
        if self.pin_memory:
            weights = {k: v.pin_memory() for k, v in weights.items()}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        return LoadedAdapter(adapter_id, weights, rank, alpha, target_modules, nbytes, man)

    # -- RAM / disk bookkeeping -------------------------------------------------------------

    def _put_ram(self, la: LoadedAdapter) -> None:
        victims = self.policy.put("ram", la.adapter_id, la.nbytes)
        if victims is None:
            return  # larger than the whole tier: serve it from disk each time
        self._ram[la.adapter_id] = la
        for victim in victims:
            self._ram.pop(victim, None)
            if self.metrics:
                self.metrics.record_eviction("ram")
        self._update_gauges()

    def _drop_ram(self, adapter_id: str) -> None:
        self.policy.drop("ram", adapter_id)
        self._ram.pop(adapter_id, None)

    def _trim_disk(self) -> None:
        self._disk_evicted(self.policy.trim("disk"))

    def _disk_evicted(self, victims: list[str]) -> None:
        """The policy pushed these out of the disk tier: remove their folders."""
        for victim in victims:
            self._remove_disk_folder(victim)
            if self.metrics:
                self.metrics.record_eviction("disk")

    def _drop_disk(self, adapter_id: str) -> None:
        if self.policy.drop("disk", adapter_id) is not None:
            self._remove_disk_folder(adapter_id)
        self._unverified.discard(adapter_id)

    def _remove_disk_folder(self, adapter_id: str) -> None:
        self._unverified.discard(adapter_id)
        self._images.discard(adapter_id)
        shutil.rmtree(self.adapters_dir / adapter_id, ignore_errors=True)

    def _update_gauges(self) -> None:
        m = self.metrics
        if not m:
            return
        m.adapters_resident.labels(tier="gpu").set(len(self.gpu_adapters()))
        m.adapters_resident.labels(tier="ram").set(len(self.ram_adapters()))
        m.adapters_resident.labels(tier="disk").set(len(self.disk_adapters()))
        m.tier_bytes.labels(tier="ram").set(self._ram_used)
        m.tier_bytes.labels(tier="disk").set(self._disk_used)
