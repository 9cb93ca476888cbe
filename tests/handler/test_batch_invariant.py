"""Answers independent of load: with `Engine(batch_invariant=True)` a request's logits (hence its
tokens at temperature 0) are bitwise the same alone or in a batch of 31 others on scattered slots,
with prefills of other prompts in the same steps. And the kernel / attention choice never depends
on a timing (`handler.model.lora.kernel_costs`, `handler.model.paged_attention.prefers_paged`)."""

from __future__ import annotations

import random

import pytest
import torch

from handler.model import lora as lora_mod
from handler.model import paged_attention
from handler.engine.engine import Engine
from handler.model.runner import INVARIANT_MIN_ROWS, padded_linear
from handler.engine.sampling import SamplingParams
from lorafarm.dev.adapters import random_prompts
from tests.handler.test_engine import Collector, chat_ids, drain, run_staggered
from handler.model.runner import LORA_MODULES



@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """As a replica runs (torch's default: one thread per core), not the one thread of the other
    engine tests: with two, SDPA and BLAS split a batched call's work by its shape."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


N = 32
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_linear_is_row_invariant(dtype):
    """The premise of the invariant pieces, on this machine's BLAS: a row's product over any number
    of rows (padded to INVARIANT_MIN_ROWS), at any offset, is bitwise the row's product in a big batch."""
    g = torch.Generator().manual_seed(0)
    for k, d in ((64, 192), (192, 64), (384, 1024), (1024, 384)):
        w = torch.randn(d, k, generator=g).to(dtype)
        x = torch.randn(200, k, generator=g).to(dtype)
        ref = padded_linear(x, w)
        for m in (1, 2, 3, 7, 15, 16, 17, 31, 64, 129):
            for off in (0, 5):
                y = padded_linear(x[off : off + m], w)
                assert torch.equal(y, ref[off : off + m]), (k, d, m, off)
    assert INVARIANT_MIN_ROWS >= 1


def _random_adapter(cfg, rank: int, modules, gen) -> dict[str, torch.Tensor]:
    w = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            d, k = cfg.module_shape(m)
            sec = "self_attn" if m in LORA_MODULES[:4] else "mlp"
            p = f"base_model.model.model.layers.{layer}.{sec}.{m}"
            w[p + ".lora_A.weight"] = torch.randn(rank, k, generator=gen) * 0.1
            w[p + ".lora_B.weight"] = torch.randn(d, rank, generator=gen) * 0.1
    return w


def _engine(dev_model, invariant: bool) -> tuple[Engine, list[str]]:
    e = Engine(dev_model, device="cpu", kv_cache_bytes=16 << 20, max_batch=48, rank_pools={8: 40, 16: 40},
               max_prefill_tokens=64, batch_invariant=invariant)
    g = torch.Generator().manual_seed(5)
    names = [f"r{i}" for i in range(N)]
    order = names + [f"filler{i}" for i in range(16)]
    random.Random(3).shuffle(order)  # scattered slots, as LRU leaves them
    for name in order:
        rank = 8 if len(name) % 2 else 16
        w = _random_adapter(e.config, rank, ["q_proj", "v_proj", "o_proj", "down_proj", "up_proj"], g)
        e.mount_adapter(name, w, rank=rank, alpha=2 * rank)
    for i in range(16):
        e.unmount_adapter(f"filler{i}")
    return e, names


def _logprobs(col: Collector, rid: str) -> list:
    return [(ev.token_id, ev.logprobs[0]) for ev in col.events[rid] if ev.token_id is not None]


@pytest.fixture(scope="module")
def invariant_engine(dev_model):
    return _engine(dev_model, True)


def test_invariant_mode_logits_alone_equal_logits_in_a_batch(invariant_engine):
    """32 adapters on scattered slots of two rank pools, base rows, prompts of 20 to 150 tokens
    (some cut in chunks): each row's sampled tokens and their logprobs, bitwise, alone == in a batch."""
    e, names = invariant_engine
    assert e.attention == "gather" and e.lora.kernel == "invariant"
    rng = random.Random(1)
    texts = random_prompts(seed=11, count=60)
    jobs = []
    for i in range(N + 4):
        ids = chat_ids(e.tokenizer, texts[i])
        while len(ids) < rng.choice([20, 60, 150]):
            ids = ids + chat_ids(e.tokenizer, texts[rng.randrange(60)])[1:]
        jobs.append((f"j{i}", ids, names[i] if i < N else None))
    alone = Collector()
    for rid, ids, ad in jobs:
        e.add_request(rid, ids, PARAMS, ad, alone)
        drain(e)
    order = list(jobs)
    rng.shuffle(order)
    together = run_staggered(e, order, PARAMS)
    bad = [rid for rid, _, _ in jobs if _logprobs(together, rid) != _logprobs(alone, rid)]
    assert bad == []
    assert all(len(_logprobs(alone, rid)) == 6 for rid, _, _ in jobs)


def test_kernel_choice_is_fixed_not_timed(monkeypatch):
    """No timing at start-up: the constants are the fixed table (or the stored calibration)."""
    monkeypatch.setattr(lora_mod, "_calibrate", lambda *a: pytest.fail("timed at start-up"))
    monkeypatch.setattr(lora_mod, "_COSTS", {})
    monkeypatch.delenv(lora_mod.COSTS_ENV, raising=False)
    c = lora_mod.kernel_costs(torch.device("cpu"), torch.float32)
    assert c == lora_mod.KernelCosts(*lora_mod.FIXED_COSTS[("cpu", "float32")])
    assert lora_mod.kernel_costs(torch.device("cpu"), torch.float32) is c


def test_stored_calibration_is_read(tmp_path, monkeypatch):
    f = tmp_path / "costs.json"
    assert lora_mod._main(["calibrate", str(f)]) == 0  # the explicit, offline calibration
    monkeypatch.setattr(lora_mod, "_COSTS", {})
    monkeypatch.setenv(lora_mod.COSTS_ENV, str(f))
    import json

    stored = json.loads(f.read_text())["cpu/float32"]
    assert lora_mod.kernel_costs(torch.device("cpu"), torch.float32) == lora_mod.KernelCosts(*stored)


def test_attention_rule_is_shapes_and_device_only():
    assert paged_attention.prefers_paged("cuda", 2, 32)
    assert not paged_attention.prefers_paged("cpu", 2, 32)  # the dev models: gathered on the CPU
    assert paged_attention.prefers_paged("cpu", 32, 128)  # Llama-2-7B dims


def test_auto_attention_on_the_dev_model_does_not_probe(dev_model, monkeypatch):
    """The rule says gathered for the dev model on the CPU: nothing is compiled or timed."""
    monkeypatch.setattr(paged_attention, "_probe", lambda *a, **k: pytest.fail("probed"))
    e = Engine(dev_model, device="cpu", kv_cache_bytes=4 << 20, max_batch=4, rank_pools={8: 2})
    assert e.attention == "gather"


def test_invariant_mode_staggered_arrivals_same_bits(dev_model):
    """Base requests (three prompts, repeated) arriving a few per step into a running batch, 12
    patterns: every request's tokens and logprobs equal its run alone. Before the activation was
    computed in whole-row chunks, prefill steps of over 95 tokens split it inside a row across two
    threads and one request in four differed in the last bits after its first token."""
    e = Engine(dev_model, device="cpu", kv_cache_bytes=16 << 20, max_batch=32, rank_pools={8: 4},
               batch_invariant=True)
    texts = random_prompts(seed=7, count=3)
    ids = [chat_ids(e.tokenizer, t) for t in texts]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    alone = Collector()
    for i, x in enumerate(ids):
        e.add_request(f"a{i}", x, params, None, alone)
        drain(e)
    ref = [_logprobs(alone, f"a{i}") for i in range(3)]
    bad = []
    for trial in range(12):
        rng = random.Random(trial)
        col = Collector()
        jobs = [(f"t{trial}-{j}", j % 3) for j in range(rng.randint(2, 25))]
        pending = list(jobs)
        while pending or e.has_work():
            for _ in range(rng.randint(0, 4)):
                if pending:
                    rid, k = pending.pop(0)
                    e.add_request(rid, ids[k], params, None, col)
            e.step()
        bad += [rid for rid, k in jobs if _logprobs(col, rid) != ref[k]]
    assert bad == []
