"""The runner against transformers: same logits (relative error <= 1e-4) on Llama, Mistral- and
Qwen2-style configs, sharded checkpoints and RoPE scaling."""

from __future__ import annotations

import pytest
import torch

from handler.model.runner import ModelLoadError, Runner, checkpoint_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _random_ids(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def _save_tiny(tmp_path, config, seed=0, **save_kwargs):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger than default init so differences would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.08))
    model.save_pretrained(tmp_path, safe_serialization=True, **save_kwargs)
    return tmp_path


def test_llama_dev_model_matches_transformers(dev_model):
    runner = Runner(dev_model, dtype=torch.float32, device="cpu")
    ids = _random_ids(runner.config.vocab_size, 3, 37)
    ours = runner.logits(ids)
    ref = hf_logits(dev_model, ids)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) <= TOL


def test_mistral_style_with_sliding_window(tmp_path):
    from transformers import MistralConfig

    cfg = MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, sliding_window=8, rope_theta=1e6,
        tie_word_embeddings=False,
    )
    d = _save_tiny(tmp_path, cfg)
    runner = Runner(d, device="cpu")
    assert runner.config.sliding_windows == (8, 8)
    ids = _random_ids(300, 2, 30)  # longer than the window: the window matters
    assert rel_err(runner.logits(ids), hf_logits(d, ids)) <= TOL


def test_qwen2_style_bias_and_tied_embeddings(tmp_path):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e6, tie_word_embeddings=True,
    )
    d = _save_tiny(tmp_path, cfg)
    runner = Runner(d, device="cpu")
    assert runner.config.qkv_bias and not runner.config.o_bias
    assert runner.lm_head is runner.embed
    ids = _random_ids(300, 2, 25)
    assert rel_err(runner.logits(ids), hf_logits(d, ids)) <= TOL


def test_sharded_checkpoint_with_llama3_rope_scaling(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    d = _save_tiny(tmp_path, cfg, max_shard_size="100KB")
    assert (d / "model.safetensors.index.json").exists() and len(checkpoint_files(d)) > 1
    runner = Runner(d, device="cpu")
    ids = _random_ids(300, 1, 90)
    assert rel_err(runner.logits(ids), hf_logits(d, ids)) <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_float32(dev_model, dtype):
    ids = _random_ids(400, 1, 20)
    f32 = Runner(dev_model, dtype=torch.float32, device="cpu").logits(ids)
    half = Runner(dev_model, dtype=dtype, device="cpu").logits(ids)
    assert half.dtype == torch.float32  # logits come back in float32
    assert rel_err(half, f32) < 0.05


def test_missing_tensor_and_bad_shard_name(tmp_path, dev_model):
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(dev_model, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError):
        Runner(d, device="cpu")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../evil.safetensors"}}))
    with pytest.raises(ModelLoadError, match="outside"):
        checkpoint_files(d)


def _paged_logits(runner, rows: list[list[int]], prompt_lens: list[int], chunk: int,
                  attention: str = "gather") -> list[torch.Tensor]:
    """Every token's logits through the paged path: prompts prefilled in chunks of `chunk` (the
    later chunks read the cache), in the same steps as other rows' one-token decode rows (bucketed
    and gathered, or all read in place by the paged kernel)."""
    from handler.model.kvcache import KVCache
    from handler.model.runner import build_step_batch
    from handler.model.paged_attention import DecodeTables

    bs = 4
    kv = KVCache.for_blocks(runner.config, 16 * len(rows), bs, runner.dtype, runner.device)
    tables_buf = DecodeTables(kv, len(rows)) if attention == "paged" else None
    tables = [list(range(16 * i, 16 * (i + 1)))[::-1] for i in range(len(rows))]  # scattered blocks
    done = [0] * len(rows)
    out: list[list[torch.Tensor]] = [[] for _ in rows]
    while any(d < len(r) for d, r in zip(done, rows)):
        pre = [i for i, r in enumerate(rows) if done[i] < prompt_lens[i]]
        dec = [i for i, r in enumerate(rows) if prompt_lens[i] <= done[i] < len(r)]
        seqs, take = [], []
        for i in pre:
            n = min(chunk, prompt_lens[i] - done[i])
            seqs.append((rows[i][done[i] : done[i] + n], done[i], tables[i]))
            take.append((i, n))
        for i in dec:
            seqs.append(([rows[i][done[i]]], done[i], tables[i]))
            take.append((i, 1))
        batch = build_step_batch(seqs, bs, runner.device, runner.windows, decode_from=len(pre), all_logits=True,
                                 pad_block=kv.null_block, decode_tables=tables_buf)
        assert any(g.kind == "paged" for g in batch.groups) == (attention == "paged" and bool(dec))
        logits = runner.forward(batch, kv)
        off = 0
        for i, n in take:
            out[i].append(logits[off : off + n])
            off += n
            done[i] += n
    return [torch.cat(x) for x in out]


@pytest.mark.parametrize("attention", ["gather", "paged"])
@pytest.mark.parametrize("window", [None, 8])
def test_paged_chunked_prefill_and_mixed_length_decode_equal_full_forward(tmp_path, window, attention, request):
    """Chunked prefill reading the cache, decode rows of very different lengths (bucketed and
    gathered, or read in place), sliding window: every logit equals the full-sequence forward and
    transformers."""
    from transformers import MistralConfig

    cfg = MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=window, rope_theta=1e6,
    )
    if attention == "paged":
        request.getfixturevalue("paged_kernel")
    d = _save_tiny(tmp_path, cfg, seed=2)
    runner = Runner(d, device="cpu")
    lengths, prompt_lens = [50, 9, 21, 3, 5], [12, 9, 5, 3, 5]
    rows = [_random_ids(300, 1, n, seed=n)[0].tolist() for n in lengths]
    paged = _paged_logits(runner, rows, prompt_lens, chunk=5, attention=attention)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for r, got in zip(rows, paged):
        ids = torch.tensor([r])
        assert rel_err(got, runner.logits(ids)[0]) <= TOL
        with torch.no_grad():
            assert rel_err(got, hf(input_ids=ids).logits[0].float()) <= TOL
