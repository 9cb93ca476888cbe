"""Generate the dev embedding model: a seeded, random BERT encoder in the sentence-transformers layout.

    <out>/config.json, model.safetensors, tokenizer.json, tokenizer_config.json   (transformers)
    <out>/modules.json                       [Transformer, Pooling, Normalize]
    <out>/sentence_bert_config.json          {"max_seq_length": ..., "do_lower_case": false}
    <out>/1_Pooling/config.json              mean pooling over the attention mask
    <out>/config_sentence_transformers.json  marks the folder as a SentenceTransformer

Everything is built offline: the tokenizer is the dev model's byte-level BPE (`lorafarm.dev.tokenizer`)
with a `<|begin|> $A <|end|>` post-processor in the role of BERT's [CLS] ... [SEP].
sentence-transformers' own `SentenceTransformer(out)` loads the folder and is the tests' oracle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lorafarm.dev.atomic import atomic_dir
from lorafarm.dev.model import _check_out_dir
from lorafarm.dev.tokenizer import BOS, EOS, PAD, build_tokenizer
from lorafarm.errors import CliError


@dataclass(frozen=True)
class DevEncoderSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    max_seq_length: int


EMBEDDING_SIZES: dict[str, DevEncoderSize] = {
    "tiny": DevEncoderSize(64, 128, 2, 4, 512, 128),
    "small": DevEncoderSize(256, 1024, 4, 4, 512, 256),
}


def write_dev_embedding_model(out: str | Path, size: str = "tiny", seed: int = 0, force: bool = False) -> Path:
    """Write the encoder folder to `out` (whole or not at all; same size and seed, same weights)."""
    if size not in EMBEDDING_SIZES:
        raise CliError(f"unknown size {size!r} (choose from {', '.join(EMBEDDING_SIZES)})")
    out = Path(out)
    _check_out_dir(out, force)

    import torch
    from tokenizers import processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    s = EMBEDDING_SIZES[size]
    tok = build_tokenizer(s.vocab_size)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}",
        pair=f"{BOS} $A {EOS} $B:1 {EOS}:1",
        special_tokens=[(BOS, tok.token_to_id(BOS)), (EOS, tok.token_to_id(EOS))],
    )
    config = BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        max_position_embeddings=s.max_seq_length,
        pad_token_id=tok.token_to_id(PAD),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = BertModel(config)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in sorted(model.named_parameters()):
            if "LayerNorm.weight" in name:
                p.fill_(1.0)
            elif "LayerNorm.bias" in name or name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * config.initializer_range)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, cls_token=BOS, sep_token=EOS,
        model_max_length=s.max_seq_length,
    )
    dim = s.hidden_size
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        fast.save_pretrained(tmp)
        _write_json(tmp / "modules.json", [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ])
        _write_json(tmp / "sentence_bert_config.json", {"max_seq_length": s.max_seq_length, "do_lower_case": False})
        (tmp / "1_Pooling").mkdir()
        _write_json(tmp / "1_Pooling" / "config.json", {
            "word_embedding_dimension": dim, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True,
        })
        (tmp / "2_Normalize").mkdir()
        _write_json(tmp / "config_sentence_transformers.json", {
            "model_type": "SentenceTransformer", "prompts": {}, "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        })
        _write_json(tmp / "lorafarm_devmodel.json", {"kind": "embedding", "size": size, "seed": seed})
    return out


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
