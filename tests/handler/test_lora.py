"""Batched multi-LoRA: the layer against a naive per-row reference, the runner against PEFT
merge_and_unload(), and merged mode against unmerged."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handler.model.lora import InvalidAdapterWeightsError, ModelLoRA, read_peft_adapter
from handler.model.merge import merge_adapter
from handler.model.runner import LORA_MODULES, ModelConfig, Runner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _config() -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=50, hidden_size=48, intermediate_size=80, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=12, rms_norm_eps=1e-5, max_position_embeddings=64, sliding_windows=(None,),
    )


def _random_adapter(cfg: ModelConfig, rank: int, modules, gen) -> dict[str, torch.Tensor]:
    w = {}
    for m in modules:
        d, k = cfg.module_shape(m)
        sec = "self_attn" if m in LORA_MODULES[:4] else "mlp"
        p = f"base_model.model.model.layers.0.{sec}.{m}"
        w[p + ".lora_A.weight"] = torch.randn(rank, k, generator=gen)
        w[p + ".lora_B.weight"] = torch.randn(d, rank, generator=gen)
    return w


class _Fixture:
    """A ModelLoRA with pools {4: 3, 8: 3, 16: 2}, random adapters in most slots."""

    def __init__(self, seed=0):
        self.cfg = _config()
        self.lora = ModelLoRA(self.cfg, {8: 3, 4: 3, 16: 2}, torch.float32, torch.device("cpu"))
        gen = torch.Generator().manual_seed(seed)
        self.adapters = {}  # slot -> (weights, scale)
        rng = random.Random(seed)
        for slot in range(1, self.lora.num_slots + 1):
            pool, _ = self.lora.pool_of(slot)
            pool_rank = self.lora.pools[pool][0]
            rank = rng.choice([r for r in (2, 4, 8, 16) if r <= pool_rank])
            modules = rng.choice([LORA_MODULES, LORA_MODULES[:4], LORA_MODULES[4:], ("v_proj", "down_proj")])
            w = _random_adapter(self.cfg, rank, modules, gen)
            alpha = 2.0 * rank
            self.lora.set_adapter(slot, w, rank, alpha, list(modules))
            self.adapters[slot] = (w, alpha / rank)

    def reference(self, group: str, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
        layer = self.lora.layers[0][group]
        y = torch.zeros(x.shape[0], sum(layer.d))
        for i, s in enumerate(slots):  # the naive per-row loop of the docstring
            if s == 0:
                continue
            w, scale = self.adapters[s]
            for m, name in enumerate(layer.modules):
                sec = "self_attn" if name in LORA_MODULES[:4] else "mlp"
                key = f"base_model.model.model.layers.0.{sec}.{name}"
                if key + ".lora_A.weight" not in w:
                    continue
                a, b = w[key + ".lora_A.weight"], w[key + ".lora_B.weight"]
                off = layer.offsets[m]
                y[i, off : off + layer.d[m]] += scale * (x[i] @ a.T) @ b.T
        return y

    def check(self, slots: list[int], prefill: bool, mode: str = "auto") -> None:
        batch = self.lora.prepare(slots, prefill=prefill, mode=mode)
        for group, layer in self.lora.layers[0].items():
            x = torch.randn(len(slots), layer.k)
            base = torch.randn(len(slots), sum(layer.d))
            y = base.clone()
            if batch is not None:
                layer.apply(x, y, batch)
            ref = base + self.reference(group, x, slots)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.fixture(scope="module")
def fx():
    return _Fixture()


@pytest.mark.parametrize(
    "slots",
    [
        [3] * 7,  # one adapter over the whole batch: no gather
        list(range(1, 9)),  # all distinct, in order: BGMV rows
        [0, 5, 0, 5, 2, 2, 2, 8, 0],  # mixed with base rows
        [4] * 40 + [1, 6, 7],  # a long prefill segment plus decode rows
        [0, 0, 0],  # no adapter at all
    ],
)
@pytest.mark.parametrize("mode", ["auto", "segments", "gather", "dense", "invariant"])
def test_layer_matches_naive_reference(fx, slots, mode):
    fx.check(slots, prefill=False, mode=mode)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 8), min_size=1, max_size=70), st.sampled_from(["auto", "segments", "gather", "dense", "invariant"]))
def test_layer_matches_reference_for_any_slot_assignment(fx, slots, mode):
    fx.check(slots, prefill=True, mode=mode)


def test_rank_pools_choose_smallest_fitting_pool(fx):
    assert fx.lora.pool_rank_for(3) == 4
    assert fx.lora.pool_rank_for(8) == 8
    assert fx.lora.pool_rank_for(9) == 16
    with pytest.raises(ValueError):
        fx.lora.pool_rank_for(17)
    # stacks are padded to each pool's rank only
    qkv = fx.lora.layers[0]["qkv"]
    assert [a.shape[1] for a in qkv.A] == [3 * 4, 3 * 8, 3 * 16]
    assert [b[0].shape[1] for b in qkv.B] == [4, 8, 16]


def test_kernel_choice(fx, monkeypatch):
    """One adapter: no gather; forced kernels; runs of consecutive slots read the stacks as one view;
    "auto" follows the device's measured costs (here replaced by fixed ones)."""
    from handler.model import lora as lora_mod

    assert [p.mode for p in fx.lora.prepare([3] * 9).pools] == ["whole"]
    assert [p.mode for p in fx.lora.prepare([4, 6, 4, 6], mode="dense").pools] == ["dense"]
    (pb,) = fx.lora.prepare([4, 6, 4, 6], mode="segments").pools
    assert pb.mode == "gather" and pb.seg_slots is None and len(pb.runs) == 2  # in place, no copy
    (pb,) = fx.lora.prepare([4, 6, 4, 6], mode="gather").pools
    assert pb.mode == "gather" and pb.seg_slots is not None
    (pb,) = fx.lora.prepare([4, 5, 6, 4], mode="segments").pools
    assert pb.mode == "gather" and pb.contiguous
    (pb,) = fx.lora.prepare([4, 5, 6], mode="segments").pools
    assert pb.mode == "rows" and pb.contiguous
    (pb,) = fx.lora.prepare([6, 4, 5], mode="segments").pools  # local slots 3, 1, 2
    assert pb.mode == "rows" and not pb.contiguous and pb.runs == ((0, 1, 3, 0), (1, 3, 1, 1))
    long = fx.lora.prepare([4] * 200 + [5] * 100 + [0] * 3, mode="segments")
    assert [p.mode for p in long.pools] == ["gather"] and long.pools[0].seg_len > 1
    key = (str(fx.lora.device), fx.lora.dtype)
    # calls expensive (a launch-bound GPU): the dense kernel, fewest calls
    monkeypatch.setitem(lora_mod._COSTS, key, lora_mod.KernelCosts(1e-3, 1e9, 1e9, 1e12))
    assert [p.mode for p in fx.lora.prepare([6, 4, 6, 4]).pools] == ["dense"]
    # calls free, bytes dear: segments in place (reads each used slot once, copies nothing)
    monkeypatch.setitem(lora_mod._COSTS, key, lora_mod.KernelCosts(0.0, 1e9, 1e9, 1e12))
    (pb,) = fx.lora.prepare([6, 4, 6, 4]).pools
    assert pb.mode == "gather" and pb.seg_slots is None


def test_reset_slot_gives_zero_delta(fx):
    lora = _Fixture(seed=3).lora
    lora.reset_adapter(2)
    layer = lora.layers[0]["gate_up"]
    x = torch.randn(4, layer.k)
    y = torch.zeros(4, sum(layer.d))
    layer.apply(x, y, lora.prepare([2, 2, 2, 2]))
    layer.apply(x, y, lora.prepare([2, 2, 1, 0], mode="dense"))
    assert y[:2].abs().max() == 0
    assert y.abs().max() == 0


@pytest.mark.parametrize("mode", ["auto", "segments", "gather", "dense", "invariant"])
def test_huge_finite_adapter_reaches_no_other_row(mode):
    """An adapter with finite weights whose product overflows (inf) changes only its own rows."""
    fx = _Fixture(seed=5)
    cfg = fx.cfg
    huge = {k: v.sign() * 1e30 for k, v in _random_adapter(cfg, 8, LORA_MODULES, torch.Generator().manual_seed(9)).items()}
    fx.lora.set_adapter(5, huge, 8, 16)  # a resident adapter of the {8: 3} pool, between others
    fx.adapters[5] = (huge, 2.0)
    slots = [4, 5, 6, 0, 4, 6, 5, 0, 1, 7]
    batch = fx.lora.prepare(slots, prefill=False, mode=mode)
    others = [i for i, s in enumerate(slots) if s != 5]
    for group, layer in fx.lora.layers[0].items():
        x = torch.randn(len(slots), layer.k)
        y = torch.zeros(len(slots), sum(layer.d))
        layer.apply(x, y, batch)
        assert not torch.isfinite(y[[1, 6]]).all()  # its own rows overflow
        ref = fx.reference(group, x[others], [slots[i] for i in others])
        assert torch.isfinite(y[others]).all()
        torch.testing.assert_close(y[others], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_bad_adapter_tensors_are_rejected():
    cfg = _config()
    lora = ModelLoRA(cfg, {8: 2}, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    good = _random_adapter(cfg, 8, ["q_proj"], gen)
    with pytest.raises(InvalidAdapterWeightsError, match="do not fit"):
        lora.set_adapter(1, {k: v[:, :-1] if "lora_A" in k else v for k, v in good.items()}, 8, 16)
    with pytest.raises(InvalidAdapterWeightsError, match="unsupported adapter tensor"):
        lora.set_adapter(1, {**good, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 48)}, 8, 16)
    with pytest.raises(InvalidAdapterWeightsError, match="rank"):
        lora.set_adapter(1, good, 4, 8)
    with pytest.raises(InvalidAdapterWeightsError, match="target_modules"):
        lora.set_adapter(1, good, 8, 16, ["k_proj"])
    nan = {k: v.clone() for k, v in good.items()}
    next(iter(nan.values()))[0, 0] = float("nan")
    with pytest.raises(InvalidAdapterWeightsError, match="NaN"):
        lora.set_adapter(1, nan, 8, 16)
    half = ModelLoRA(cfg, {8: 2}, torch.float16, torch.device("cpu"))
    with pytest.raises(InvalidAdapterWeightsError, match="overflow"):
        half.set_adapter(1, {k: v * 1e4 if "lora_B" in k else v for k, v in good.items()}, 8, 16)
    assert all(t.abs().max() == 0 for t in [half.layers[0]["qkv"].A[0][1], *half.layers[0]["qkv"].B[0]])
    with pytest.raises(InvalidAdapterWeightsError, match="both"):
        lora.set_adapter(1, {k: v for k, v in good.items() if "lora_A" in k}, 8, 16)


# ------------------------------------------------------------------------------ against PEFT

# canary i: rank (8, 16, 32)[i % 3]; modules all (i < 3), attention (3..5), mlp (6..8)
PEFT_CASES = ["c0000", "c0001", "c0002", "c0004", "c0008"]


@pytest.fixture(scope="module")
def lora_runner(dev_model):
    runner = Runner(dev_model, dtype=torch.float32, device="cpu")
    runner.lora = ModelLoRA(runner.config, {8: 2, 16: 2, 32: 2}, torch.float32, runner.device)
    return runner


def _peft_merged_logits(dev_model, adapter_dir, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(dev_model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
    with torch.no_grad():
        return merged(input_ids=ids).logits.float()


def _ids(vocab, b, n, seed):
    return torch.randint(3, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", PEFT_CASES)
def test_unmerged_equals_peft_merge_and_unload(lora_runner, dev_model, canaries, canary_index, name):
    info = canary_index[name]
    ad = read_peft_adapter(canaries / info["path"])
    slot = lora_runner.lora.slots_of_pool(lora_runner.lora.pool_index_for_rank(ad.rank))[0]
    lora_runner.lora.set_adapter(slot, ad.weights, ad.rank, ad.alpha, ad.target_modules)
    ids = _ids(lora_runner.config.vocab_size, 2, 21, seed=len(name))
    ours = lora_runner.logits(ids, lora_slots=[slot, slot])
    ref = _peft_merged_logits(dev_model, canaries / info["path"], ids)
    assert rel_err(ours, ref) <= TOL
    base = lora_runner.logits(ids, lora_slots=[0, 0])
    assert rel_err(base, ref) > 10 * TOL  # the adapter really changes the output


def test_mixed_adapter_batch_equals_each_adapter_alone(lora_runner, dev_model, canaries, canary_index):
    names = ["c0003", "c0007", "c0002"]  # r8 attention, r16 mlp, r32 all: three pools
    slots = []
    for n in names:
        ad = read_peft_adapter(canaries / n)
        slot = lora_runner.lora.slots_of_pool(lora_runner.lora.pool_index_for_rank(ad.rank))[1]
        lora_runner.lora.set_adapter(slot, ad.weights, ad.rank, ad.alpha, ad.target_modules)
        slots.append(slot)
    ids = _ids(lora_runner.config.vocab_size, 4, 15, seed=7)
    mixed = lora_runner.logits(ids, lora_slots=slots + [0])
    for i, (n, s) in enumerate(zip(names, slots)):
        alone = lora_runner.logits(ids[i : i + 1], lora_slots=[s])
        assert rel_err(mixed[i : i + 1], alone) <= TOL
        assert rel_err(mixed[i : i + 1], _peft_merged_logits(dev_model, canaries / n, ids[i : i + 1])) <= TOL
    assert rel_err(mixed[3:], lora_runner.logits(ids[3:], lora_slots=[0])) <= TOL


@pytest.mark.parametrize("name", ["c0001", "c0005"])
def test_merged_equals_unmerged(lora_runner, dev_model, canaries, name):
    ad = read_peft_adapter(canaries / name)
    slot = lora_runner.lora.slots_of_pool(lora_runner.lora.pool_index_for_rank(ad.rank))[0]
    lora_runner.lora.set_adapter(slot, ad.weights, ad.rank, ad.alpha, ad.target_modules)
    ids = _ids(lora_runner.config.vocab_size, 2, 18, seed=3)
    unmerged = lora_runner.logits(ids, lora_slots=[slot, slot])
    merged_runner = Runner(dev_model, dtype=torch.float32, device="cpu")
    assert merge_adapter(merged_runner, ad.weights, ad.rank, ad.alpha, ad.target_modules) > 0
    assert merged_runner.lora is None
    assert rel_err(merged_runner.logits(ids), unmerged) <= TOL


def test_invariant_kernel_row_is_bitwise_the_same_in_any_batch(fx):
    """The "invariant" kernel: a row's delta is bitwise equal whatever rows and slots surround it."""
    g = torch.Generator().manual_seed(4)
    for group, layer in fx.lora.layers[0].items():
        x = torch.randn(12, layer.k, generator=g)
        slots = [4, 5, 6, 0, 4, 6, 5, 0, 1, 7, 2, 8]
        full = torch.zeros(12, sum(layer.d))
        layer.apply(x, full, fx.lora.prepare(slots, prefill=False, mode="invariant"))
        for i in range(12):
            for rows in ([i], [i, (i + 3) % 12], list(range(i + 1))):
                y = torch.zeros(len(rows), sum(layer.d))
                layer.apply(x[rows], y, fx.lora.prepare([slots[r] for r in rows], prefill=False, mode="invariant")
                            or _none())
                assert torch.equal(y[rows.index(i)], full[i]), (group, i, rows)


def _none():
    from handler.model.lora import LoRABatch

    return LoRABatch([])
