"""The tiered adapter cache on a real engine (tiny dev model), without HTTP: single-flight loads,
failure isolation, byte-bounded LRU tiers, reference counts, drain on unload, disk re-adoption."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from archives.store import S3Store
from handler.adapters.cache import (
    AdapterCache,
    AdapterLoadError,
    AdapterNotFoundError,
    CatalogSource,
    check_adapter_tensors,
    module_shapes,
)
from handler.serving.metrics import RateWindow, ReplicaMetrics
from tests.handler.conftest_service import service_archives  # noqa: F401 - fixture
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def engine(dev_model):
    from handler.engine.engine import Engine

    eng = Engine(dev_model, rank_pools={16: 2}, kv_cache_bytes=4 * 1024 * 1024, max_batch=8)
    eng.start()
    yield eng
    eng.stop()


class CountingSource(CatalogSource):
    def __init__(self, catalog, store, delay: float = 0.0):
        super().__init__(catalog, store)
        self.fetches: list[str] = []
        self.delay = delay

    async def fetch(self, adapter_id, dest):
        self.fetches.append(adapter_id)
        if self.delay:
            await asyncio.sleep(self.delay)
        return await super().fetch(adapter_id, dest)


async def make_cache(engine, arch, tmp_path, *, delay=0.0, **kw):
    from archives.basehash import base_model_hash, read_base_config
    from archives.keys import load_public_keys
    from archives.store import open_store

    catalog = json.loads(arch.catalog.read_text())
    source = CountingSource(catalog, open_store(arch.store_url), delay=delay)
    cache = AdapterCache(engine, base_config=read_base_config(engine.model_dir),
                         base_model_hash=base_model_hash(engine.model_dir),
                         trusted_keys=load_public_keys([str(arch.public_key)]), source=source,
                         disk_dir=tmp_path, rank_limit=kw.pop("rank_limit", 16), metrics=ReplicaMetrics(), **kw)
    await cache.start()
    return cache, source


async def unmount_all(engine, cache):
    for aid in list(cache.gpu_adapters()):
        await cache.unload(aid)


async def test_single_flight_and_refcounts(engine, service_archives, tmp_path):
    arch = service_archives
    cache, source = await make_cache(engine, arch, tmp_path, delay=0.05)
    try:
        a = arch.good["c0000"]
        tiers = await asyncio.gather(*(cache.acquire(a) for _ in range(6)))
        assert tiers == ["remote"] * 6
        assert source.fetches == [a]  # one download for six concurrent requests
        assert cache.counters.loads == {"ram": 0, "disk": 0, "remote": 1}
        assert cache.refcount(a) == 6 and cache.counters.slot_misses == 6
        assert await cache.acquire(a) == "gpu"
        for _ in range(7):
            cache.release(a)
        assert cache.refcount(a) == 0
        assert cache.tier_of(a) == "gpu" and a in engine.mounted_adapters()
    finally:
        await unmount_all(engine, cache)
        await cache.close()


async def test_failed_load_fails_only_its_adapter(engine, service_archives, tmp_path):
    arch = service_archives
    cache, _ = await make_cache(engine, arch, tmp_path)
    try:
        good = arch.good["c0001"]
        results = await asyncio.gather(cache.acquire(arch.bad_signature), cache.acquire(arch.bad_signature),
                                       cache.acquire(good), return_exceptions=True)
        assert isinstance(results[0], AdapterLoadError) and results[0].code == "bad_signature"
        assert isinstance(results[1], AdapterLoadError) and results[1].code == "bad_signature"
        assert results[2] == "remote" and cache.refcount(good) == 1
        cache.release(good)
        with pytest.raises(AdapterNotFoundError):
            await cache.acquire("ad-ffffffffffffffffffff")
        with pytest.raises(AdapterNotFoundError):
            await cache.acquire("../etc")
        assert arch.bad_signature not in engine.mounted_adapters()
        assert not any(p.name != good for p in (tmp_path / "adapters").iterdir())
    finally:
        await unmount_all(engine, cache)
        await cache.close()


async def test_lru_never_evicts_in_use_and_waits_for_a_slot(engine, service_archives, tmp_path):
    arch = service_archives
    cache, _ = await make_cache(engine, arch, tmp_path)
    try:
        a, b, c = arch.good["c0000"], arch.good["c0001"], arch.good["c0003"]
        await cache.acquire(a)
        await cache.acquire(b)  # both slots of the rank-16 pool taken, both in use
        waiter = asyncio.create_task(cache.acquire(c))
        await wait_until(lambda: cache.counters.slot_waits == 1, 30, what="c waiting for a slot")
        assert not waiter.done() and cache.counters.slot_waits == 1
        assert set(cache.gpu_adapters()) == {a, b}
        cache.release(b)  # b idle -> evicted for c, a untouched
        assert await asyncio.wait_for(waiter, 5) == "remote"
        assert set(cache.gpu_adapters()) == {a, c} and cache.refcount(a) == 1
        assert cache.counters.evictions == 1 and cache.counters.evictions_in_use == 0
        assert [e[1:] for e in cache.counters.eviction_log] == [(b, 0)]
        assert cache.tier_of(b) == "ram"  # evicted from the slot, still in RAM
        cache.release(a)
        cache.release(c)
        # LRU among idle: touching a makes c the victim
        await cache.acquire(a)
        cache.release(a)
        assert await cache.acquire(b) == "ram"
        cache.release(b)
        assert set(cache.gpu_adapters()) == {a, b}
        assert cache.metrics.evictions_per_min() == 2
    finally:
        await unmount_all(engine, cache)
        await cache.close()


async def test_unload_drains_first(engine, service_archives, tmp_path):
    arch = service_archives
    cache, _ = await make_cache(engine, arch, tmp_path)
    try:
        a = arch.good["c0004"]
        await cache.acquire(a)
        unload = asyncio.create_task(cache.unload(a))
        await asyncio.sleep(0.2)  # time passing is the subject: no unload while `a` is in use
        assert not unload.done() and cache.tier_of(a) == "gpu"
        again = asyncio.create_task(cache.acquire(a))  # new requests wait for the drain
        await asyncio.sleep(0.1)  # likewise: the new acquire does not go through during the drain
        assert not again.done()
        cache.release(a)
        out = await asyncio.wait_for(unload, 5)
        assert out["removed"] == ["gpu", "ram"]
        assert await asyncio.wait_for(again, 5) == "gpu" or cache.tier_of(a) == "gpu"
        cache.release(a)
    finally:
        await unmount_all(engine, cache)
        await cache.close()


async def test_ram_and_disk_tiers_are_byte_bounded(engine, service_archives, tmp_path):
    arch = service_archives
    ids = [arch.good[n] for n in ("c0000", "c0003", "c0006")]  # rank 8, ~120-300 kB each
    sizer, _ = await make_cache(engine, arch, tmp_path / "sizes")
    for aid in ids:
        await sizer.prefetch(aid)
    ram = {a: sizer.policy.nbytes("ram", a) for a in ids}  # slot images, padded to the pool rank
    disk = {a: sizer.policy.nbytes("disk", a) for a in ids}
    await sizer.close()
    ram_bytes = ram[ids[1]] + ram[ids[2]] - 1  # the last two never fit together
    # the first one has to go (slack: a folder's verification stamp holds a timestamp, +-1 byte)
    disk_bytes = disk[ids[1]] + disk[ids[2]] + 64
    cache, _ = await make_cache(engine, arch, tmp_path, ram_bytes=ram_bytes, disk_bytes=disk_bytes)
    try:
        for aid in ids:
            await cache.prefetch(aid)
        assert cache._ram_used <= ram_bytes and cache._disk_used <= disk_bytes
        assert cache.ram_adapters()[-1] == ids[-1]  # most recent kept
        assert cache.counters.ram_evictions >= 1
        assert cache.counters.disk_evictions >= 1
        assert ids[0] not in cache.disk_adapters() and not (tmp_path / "adapters" / ids[0]).exists()
        assert cache.tier_of(ids[0]) == "remote"
    finally:
        await cache.close()


async def test_disk_tier_is_readopted_after_restart_unless_tampered(engine, service_archives, tmp_path):
    arch = service_archives
    a, b = arch.good["c0007"], arch.good["c0009"]
    cache, _ = await make_cache(engine, arch, tmp_path)
    await cache.prefetch(a, to_ram=False)
    await cache.prefetch(b, to_ram=False)
    await cache.close()
    # tamper with b's weights (same size); plant a folder that was never verified
    w = tmp_path / "adapters" / b / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:-4] + b"\0\0\0\0")
    shutil.copytree(tmp_path / "adapters" / a, tmp_path / "adapters" / "ad-00000000000000000001")
    cache2, source2 = await make_cache(engine, arch, tmp_path)
    try:
        assert sorted(cache2.disk_adapters()) == sorted([a, b])  # stamps and sizes hold
        assert not (tmp_path / "adapters" / "ad-00000000000000000001").exists()  # stamp names another id
        assert await cache2.acquire(a) == "disk" and source2.fetches == []  # checksums re-checked, fine
        # b's checksum no longer matches: dropped and fetched again from the store, then served
        assert await cache2.acquire(b) == "disk" and source2.fetches == [b]
        assert cache2.refcount(b) == 1
        cache2.release(a)
        cache2.release(b)
    finally:
        await unmount_all(engine, cache2)
        await cache2.close()


async def test_disk_budget_is_capped_at_half_the_free_space(engine, service_archives, tmp_path, monkeypatch):
    """A disk tier whose budget is more than the filesystem has never fills the disk: at start it
    takes at most half of what it holds plus the free space, and trims its oldest to fit."""
    import handler.adapters.cache as cache_mod

    arch = service_archives
    ids = [arch.good[n] for n in ("c0000", "c0003", "c0006")]
    cache, _ = await make_cache(engine, arch, tmp_path)  # a real filesystem: plenty of room
    for aid in ids:
        await cache.prefetch(aid, to_ram=False)
    assert sorted(cache.disk_adapters()) == sorted(ids)
    await cache.close()
    # the same folder on a full disk (200 bytes free): the default 32 GiB budget becomes half of what is held
    monkeypatch.setattr(cache_mod, "free_bytes", lambda path: 200)
    cache2, _ = await make_cache(engine, arch, tmp_path)
    try:
        kept = cache2.disk_adapters()
        assert cache2.disk_bytes < 32 * 1024**3 and cache2._disk_used <= cache2.disk_bytes
        assert 0 < len(kept) < len(ids) and kept[-1] == ids[-1]  # the newest kept, the oldest removed
        gone = [a for a in ids if a not in kept]
        assert not any((tmp_path / "adapters" / a).exists() for a in gone)
        assert cache2.counters.disk_evictions == len(gone)
    finally:
        await cache2.close()


def test_tensor_checks(dev_model):
    from archives.basehash import read_base_config

    cfg = read_base_config(dev_model)
    shapes = module_shapes(cfg)
    k, d = shapes["q_proj"]
    ok = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, k),
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(d, 8)}
    check_adapter_tensors("x", ok, rank=8, target_modules=["q_proj"], config=cfg)
    bad_cases = [
        ({**ok, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(d + 1, 8)}, "shape"),
        ({k_: v for k_, v in ok.items() if "lora_B" not in k_}, "both"),
        ({**ok, "base_model.model.lm_head.weight": torch.zeros(2, 2)}, "unexpected"),
        ({n.replace("layers.0", "layers.99"): v for n, v in ok.items()}, "layer 99"),
    ]
    for weights, words in bad_cases:
        with pytest.raises(AdapterLoadError) as e:
            check_adapter_tensors("x", weights, rank=8, target_modules=["q_proj"], config=cfg)
        assert e.value.code == "invalid_adapter" and words in str(e.value)
    with pytest.raises(AdapterLoadError):
        check_adapter_tensors("x", ok, rank=8, target_modules=["v_proj"], config=cfg)


def test_rate_window():
    now = [0.0]
    w = RateWindow(60.0, clock=lambda: now[0])
    w.add(3)
    now[0] = 30.0
    w.add()
    assert w.per_minute() == 4
    now[0] = 61.0
    assert w.per_minute() == 1 and w.total == 4


class RecordingS3Store(S3Store):
    """The real S3Store, recording which download path the cache took."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.files: list[str] = []  # get_file: the archive written to a temp file
        self.streams: list[str] = []  # open_stream: verified and extracted as it downloads

    async def get_file(self, key, path):
        self.files.append(key)
        return await super().get_file(key, path)

    def open_stream(self, key):
        self.streams.append(key)
        return super().open_stream(key)


async def _s3_cache(engine, arch, tmp_path, s3_endpoint, s3_bucket, objects: dict[str, bytes]):
    """A cache whose catalog points into an S3 bucket (moto) holding `objects` {adapter_id: archive}."""
    from archives.basehash import base_model_hash, read_base_config
    from archives.keys import load_public_keys

    s3 = RecordingS3Store(s3_bucket, "farm", endpoint_url=s3_endpoint)
    catalog = {}
    for aid, data in objects.items():
        await s3.put_bytes(f"adapters/acme/{aid}.lar", data)
        catalog[aid] = s3.uri_for(f"adapters/acme/{aid}.lar")
    catalog["ad-00000000000000000bad"] = f"s3://other-bucket/farm/adapters/acme/{aid}.lar"
    cache = AdapterCache(engine, base_config=read_base_config(engine.model_dir),
                         base_model_hash=base_model_hash(engine.model_dir),
                         trusted_keys=load_public_keys([str(arch.public_key)]), source=CatalogSource(catalog, s3),
                         disk_dir=tmp_path, rank_limit=16, metrics=ReplicaMetrics())
    await cache.start()
    return cache, s3


def _archive_bytes(arch, aid) -> bytes:
    return open(json.loads(arch.catalog.read_text())[aid].removeprefix("file://"), "rb").read()


async def test_remote_tier_from_s3_streams_store_to_disk(engine, service_archives, tmp_path, s3_endpoint,
                                                         s3_bucket):
    """The object store may be S3 (moto here): the weights_uri must lie inside the configured bucket;
    the archive is verified and extracted while it downloads (no archive file is ever written), the
    extracted files are the archive's own bytes, and the adapter serves."""
    import io
    import tarfile

    arch = service_archives
    aid = arch.good["c0010"]
    data = _archive_bytes(arch, aid)
    cache, s3 = await _s3_cache(engine, arch, tmp_path, s3_endpoint, s3_bucket, {aid: data})
    try:
        assert await cache.acquire(aid) == "remote"
        try:
            assert s3.streams == [f"adapters/acme/{aid}.lar"] and s3.files == [] and cache.streamed_loads == 1
            assert cache.metrics.bytes_moved.labels(tier="remote")._value.get() == len(data)
            assert list(cache.tmp_dir.iterdir()) == []
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                for m in tar.getmembers():
                    assert (tmp_path / "adapters" / aid / m.name).read_bytes() == tar.extractfile(m).read()
            done, toks = _generate(engine, aid, "s3-streamed", list(range(5, 17)), 8)
            assert await asyncio.to_thread(done.wait, 60) and toks[-1] == "length" and len(toks) == 9
        finally:
            cache.release(aid)
        with pytest.raises(AdapterLoadError) as e:
            await cache.acquire("ad-00000000000000000bad")
        assert e.value.code == "store_error" and "outside the configured object store" in str(e.value)
    finally:
        await unmount_all(engine, cache)
        await cache.close()


async def test_tampered_archive_in_s3_is_refused_while_it_streams(engine, service_archives, tmp_path,
                                                                  s3_endpoint, s3_bucket):
    """A weight byte flipped in the S3 object (signature still valid): refused as a checksum mismatch
    during the download; nothing stays on disk (no archive file, no extracted folder, no temp
    files) and nothing reaches a slot."""
    import tarfile

    arch = service_archives
    victim = arch.good["c0004"]
    data = bytearray(_archive_bytes(arch, victim))
    with tarfile.open(json.loads(arch.catalog.read_text())[victim].removeprefix("file://")) as tar:
        m = tar.getmember("adapter_model.safetensors")
    data[m.offset_data + m.size - 3] ^= 0xFF
    mounted_before = set(engine.mounted_adapters())
    cache, s3 = await _s3_cache(engine, arch, tmp_path, s3_endpoint, s3_bucket, {victim: bytes(data)})
    try:
        with pytest.raises(AdapterLoadError) as e:
            await cache.acquire(victim)
        assert e.value.code == "checksum_mismatch" and "sha256" in str(e.value)
        assert s3.streams == [f"adapters/acme/{victim}.lar"] and s3.files == []
        assert set(engine.mounted_adapters()) == mounted_before and cache.tier_of(victim) == "remote"
        assert list(cache.tmp_dir.iterdir()) == [] and list((tmp_path / "adapters").iterdir()) == []
        assert cache.streamed_loads == 0 and cache.counters.load_errors == 1
    finally:
        await unmount_all(engine, cache)
        await cache.close()


async def test_registry_source_streams_only_from_a_remote_store(service_archives, s3_endpoint, s3_bucket):
    """RegistrySource.open_stream: the weights_uri the registry names, streamed from S3; None from a
    local folder (read in place) or without a store (the registry's own download)."""
    from archives.store import open_store
    from handler.adapters.sources import RegistrySource

    class Registry:  # the registry client's get_adapter, answering for one adapter
        def __init__(self, uri):
            self.uri = uri

        async def get_adapter(self, adapter_id):
            return {"adapter_id": adapter_id, "weights_uri": self.uri, "status": "active"}

    arch = service_archives
    aid = arch.good["c0010"]
    data = _archive_bytes(arch, aid)
    s3 = open_store(f"s3://{s3_bucket}/farm", endpoint_url=s3_endpoint)
    local = open_store(arch.store_url)
    try:
        await s3.put_bytes("adapters/acme/a.lar", data)
        chunks = await RegistrySource(Registry(s3.uri_for("adapters/acme/a.lar")), s3).open_stream(aid)
        assert b"".join([c async for c in chunks]) == data
        in_place = json.loads(arch.catalog.read_text())[aid]
        assert await RegistrySource(Registry(in_place), local).open_stream(aid) is None
        assert await RegistrySource(Registry(in_place), None).open_stream(aid) is None
    finally:
        await s3.close()


# ------------------------------------------------------------------------------ the cold path


async def test_tampered_archive_is_refused_before_a_byte_reaches_a_slot(engine, service_archives, tmp_path):
    """Weights flipped inside a signed archive in the store (signature still valid): refused as a
    checksum mismatch while being verified; nothing lands on disk or in a slot; only its own
    requests fail, a good adapter loading at the same time is served."""
    import tarfile

    import dataclasses
    import tarfile

    arch = service_archives
    good, victim = arch.good["c0001"], arch.good["c0004"]
    catalog = json.loads(arch.catalog.read_text())
    src = catalog[victim].removeprefix("file://")
    data = bytearray(open(src, "rb").read())
    with tarfile.open(src) as tar:
        m = tar.getmember("adapter_model.safetensors")
    data[m.offset_data + m.size - 3] ^= 0xFF  # a weight byte; the signed manifest is untouched
    tampered = arch.store_dir / "adapters" / "tampered" / f"{victim}-{tmp_path.name}.lar"
    tampered.parent.mkdir(parents=True, exist_ok=True)
    tampered.write_bytes(bytes(data))
    catalog[victim] = f"file://{tampered}"
    (tmp_path / "catalog.json").write_text(json.dumps(catalog))
    bad_arch = dataclasses.replace(arch, catalog=tmp_path / "catalog.json")
    mounted_before = set(engine.mounted_adapters())
    cache, _ = await make_cache(engine, bad_arch, tmp_path / "cache")
    results = await asyncio.gather(cache.acquire(victim), cache.acquire(victim), cache.acquire(good),
                                   return_exceptions=True)
    try:
        assert all(isinstance(r, AdapterLoadError) and r.code == "checksum_mismatch" for r in results[:2]), results
        assert set(engine.mounted_adapters()) - mounted_before == {good}
        assert cache.tier_of(victim) == "remote" and victim not in cache.held()
        assert not (tmp_path / "cache" / "adapters" / victim).exists()
        assert cache.counters.load_errors == 1 and cache.refcount(good) == 1
        cache.release(good)
    finally:
        await unmount_all(engine, cache)
        await cache.close()


def _generate(engine, adapter_id, rid, prompt, n):
    """Submit a greedy request; returns (done event, tokens list)."""
    import threading

    from handler.engine.sampling import SamplingParams

    done, toks = threading.Event(), []

    def on_event(ev):
        if ev.token_id is not None:
            toks.append(ev.token_id)
        if ev.finished:
            toks.append(ev.finish_reason)
            done.set()

    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), adapter_id,
                       on_event)
    return done, toks


async def test_refcounts_hold_while_loads_run_beside_decode(engine, service_archives, tmp_path):
    """A running request keeps its slot while other adapters are loaded, evicted and reloaded into the
    pool's other slot; its greedy tokens are the ones it produces with no loads around it."""
    arch = service_archives
    a, others = arch.good["c0001"], [arch.good[n] for n in ("c0004", "c0007", "c0009")]
    cache, _ = await make_cache(engine, arch, tmp_path)
    prompt = list(range(5, 17))
    try:
        assert await cache.acquire(a) == "remote"
        done, alone = _generate(engine, a, "alone", prompt, 40)
        await asyncio.to_thread(done.wait, 60)
        done, toks = _generate(engine, a, "beside", prompt, 40)
        steps0 = engine.stats().steps
        for round_ in range(2):
            for o in others:  # each load takes the other slot (evicting the previous one, idle)
                assert await cache.acquire(o) == ("remote" if round_ == 0 else "ram")
                assert cache.refcount(a) == 1 and cache.tier_of(a) == "gpu"
                cache.release(o)
        assert await asyncio.to_thread(done.wait, 60)
        assert toks == alone and toks[-1] == "length"
        assert engine.stats().steps > steps0
        c = cache.counters
        assert c.evictions >= 5 and c.evictions_in_use == 0
        assert all(refs == 0 for _, _, refs in c.eviction_log)
        cache.release(a)
    finally:
        await unmount_all(engine, cache)
        await cache.close()


async def test_tiers_and_expected_load_times_are_reported(engine, service_archives, tmp_path):
    arch = service_archives
    a, b, c = arch.good["c0001"], arch.good["c0004"], arch.good["c0007"]
    cache, _ = await make_cache(engine, arch, tmp_path)
    try:
        await cache.load(a)
        await cache.prefetch(b)
        await cache.prefetch(c, to_ram=False)
        held = cache.held()
        assert {k: v[0] for k, v in held.items()} == {a: "gpu", b: "ram", c: "disk"}
        assert held[a][1] == 0.0 and held[b][1] > 0 and held[c][1] > 0
        assert cache.load_times.samples["remote"] == 1  # the load into the slot was measured
        # a disk read is the slot image in one read: RAM and disk copies are the same bytes
        assert cache.tier_of(c) == "disk" and await cache.acquire(c) == "disk"
        cache.release(c)
        assert cache.load_times.samples["disk"] == 1
        # a request for a prefetched adapter counts as a prefetch hit
        assert await cache.acquire(b) == "ram" and cache.prefetch_hits == 1  # b (prefetched, now asked for)
        cache.release(b)
    finally:
        await unmount_all(engine, cache)
        await cache.close()


async def test_popular_adapters_are_prefetched_back_into_ram_and_free_slots(engine, service_archives, tmp_path):
    arch = service_archives
    hot, cold = arch.good["c0001"], arch.good["c0004"]
    cache, _ = await make_cache(engine, arch, tmp_path)
    try:
        for _ in range(3):
            await cache.acquire(hot)
            cache.release(hot)
        await cache.acquire(cold)
        cache.release(cold)
        await cache._evict_slot(hot)  # pushed out of its slot and then out of RAM (as pressure would)
        cache._drop_ram(hot)
        assert cache.tier_of(hot) == "disk"
        assert cache.policy.popular(1) == [hot]
        moved = await cache.prefetch_popular(1)
        assert moved == {hot: "disk"} and cache.tier_of(hot) == "gpu"  # a slot was free
        assert await cache.acquire(hot) == "gpu" and cache.prefetch_hits == 1
        cache.release(hot)
        await cache.unload(hot)  # an explicit unload is not undone by prefetch
        assert await cache.prefetch_popular(1) == {} and cache.tier_of(hot) == "disk"
    finally:
        await unmount_all(engine, cache)
        await cache.close()


def _moved(cache, tier: str) -> float:
    return cache.metrics.bytes_moved.labels(tier=tier)._value.get()


async def test_disk_to_slot_reads_the_slot_image_straight_into_the_slot(engine, service_archives, tmp_path):
    """disk -> slot is one read of the slot image into the slot: no RAM copy is mounted from on the
    request's path, the greedy tokens equal those after a RAM mount, the RAM copy follows in the
    background, and a later eviction from the slot demotes the adapter to RAM, not to disk."""
    arch = service_archives
    a = arch.good["c0001"]
    cache, source = await make_cache(engine, arch, tmp_path)
    prompt = list(range(5, 17))
    try:
        assert await cache.acquire(a) == "remote"  # fetched, built in RAM, mounted from RAM
        done, from_ram = _generate(engine, a, "from-ram", prompt, 24)
        assert await asyncio.to_thread(done.wait, 60)
        cache.release(a)
        await cache.unload(a)  # out of the slot and RAM; the verified folder and its image stay
        await cache._image_written(a)  # the image is written off the load's path: wait for it, not for time
        assert cache.tier_of(a) == "disk" and (tmp_path / "adapters" / a / "slot-image.safetensors").exists()
        ram_before, disk_before = _moved(cache, "ram"), _moved(cache, "disk")
        assert await cache.acquire(a) == "disk"
        assert _moved(cache, "ram") == ram_before  # nothing was copied into the slot out of RAM
        assert _moved(cache, "disk") > disk_before and source.fetches == [a]
        done, from_disk = _generate(engine, a, "from-disk", prompt, 24)
        assert await asyncio.to_thread(done.wait, 60)
        assert from_disk == from_ram and from_disk[-1] == "length"
        cache.release(a)
        # the RAM copy is read off the request's path
        await wait_until(lambda: a in cache.ram_adapters(), 60, interval=0.05, what=f"{a} in host RAM")
        assert a in cache.ram_adapters()
        await cache._evict_slot(a)  # a demotion: the adapter stays in host RAM
        assert cache.tier_of(a) == "ram" and await cache.acquire(a) == "ram"
        cache.release(a)
    finally:
        await unmount_all(engine, cache)
        await cache.close()


async def test_a_truncated_slot_image_fails_only_its_load_and_the_folder_is_rebuilt(engine, service_archives, tmp_path):
    """A slot image cut short on disk: that load fails with an error (nothing half-mounted stays
    in the slot), other adapters still load, and the next request for it works again."""
    arch = service_archives
    a, b = arch.good["c0001"], arch.good["c0004"]
    cache, _ = await make_cache(engine, arch, tmp_path)
    try:
        await cache.prefetch(a, to_ram=False)
        image = tmp_path / "adapters" / a / "slot-image.safetensors"
        image.write_bytes(image.read_bytes()[:-1000])
        with pytest.raises(AdapterLoadError):
            await cache.acquire(a)
        assert a not in cache.gpu_adapters() and a not in engine.mounted_adapters()
        assert await cache.acquire(b) == "remote"
        cache.release(b)
        assert await cache.acquire(a) == "disk"  # from the verified PEFT files, image rebuilt
        cache.release(a)
        assert image.exists() and a in cache.ram_adapters()
    finally:
        await unmount_all(engine, cache)
        await cache.close()
