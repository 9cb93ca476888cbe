"""handler/model/decode_step.py: the C decode step computes what the torch forward computes (logits and the
K/V it writes), with adapters of several ranks on scattered slots, rows of mixed lengths on scattered
blocks, biases and tied embeddings; a row's logits have the same bits alone or beside others on any
thread count; the engine uses it only where it applies, and greedy answers do not change; a library whose
ABI (constants, struct layout, LoRA groups) differs from the Python side's is refused by name."""

from __future__ import annotations

import ctypes
import logging
import random
import re
import shutil

import pytest
import torch

from handler.model import decode_step

from handler.model import small_gemm
from handler.engine import engine as engine_module
from handler.engine import executor as executor_module
from handler.engine.engine import Engine
from handler.model.lora import LORA_MODULES
from handler.model.runner import build_step_batch
from handler.engine.sampling import SamplingParams
from tests.handler.test_batch_invariant import _random_adapter

pytestmark = pytest.mark.skipif(not small_gemm.available(), reason="CPU kernels not built here (no cc or AVX2)")

def _engine(model_dir, **kw) -> tuple[Engine, list[int]]:
    """An engine with adapters in two rank pools (one rank 16 on every module, one rank 8 and one
    rank 4 on some), their slots after the first (not consecutive), and slot 0 (no adapter)."""
    e = Engine(model_dir, device="cpu", dtype=torch.float32, kv_cache_bytes=8 << 20, max_batch=16,
               rank_pools={16: 3, 8: 3}, **kw)
    g = torch.Generator().manual_seed(0)
    cfg = e.config
    e.mount_adapter("pad", _random_adapter(cfg, 8, LORA_MODULES, g), rank=8, alpha=8)  # takes the first slot of its pool
    slots = [0,
             e.mount_adapter("a16", _random_adapter(cfg, 16, LORA_MODULES, g), rank=16, alpha=32),
             e.mount_adapter("b8", _random_adapter(cfg, 8, ("q_proj", "v_proj", "down_proj"), g), rank=8, alpha=16),
             e.mount_adapter("c4", _random_adapter(cfg, 4, ("o_proj", "gate_proj"), g), rank=4, alpha=4)]
    return e, slots


def _prefilled_rows(e: Engine, slots: list[int], lengths: list[int], seed: int = 0):
    """Rows of these prompt lengths on shuffled cache blocks, prefilled by the torch path: [(next token,
    position, block table)] and each row's slot."""
    rng = random.Random(seed)
    bs, V = e.kv.block_size, e.config.vocab_size
    free = list(range(e.kv.num_blocks))
    rng.shuffle(free)
    rows, row_slots = [], []
    for i, n in enumerate(lengths):
        table = [free.pop() for _ in range(n // bs + 1)]
        ids = [rng.randrange(V) for _ in range(n)]
        s = slots[i % len(slots)]
        b = build_step_batch([(ids, 0, table)], bs, e.device, e.runner.windows, pad_block=e.kv.null_block)
        b.lora = e.lora.prepare([s] * n) if s else None
        e.runner.forward(b, e.kv)
        rows.append((rng.randrange(V), n, table))
        row_slots.append(s)
    return rows, row_slots


def _torch_step(e: Engine, rows, row_slots) -> torch.Tensor:
    seqs = [([t], p, table) for t, p, table in rows]
    b = build_step_batch(seqs, e.kv.block_size, e.device, e.runner.windows, decode_from=0, pad_block=e.kv.null_block)
    b.lora = e.lora.prepare(row_slots, prefill=False)
    return e.runner.forward(b, e.kv)


def _qwen2_model(tmp_path):
    from transformers import Qwen2Config

    from tests.handler.test_model import _save_tiny

    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e6,
                      tie_word_embeddings=True)
    return _save_tiny(tmp_path, cfg)


@pytest.mark.parametrize("model", ["dev", "qwen2 (q/k/v bias, tied head)"])
def test_logits_and_kv_equal_the_torch_path(model, dev_model, tmp_path, one_torch_thread):
    e, slots = _engine(dev_model if model == "dev" else _qwen2_model(tmp_path))
    assert e.decode_step is not None
    rows, row_slots = _prefilled_rows(e, slots, [5, 40, 17, 100, 33, 1, 64, 16])
    order = sorted(range(len(rows)), key=lambda i: row_slots[i])  # as the engine orders decode rows
    rows, row_slots = [rows[i] for i in order], [row_slots[i] for i in order]
    ref = _torch_step(e, rows, row_slots).clone()
    bs = e.kv.block_size
    at = torch.tensor([table[p // bs] * bs + p % bs for _, p, table in rows])
    k_ref, v_ref = (c.view(c.shape[0], -1, *c.shape[3:])[:, at].clone() for c in (e.kv.k, e.kv.v))
    e.kv.k.view(e.kv.k.shape[0], -1, *e.kv.k.shape[3:])[:, at] = 0  # the C step must write them itself
    e.kv.v.view(e.kv.v.shape[0], -1, *e.kv.v.shape[3:])[:, at] = 0
    out = e.decode_step(rows, row_slots)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    for c, want in ((e.kv.k, k_ref), (e.kv.v, v_ref)):
        torch.testing.assert_close(c.view(c.shape[0], -1, *c.shape[3:])[:, at], want, rtol=1e-5, atol=1e-5)
    # the adapters matter here: without them the logits differ
    assert not torch.allclose(e.decode_step(rows, [0] * len(rows)), out, atol=1e-3)


@pytest.mark.parametrize("parallel_min", [0, small_gemm.PARALLEL_MIN])
def test_a_row_has_the_same_bits_alone_or_beside_others_on_any_thread_count(parallel_min, dev_model, monkeypatch):
    monkeypatch.setattr(small_gemm, "PARALLEL_MIN", parallel_min)  # 0: every product and LoRA row threaded
    e, slots = _engine(dev_model)
    # more than 8 rows: the products run in chunks of rows over tiles of the weights
    rows, row_slots = _prefilled_rows(e, slots, [3, 70, 20, 9, 33, 47, 16, 2, 5, 60, 31, 12, 8], seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([e.decode_step([r], [s]) for r, s in zip(rows, row_slots)])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in range(2, len(rows) + 1):
                assert torch.equal(e.decode_step(rows[:m], row_slots[:m]), alone[:m]), (threads, m)
            assert torch.equal(e.decode_step(rows[::-1], row_slots[::-1]), alone.flip(0))
    finally:
        torch.set_num_threads(before)


def _generate(e: Engine, adapters: list[str | None], max_tokens: int = 12) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in adapters]
    for i, a in enumerate(adapters):
        e.add_request(f"r{i}", list(range(7 + i, 7 + i + 5 + 3 * i)), SamplingParams(max_tokens=max_tokens,
                      temperature=0.0, ignore_eos=True), a, lambda ev, o=outs[i]: o.append(ev.token_id))
    while e.step():
        pass
    return outs


def test_engine_greedy_answers_do_not_change(dev_model, one_torch_thread, monkeypatch):
    adapters = [None, "a16", "b8", "c4", "a16", None]
    c_engine, _ = _engine(dev_model)
    torch_engine, _ = _engine(dev_model, decode_step=False)
    assert torch_engine.decode_step is None
    got, want = _generate(c_engine, adapters), _generate(torch_engine, adapters)
    assert got == want
    assert c_engine.stats().decode_step_c > 0 and torch_engine.stats().decode_step_c == 0
    # more rows than the C step takes: the torch path runs those steps, answers unchanged
    monkeypatch.setattr(executor_module, "DECODE_STEP_ROWS", 4)
    many = ["a16", "b8", None, "c4"] * 3
    before = c_engine.stats().decode_step_c
    assert _generate(c_engine, many, 4) == _generate(torch_engine, many, 4)
    assert c_engine.stats().decode_step_c == before  # 12 rows until the end: every step on the torch path


def test_rows_out_of_range_are_refused_before_c_reads_them(dev_model):
    e, slots = _engine(dev_model)
    rows, row_slots = _prefilled_rows(e, slots, [10, 20])
    t, p, table = rows[0]
    V, B = e.config.vocab_size, e.kv.k.shape[1]
    for bad in [(V, p, table), (-1, p, table), (t, e.runner.cos.shape[0], table), (t, p, table[:0]),
                (t, p, [B] + table[1:]), (t, 40, table)]:  # position 40 is past the row's 2 blocks
        with pytest.raises(ValueError, match="out of range"):
            e.decode_step([bad, rows[1]], row_slots)
    assert e.decode_step(rows, row_slots).shape == (2, V)


def test_where_it_does_not_apply(dev_model, monkeypatch):
    e = Engine(dev_model, device="cpu", dtype=torch.bfloat16, kv_cache_bytes=4 << 20, max_batch=4)
    assert e.decode_step is None
    assert decode_step.why_not(e.runner, e.kv, e.lora) == "not float32 on the CPU"
    with pytest.raises(ValueError, match="decode_step: not float32"):
        Engine(dev_model, device="cpu", dtype=torch.bfloat16, kv_cache_bytes=4 << 20, max_batch=4, decode_step=True)
    # an explicit attention choice, and the batch-invariant mode, keep the torch path
    assert Engine(dev_model, device="cpu", kv_cache_bytes=4 << 20, max_batch=4, attention="gather").decode_step is None
    assert Engine(dev_model, device="cpu", kv_cache_bytes=4 << 20, max_batch=4, batch_invariant=True).decode_step is None
    monkeypatch.setenv("LORAFARM_DECODE_STEP", "0")
    assert Engine(dev_model, device="cpu", kv_cache_bytes=4 << 20, max_batch=4).decode_step is None


def test_short_prefill_chunks_run_on_the_c_step(dev_model, one_torch_thread):
    """A prompt whose first blocks are in the prefix cache prefills only its tail, and a prompt of at most
    C_PREFILL_TOKENS tokens prefills whole: both through the C step (its rows at consecutive positions),
    with the greedy answer of the torch path; a longer chunk keeps the torch path."""
    c_engine, _ = _engine(dev_model, prefix_cache=True, speculate=0)
    torch_engine, _ = _engine(dev_model, decode_step=False)
    shared = list(range(40, 80))  # 40 tokens: 2 full blocks cached after the first request
    prompts = [shared, shared + [7, 9, 11, 13, 15], list(range(3, 3 + engine_module.C_PREFILL_TOKENS)),
               list(range(100, 100 + engine_module.C_PREFILL_TOKENS + 1))]

    def one(e: Engine, i: int, prompt: list[int]) -> tuple[list[int], int]:
        out: list[int] = []
        e.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), "a16",
                      lambda ev: out.append(ev.token_id))
        before = e.stats().decode_step_c
        while e.step():
            pass
        return out, e.stats().decode_step_c - before

    got = [one(c_engine, i, p) for i, p in enumerate(prompts)]
    want = [one(torch_engine, i, p)[0] for i, p in enumerate(prompts)]
    assert [tokens for tokens, _ in got] == want
    assert c_engine.stats().prefix_cache_hits == 32  # the second prompt's 2 blocks
    # the 40-token prompt on the torch path; the 13-token tail after the hit, and the short prompt, on C;
    # one token more than C takes: torch
    assert [steps for _, steps in got] == [0, 1, 1, 0]


# -- the C side's ABI, checked when the library is loaded ---------------------------------------------


def test_the_abi_of_the_real_build_matches():
    have = decode_step.library_abi(small_gemm.library())
    assert decode_step.abi_mismatch() is None
    assert have == decode_step.expected_abi()
    # every field of the struct passed by pointer is in the table, and the GROUPS order
    assert {f"Model.{name}" for name, *_ in decode_step._Model._fields_} <= set(have)
    assert [have[f"group.{g}"] for g in decode_step.GROUPS] == list(range(len(decode_step.GROUPS)))


class _ModelWithoutBlockSize(ctypes.Structure):
    _fields_ = [f for f in decode_step._Model._fields_ if f[0] != "block_size"]


@pytest.mark.parametrize("change, named", [
    (("MAX_ROWS", 32), "MAX_ROWS 64 vs 32"),
    (("_MAX_MODULES", 4), "MAX_MODULES 3 vs 4"),
    (("_Model", _ModelWithoutBlockSize), "Model.block_size 56 vs missing"),
    (("GROUPS", {"o": ("o_proj",), "qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}), "group.qkv 0 vs 1"),
    (("GROUPS", {"qkv": ("q_proj", "v_proj", "k_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}), "group.qkv.k_proj 1 vs 2"),
])
def test_an_abi_mismatch_is_named_and_the_torch_path_serves(change, named, dev_model, monkeypatch, caplog):
    """The Python side's expectation changed (as a hand edit on one side would): the mismatch names the
    item, `why_not` reports it, the engine logs it and keeps the torch path, and DecodeStep refuses it."""
    monkeypatch.setattr(decode_step, *change)
    why = decode_step.abi_mismatch()
    assert why is not None and why.startswith("C decode step ABI mismatch") and named in why, why
    caplog.set_level(logging.INFO)
    e = Engine(dev_model, device="cpu", dtype=torch.float32, kv_cache_bytes=4 << 20, max_batch=4)
    assert e.decode_step is None
    assert decode_step.why_not(e.runner, e.kv, e.lora) == why
    assert any(named in r.getMessage() and r.name == "handler.engine.executor" for r in caplog.records)
    with pytest.raises(ValueError, match="decode_step: C decode step ABI mismatch"):
        Engine(dev_model, device="cpu", dtype=torch.float32, kv_cache_bytes=4 << 20, max_batch=4, decode_step=True)
    with pytest.raises(RuntimeError, match=re.escape(named)):
        decode_step.DecodeStep(e.runner, e.kv, e.lora)
    # the torch path answers
    assert len(_generate(e, [None], 3)[0]) == 3 and e.stats().decode_step_c == 0


def test_a_library_from_other_sources_is_built_anew_and_refused(tmp_path, monkeypatch):
    """The build cache is keyed by the sources: a changed decode_step.c never reuses the library of the old
    one, and a library whose table differs (or that has none, built before it existed) is refused."""
    src = tmp_path / "csrc"
    shutil.copytree(small_gemm.CSRC, src)
    c = src / "decode_step.c"
    c.write_text(c.read_text().replace("#define MAX_ROWS 64", "#define MAX_ROWS 32", 1))
    real = small_gemm.build(tmp_path / "k")
    monkeypatch.setattr(small_gemm, "SOURCE", c)
    monkeypatch.setattr(small_gemm, "SOURCES", (src / "small_gemm.c", c))
    other = small_gemm.build(tmp_path / "k")
    assert other != real and real.exists()
    assert decode_step.abi_mismatch(ctypes.CDLL(str(other))) == (
        "C decode step ABI mismatch (decode_step.c vs decode_step.py): MAX_ROWS 32 vs 64")
    # sources from before the table: the library has no lf_decode_step_abi
    monkeypatch.setattr(small_gemm, "SOURCE", src / "small_gemm.c")
    monkeypatch.setattr(small_gemm, "SOURCES", (src / "small_gemm.c",))
    old = small_gemm.build(tmp_path / "k")
    assert decode_step.abi_mismatch(ctypes.CDLL(str(old))) == (
        "C decode step ABI mismatch: the library has no lf_decode_step_abi")
