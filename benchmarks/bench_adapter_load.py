"""Adapter load latency per tier through the replica's real cache code, at the seed's adapter size.

The adapter has the seed's shapes: a 7B Llama (32 layers, hidden 4096, MLP 11008), rank 16 on all
seven projections, bfloat16: 39,976,960 values, 80 MB. The "slot" is a real `handler.model.lora.ModelLoRA`
stack of those shapes (one rank-16 slot) behind a minimal engine facade, so no 14 GB base is needed;
`handler.adapters.cache.AdapterCache` runs exactly as in a replica:

- ram -> slot: verified tensors in host RAM copied into the slot stack (`mount_adapter`);
- disk -> slot: safetensors read from the verified, extracted folder, shape check, copy into the slot;
- store -> slot: the signed `.lar` fetched from a file:// object store, signature + checksums + base
  hash + rank verified, extracted, read, checked, copied into the slot.

Each is paired with its floor on the same bytes: a plain memcpy (tensor copy) of 80 MB, a plain read
of the safetensors file, a plain copy of the archive file. The disk and store numbers run with the
page cache warm (the file was just written), so they show our overhead over the read, not the disk.

    .venv/bin/python -m pytest benchmarks/bench_adapter_load.py --benchmark-only --benchmark-enable

Figures are also written to `benchmarks/results/<device>-adapter_load.json` (via `bench_report`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from handler.adapters.cache import AdapterCache, CatalogSource, module_shapes
from handler.model.lora import ModelLoRA, SlotImage
from handler.model.runner import ModelConfig

RANK = 16
ALPHA = 32
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_CONFIG = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128}
BASE_HASH = "sha256:" + "7b" * 32  # stands in for base_model_hash() of the 14 GB checkpoint
ROUNDS = 5
PHASES = 3  # TPOT benchmark: base and with-loads phases, alternated
VALUES = 39_976_960


class StackEngine:
    """The engine's adapter-slot API (docs/contracts.md) over a bare ModelLoRA of 7B shapes."""

    def __init__(self, pools: dict[int, int], dtype: torch.dtype = torch.bfloat16):
        cfg = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                          num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5,
                          max_position_embeddings=4096)
        self.lora = ModelLoRA(cfg, pools, dtype, torch.device("cpu"))
        self._free = {r: list(reversed(self.lora.slots_of_pool(i))) for i, (r, _) in enumerate(self.lora.pools)}
        self._mounted: dict[str, tuple[int, int]] = {}

    def pool_rank_for(self, rank: int) -> int:
        return self.lora.pool_rank_for(rank)

    def free_slots(self, rank: int) -> int:
        return len(self._free[self.pool_rank_for(rank)])

    def prepare_adapter(self, weights, *, rank, alpha, target_modules=None, pin_memory=False):
        return self.lora.build_image(weights, rank, alpha, target_modules, pin_memory=pin_memory)

    def mount_adapter(self, adapter_id, weights, *, rank, alpha, target_modules=None):
        pool = self.pool_rank_for(rank)
        slot = self._free[pool].pop()
        if isinstance(weights, SlotImage):
            self.lora.write_image(slot, weights)
        else:
            self.lora.set_adapter(slot, weights, rank, alpha, target_modules)
        self._mounted[adapter_id] = (slot, pool)
        return slot

    def unmount_adapter(self, adapter_id):
        slot, pool = self._mounted.pop(adapter_id)
        self.lora.reset_adapter(slot)
        self._free[pool].append(slot)

    def mounted_adapters(self):
        return list(self._mounted)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An 80 MB signed archive in a file:// store, and a cache with one rank-16 slot."""
    from archives.build import build_archive
    from archives.keys import generate_keypair, load_public_keys
    from archives.store import open_store

    root = tmp_path_factory.mktemp("bench-load")
    peft = root / "peft"
    peft.mkdir()
    shapes = module_shapes(BASE_CONFIG)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(32):
        for m in MODULES:
            block = "self_attn" if m in MODULES[:4] else "mlp"
            k, d = shapes[m]
            p = f"base_model.model.model.layers.{layer}.{block}.{m}"
            tensors[f"{p}.lora_A.weight"] = (torch.randn(RANK, k, generator=g) * 0.01).to(torch.bfloat16)
            tensors[f"{p}.lora_B.weight"] = (torch.randn(d, RANK, generator=g) * 0.01).to(torch.bfloat16)
    assert sum(t.numel() for t in tensors.values()) == VALUES
    save_file(tensors, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": MODULES, "bias": "none",
        "task_type": "CAUSAL_LM", "lora_dropout": 0.0, "fan_in_fan_out": False}))
    priv, pub = generate_keypair(root / "keys")
    store_dir = root / "store"
    store_dir.mkdir()
    lar = root / "adapter.lar"
    man = build_archive(peft, lar, private_key=priv, tenant_id="bench", base_model_hash=BASE_HASH,
                        base_config=BASE_CONFIG)
    aid = man.adapter_id
    key = f"adapters/bench/{aid}.lar"
    loop = asyncio.new_event_loop()
    store = open_store(f"file://{store_dir}")
    loop.run_until_complete(store.put_file(key, lar))
    engine = StackEngine({RANK: 1})
    cache = AdapterCache(engine, base_config=BASE_CONFIG, base_model_hash=BASE_HASH,
                         trusted_keys=load_public_keys([str(pub)]),
                         source=CatalogSource({aid: store.uri_for(key)}, store), disk_dir=root / "disk",
                         ram_bytes=1 << 30, disk_bytes=1 << 31, rank_limit=64, dtype=torch.bfloat16)
    loop.run_until_complete(cache.start())
    yield {"loop": loop, "cache": cache, "aid": aid, "tensors": tensors, "root": root,
           "weights_file": peft / "adapter_model.safetensors", "lar": store_dir / key, "pub": pub}
    loop.run_until_complete(cache.close())
    loop.close()


def _to_tier(s, tier: str) -> None:
    """Put the adapter in exactly `tier` (idle, not in a slot) before a timed load."""
    loop, cache, aid = s["loop"], s["cache"], s["aid"]

    async def go():
        if tier == "ram":
            if cache.tier_of(aid) != "gpu":
                await cache.load(aid)
            await cache._evict_slot(aid)  # out of the slot, still in RAM
        else:
            await cache.unload(aid, purge_disk=(tier == "remote"))
            if tier == "disk":
                await cache.prefetch(aid, to_ram=False)
        assert cache.tier_of(aid) == tier, cache.tier_of(aid)

    loop.run_until_complete(go())


def _acquire(s, tier: str) -> None:
    loop, cache, aid = s["loop"], s["cache"], s["aid"]

    async def go():
        assert await cache.acquire(aid) == tier
        cache.release(aid)  # on the loop, as the replica does

    loop.run_until_complete(go())


@pytest.fixture
def load_report(request):
    """benchmarks/conftest.py's report when loaded (make bench), else None (e.g. --noconftest)."""
    try:
        return request.getfixturevalue("bench_report")
    except pytest.FixtureLookupError:
        return None


def _report(report, benchmark, name: str, nbytes: int) -> None:
    if report is None:
        return
    from benchmarks.conftest import stats_of

    report.add("adapter_load", name, bytes=nbytes, **stats_of(benchmark))


def _bench_tier(benchmark, load_report, setup, tier):
    benchmark.extra_info.update({"tier": tier, "bytes": VALUES * 2})
    benchmark.pedantic(_acquire, args=(setup, tier), setup=lambda: _to_tier(setup, tier), rounds=ROUNDS,
                       iterations=1, warmup_rounds=1)
    _report(load_report, benchmark, f"{tier}->slot", VALUES * 2)


def test_ram_to_slot(benchmark, load_report, setup):
    _bench_tier(benchmark, load_report, setup, "ram")


def test_memcpy_80mb(benchmark, load_report, setup):
    src = torch.randn(VALUES).to(torch.bfloat16)
    dst = torch.empty_like(src)
    benchmark.extra_info.update({"tier": "memcpy floor", "bytes": VALUES * 2})
    benchmark.pedantic(dst.copy_, args=(src,), rounds=ROUNDS * 2, iterations=1, warmup_rounds=1)
    _report(load_report, benchmark, "memcpy", VALUES * 2)


def test_disk_to_slot(benchmark, load_report, setup):
    _bench_tier(benchmark, load_report, setup, "disk")


def test_file_read_80mb(benchmark, load_report, setup):
    path: Path = setup["weights_file"]
    buf = bytearray(path.stat().st_size)

    def read():
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)

    benchmark.extra_info.update({"tier": "file read floor", "bytes": len(buf)})
    benchmark.pedantic(read, rounds=ROUNDS * 2, iterations=1, warmup_rounds=1)
    _report(load_report, benchmark, "file read", len(buf))


def test_store_to_slot(benchmark, load_report, setup):
    _bench_tier(benchmark, load_report, setup, "remote")


def test_fetch_verify_archive(benchmark, load_report, setup):
    """The store floor: fetch the archive (a plain copy out of the local store) and verify it
    (signature, checksums, content, base hash, rank), nothing else."""
    from archives.keys import load_public_keys
    from archives.verify import verify_archive

    src: Path = setup["lar"]
    dst = setup["root"] / "fetched.lar"
    keys = load_public_keys([str(setup["pub"])])

    def fetch_verify():
        shutil.copyfile(src, dst)
        verify_archive(dst, keys, base_model_hash=BASE_HASH, max_rank=64)

    benchmark.extra_info.update({"tier": "fetch+verify floor", "bytes": src.stat().st_size})
    benchmark.pedantic(fetch_verify, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    _report(load_report, benchmark, "fetch+verify", src.stat().st_size)


def test_file_copy_archive(benchmark, load_report, setup):
    src: Path = setup["lar"]
    dst = setup["root"] / "copy.lar"
    benchmark.extra_info.update({"tier": "archive copy floor", "bytes": src.stat().st_size})
    benchmark.pedantic(shutil.copyfile, args=(src, dst), rounds=ROUNDS * 2, iterations=1, warmup_rounds=1)
    _report(load_report, benchmark, "archive copy", src.stat().st_size)


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_tpot_while_cold_adapters_load(benchmark, setup, load_report):
    """TPOT of 16 running requests (the small dev model's engine, decoding) with and without 8 cold
    80 MB adapter loads (store -> slot through the cache, in the same process, on the same cores).
    The figure is the ratio of the two p99s, both from this one run (timed once by pytest-benchmark);
    each side pools PHASES alternated phases."""
    import os
    import threading
    import time

    from handler.engine.engine import Engine
    from handler.engine.sampling import SamplingParams

    cache_dir = Path(os.environ.get("LORAFARM_CACHE_DIR", ".cache/lorafarm")) / "devmodel-small-s0"
    if not cache_dir.exists():
        pytest.skip("dev model not generated (run the test suite once)")
    eng = Engine(cache_dir, rank_pools={8: 1}, max_batch=16)
    eng.start()
    loop, cache, aid = setup["loop"], setup["cache"], setup["aid"]

    def run_phase(with_loads: bool) -> list[float]:
        stamps: dict[str, list[float]] = {f"r{i}": [] for i in range(16)}
        done = threading.Event()
        left = [16]
        lock = threading.Lock()

        def on_event(ev):
            stamps[ev.request_id].append(time.perf_counter())
            if ev.finished:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        for i in range(16):
            eng.add_request(f"r{i}", [5 + i, 9, 11, 13], SamplingParams(max_tokens=96, temperature=0.0,
                                                                         ignore_eos=True), None, on_event)
        t_start = time.perf_counter()
        window = [t_start, None]
        if with_loads:
            time.sleep(0.3)  # every request is decoding
            window[0] = time.perf_counter()
            for _ in range(8):
                _to_tier(setup, "remote")
                _acquire(setup, "remote")
            window[1] = time.perf_counter()
        done.wait(300)
        gaps = []
        for ts in stamps.values():
            for a, b in zip(ts[1:], ts[2:]):  # decode intervals (the first event is after prefill)
                if b >= window[0] and (window[1] is None or a <= window[1]):
                    gaps.append(b - a)
        return gaps

    out: dict[str, list[float]] = {"base": [], "loaded": []}

    def both():  # alternated, so a slow moment of the host does not land on one side only
        for _ in range(PHASES):
            out["base"] += run_phase(False)
            out["loaded"] += run_phase(True)

    try:
        benchmark.pedantic(both, rounds=1, iterations=1)
    finally:
        eng.stop()
    base, loaded = out["base"], out["loaded"]
    ratio = _p99(loaded) / _p99(base)
    print(f"\nTPOT p99 without loads {_p99(base) * 1e3:.1f} ms, while 8 cold loads "
          f"{_p99(loaded) * 1e3:.1f} ms: {ratio:.2f}x ({len(loaded)} intervals)")
    benchmark.extra_info.update({"tpot_p99_base_ms": _p99(base) * 1e3, "tpot_p99_loads_ms": _p99(loaded) * 1e3,
                                 "tpot_p99_ratio": ratio, "intervals": len(loaded)})
    if load_report is not None:
        load_report.note("adapter_load", "tpot_p99_ratio", round(ratio, 3))
    assert base and loaded


@pytest.mark.parametrize("path", ["download", "stream"])
def test_s3_store_to_slot(benchmark, setup, path, monkeypatch):
    """store (S3: moto's server on loopback, in this process) -> slot through the real AdapterCache,
    same 80 MB archive: `download` is the old path (the archive to a temp file, then verify + extract
    in one pass), `stream` verifies and extracts while it downloads (archives/stream.py). Compare
    the two medians of one run."""
    moto_server = pytest.importorskip("moto.server")
    import boto3

    from archives.keys import load_public_keys
    from archives.store import open_store

    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    loop = asyncio.new_event_loop()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=f"bench-{path}")
        s3 = open_store(f"s3://bench-{path}/farm", endpoint_url=endpoint)
        aid = setup["aid"]
        key = f"adapters/bench/{aid}.lar"
        loop.run_until_complete(s3.put_file(key, setup["lar"]))

        class Source(CatalogSource):  # `download`: no stream offered, the cache takes fetch()
            async def open_stream(self, adapter_id):
                return await super().open_stream(adapter_id) if path == "stream" else None

        cache = AdapterCache(StackEngine({RANK: 1}), base_config=BASE_CONFIG, base_model_hash=BASE_HASH,
                             trusted_keys=load_public_keys([str(setup["pub"])]),
                             source=Source({aid: s3.uri_for(key)}, s3),
                             disk_dir=setup["root"] / f"disk-{path}", ram_bytes=1 << 30, disk_bytes=1 << 31, rank_limit=64, dtype=torch.bfloat16)
        loop.run_until_complete(cache.start())
        s = {"loop": loop, "cache": cache, "aid": aid}
        nbytes = setup["lar"].stat().st_size
        benchmark.extra_info.update({"tier": f"s3 remote ({path})", "bytes": nbytes})
        benchmark.pedantic(_acquire, args=(s, "remote"), setup=lambda: _to_tier(s, "remote"), rounds=ROUNDS,
                           iterations=1, warmup_rounds=1)
        assert cache.streamed_loads == (ROUNDS + 1 if path == "stream" else 0)
        loop.run_until_complete(cache.close())
        loop.run_until_complete(s3.close())
    finally:
        loop.close()
        server.stop()
