"""Generate the dev model: a seeded, random-initialised Llama checkpoint in the Hugging Face layout.

Tests and the demo farm need a base model without internet access. `tiny` (a few MB, grouped-query
attention) keeps the test suite fast; `small` (tens of MB, hidden:MLP = 1:2.7 as in 7B Llamas) is
for benchmarks. The output layer is initialised much larger than the usual 0.02 std so logits are
spread by several units: canary adapters trained on it then win greedy decoding by a clear margin
instead of by rounding.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from lorafarm.dev.atomic import atomic_dir
from lorafarm.dev.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, build_tokenizer
from lorafarm.errors import CliError


@dataclass(frozen=True)
class DevModelSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int


SIZES: dict[str, DevModelSize] = {
    "tiny": DevModelSize(128, 344, 4, 4, 2, 512, 2048),
    "small": DevModelSize(384, 1024, 6, 6, 2, 512, 4096),
}

LM_HEAD_STD = 0.25  # logits std ~ sqrt(hidden) * 0.25: several units, see module docstring


def _check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise CliError(f"--out {out} exists and is not empty (use --force to replace it)")
    parent = out.parent if not out.exists() else out
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise CliError(f"--out {out} is not writable")


def write_dev_model(out: str | Path, size: str = "tiny", seed: int = 0, force: bool = False) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to `out`.

    Same size and seed give byte-identical files. The directory appears whole or not at all:
    everything is written to a sibling temp dir that is renamed into place.
    """
    if size not in SIZES:
        raise CliError(f"unknown size {size!r} (choose from {', '.join(SIZES)})")
    out = Path(out)
    _check_out_dir(out, force)

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    s = SIZES[size]
    tok = build_tokenizer(s.vocab_size)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),  # every id decodes: no padded rows for a random model to pick
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        max_position_embeddings=s.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g) * LM_HEAD_STD)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * config.initializer_range)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        fast.save_pretrained(tmp)
        (tmp / "lorafarm_devmodel.json").write_text(json.dumps({"size": size, "seed": seed}) + "\n")
    return out
