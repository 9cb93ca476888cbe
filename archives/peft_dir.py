"""Validate a PEFT LoRA adapter: adapter_config.json plus adapter_model.safetensors.

The same checks run on a training job's folder (`read_peft_dir`, before building an archive) and
on the members of an archive (`check_adapter_config`, `check_lora_tensors`, before a replica
trusts it), so an archive can only hold what a replica can serve:

- `peft_type` LORA with an integer `r`, a positive `lora_alpha` and an explicit list of
  `target_modules` among q/k/v/o/gate/up/down_proj; options that change the maths the replica
  implements (DoRA, rsLoRA, per-module ranks, biases, modules_to_save, fan_in_fan_out) are refused;
- weights in safetensors only: pickle files (`.bin`, `.pt`, ...) are refused, never opened;
- only LoRA A/B tensors of those modules, A `[r, in]` and B `[out, r]`, with in/out taken from
  the base config (hidden_size, intermediate_size, heads, kv heads, head_dim) when it is given.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from archives.digest import file_sha256
from archives.errors import InvalidAdapterError, InvalidBaseModelError
from archives.limits import MAX_CONFIG_BYTES, MAX_WEIGHTS_BYTES
from archives.manifest import CONFIG_NAME, WEIGHTS_NAME
from archives.safetensors_header import SafetensorsHeader, read_header

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
WEIGHT_DTYPES = ("F32", "F16", "BF16")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

_TENSOR_RE = re.compile(
    r"^base_model\.model\.(?:[A-Za-z0-9_.]+\.)?layers\.(?P<layer>\d+)\."
    r"(?P<block>self_attn|mlp)\.(?P<module>[a-z_]+)\.lora_(?P<ab>[AB])\.weight$"
)

# adapter_config.json options whose non-default value the replica cannot serve correctly.
_REFUSED_OPTIONS = {
    "use_dora": "DoRA adapters",
    "use_rslora": "rsLoRA scaling (alpha/sqrt(r))",
    "fan_in_fan_out": "fan_in_fan_out (transposed) weights",
    "lora_bias": "LoRA bias terms",
    "modules_to_save": "modules_to_save (full copies of base modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "target_parameters",
    "use_qalora": "QA-LoRA",
}


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    target_modules: list[str]


@dataclass(frozen=True)
class PeftAdapterInfo:
    """What an adapter folder holds; `content_checksum` identifies its two files' bytes."""

    rank: int
    alpha: float
    target_modules: list[str]
    content_checksum: str
    config_sha256: str = ""
    config_size: int = 0
    weights_sha256: str = ""
    weights_size: int = 0
    num_tensors: int = 0
    layers: list[int] = field(default_factory=list)


def content_checksum(config_sha256: str, weights_sha256: str) -> str:
    """`sha256:<hex>` over the two files' checksums: same files, same value (adapter id input)."""
    blob = f"{CONFIG_NAME}\0{config_sha256}\n{WEIGHTS_NAME}\0{weights_sha256}\n".encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def check_adapter_config(data: bytes) -> LoraSettings:
    """Validate adapter_config.json bytes; raise InvalidAdapterError naming the problem."""
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidAdapterError(f"{CONFIG_NAME} is not valid JSON") from None
    if not isinstance(config, dict):
        raise InvalidAdapterError(f"{CONFIG_NAME} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: peft_type is {config.get('peft_type')!r}, only 'LORA' is served"
        )
    r = config.get("r")
    if type(r) is not int or r < 1:
        raise InvalidAdapterError(f"{CONFIG_NAME}: r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha")
    if type(alpha) not in (int, float) or not alpha > 0 or alpha != alpha or alpha == float("inf"):
        raise InvalidAdapterError(f"{CONFIG_NAME}: lora_alpha must be a positive number, got {alpha!r}")
    modules = config.get("target_modules")
    if isinstance(modules, str):
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: target_modules {modules!r} is a pattern; list the module names "
            f"({', '.join(SUPPORTED_MODULES)})"
        )
    if not (isinstance(modules, list) and modules and all(isinstance(m, str) for m in modules)):
        raise InvalidAdapterError(f"{CONFIG_NAME}: target_modules must be a non-empty list of module names")
    unknown = sorted(set(modules) - set(SUPPORTED_MODULES))
    if unknown:
        raise InvalidAdapterError(
            f"{CONFIG_NAME}: target_modules {', '.join(unknown)} not supported "
            f"(supported: {', '.join(SUPPORTED_MODULES)})"
        )
    for option, what in _REFUSED_OPTIONS.items():
        if config.get(option):
            raise InvalidAdapterError(f"{CONFIG_NAME}: {what} are not supported ({option} is set)")
    if config.get("bias", "none") != "none":
        raise InvalidAdapterError(f"{CONFIG_NAME}: bias {config.get('bias')!r} not supported (only 'none')")
    return LoraSettings(rank=r, alpha=float(alpha), target_modules=sorted(set(modules)))


def module_shapes(base_config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each supported module in a Llama/Mistral/Qwen2 base."""

    def dim(name: str, default: int | None = None) -> int:
        value = base_config.get(name, default)
        if value is None:
            value = default
        if type(value) is not int or value < 1:
            raise InvalidBaseModelError(f"base config: {name} must be a positive integer, got {value!r}")
        return value

    hidden = dim("hidden_size")
    heads = dim("num_attention_heads")
    kv_heads = dim("num_key_value_heads", heads)
    head_dim = dim("head_dim", hidden // heads if hidden % heads == 0 else None)
    mlp = dim("intermediate_size")
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, mlp),
        "up_proj": (hidden, mlp),
        "down_proj": (mlp, hidden),
    }


def check_lora_tensors(
    header: SafetensorsHeader, settings: LoraSettings, base_config: dict | None = None
) -> list[int]:
    """Check tensor names, dtypes and shapes against the rank, target modules and (optionally)
    the base config; return the adapted layer indices. Raises InvalidAdapterError."""
    shapes = module_shapes(base_config) if base_config is not None else None
    num_layers = base_config.get("num_hidden_layers") if base_config is not None else None
    rank, wanted = settings.rank, set(settings.target_modules)
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for name, info in header.tensors.items():
        m = _TENSOR_RE.match(name)
        if not m:
            raise InvalidAdapterError(
                f"{WEIGHTS_NAME}: unexpected tensor {name!r} (only lora_A/lora_B weights of "
                f"{', '.join(SUPPORTED_MODULES)} are allowed)"
            )
        module, block, layer = m["module"], m["block"], int(m["layer"])
        if module not in SUPPORTED_MODULES or block != (
            "self_attn" if module in ATTENTION_MODULES else "mlp"
        ):
            raise InvalidAdapterError(f"{WEIGHTS_NAME}: unexpected tensor {name!r} (unsupported module)")
        if module not in wanted:
            raise InvalidAdapterError(
                f"{WEIGHTS_NAME}: tensor {name!r} is for {module}, not in target_modules"
            )
        if info.dtype not in WEIGHT_DTYPES:
            raise InvalidAdapterError(
                f"{WEIGHTS_NAME}: tensor {name!r} has dtype {info.dtype}, not F32/F16/BF16"
            )
        if len(info.shape) != 2:
            raise InvalidAdapterError(
                f"{WEIGHTS_NAME}: tensor {name!r} has shape {list(info.shape)}, not 2-D"
            )
        if isinstance(num_layers, int) and layer >= num_layers:
            raise InvalidAdapterError(
                f"{WEIGHTS_NAME}: tensor {name!r} is for layer {layer}; the base has {num_layers}"
            )
        tensor_rank = info.shape[0] if m["ab"] == "A" else info.shape[1]
        if tensor_rank != rank:
            raise InvalidAdapterError(
                f"{WEIGHTS_NAME}: tensor {name!r} has shape {list(info.shape)} (rank {tensor_rank}) "
                f"but the declared rank is {rank}"
            )
        pairs.setdefault((layer, module), {})[m["ab"]] = info.shape
    if not pairs:
        raise InvalidAdapterError(f"{WEIGHTS_NAME} holds no LoRA tensors")

    seen_io: dict[str, tuple[int, int]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise InvalidAdapterError(f"{WEIGHTS_NAME}: layer {layer} {module} has no {missing} tensor")
        io = (ab["A"][1], ab["B"][0])
        expected = shapes[module] if shapes else seen_io.setdefault(module, io)
        if io != expected:
            raise InvalidAdapterError(
                f"{WEIGHTS_NAME}: layer {layer} {module} maps {io[0]} -> {io[1]} features, "
                f"the base model has {expected[0]} -> {expected[1]} (adapter made for another base?)"
            )
    missing_modules = wanted - {module for _, module in pairs}
    if missing_modules:
        raise InvalidAdapterError(
            f"{WEIGHTS_NAME} has no tensors for target modules {', '.join(sorted(missing_modules))}"
        )
    return sorted({layer for layer, _ in pairs})


def _pickle_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)


def read_peft_dir(
    peft_dir: str | os.PathLike, base_config: dict | None = None, *, progress: bool = False
) -> PeftAdapterInfo:
    """Validate a PEFT adapter folder (see module docstring) and describe it.

    Only adapter_config.json and adapter_model.safetensors are read; other files (README.md,
    training state) are ignored. Raises InvalidAdapterError with a message naming the problem.
    """
    folder = Path(peft_dir)
    if not folder.is_dir():
        raise InvalidAdapterError(f"adapter folder {folder} does not exist or is not a folder")
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not weights_path.exists():
        pickles = _pickle_files(folder)
        if pickles:
            raise InvalidAdapterError(
                f"{folder} has {', '.join(pickles)} but no {WEIGHTS_NAME}: pickle weights are refused "
                f"(they can run code when loaded); save the adapter with safe_serialization=True"
            )
        raise InvalidAdapterError(f"{folder} has no {WEIGHTS_NAME}")
    if not config_path.is_file():
        raise InvalidAdapterError(f"{folder} has no {CONFIG_NAME}")
    if not weights_path.is_file():
        raise InvalidAdapterError(f"{weights_path} is not a regular file")

    config_size = config_path.stat().st_size
    if config_size > MAX_CONFIG_BYTES:
        raise InvalidAdapterError(f"{CONFIG_NAME} is {config_size} bytes (limit {MAX_CONFIG_BYTES})")
    config_bytes = config_path.read_bytes()
    settings = check_adapter_config(config_bytes)

    with open(weights_path, "rb") as f:
        weights_size = os.fstat(f.fileno()).st_size
        if weights_size > MAX_WEIGHTS_BYTES:
            raise InvalidAdapterError(f"{WEIGHTS_NAME} is {weights_size} bytes (limit {MAX_WEIGHTS_BYTES})")
        try:
            header = read_header(f, weights_size)
        except ValueError as e:
            raise InvalidAdapterError(f"{WEIGHTS_NAME}: {e}") from None
    layers = check_lora_tensors(header, settings, base_config)

    config_sha = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    weights_sha = file_sha256(weights_path, progress=progress)
    return PeftAdapterInfo(
        rank=settings.rank,
        alpha=settings.alpha,
        target_modules=settings.target_modules,
        content_checksum=content_checksum(config_sha, weights_sha),
        config_sha256=config_sha,
        config_size=len(config_bytes),
        weights_sha256=weights_sha,
        weights_size=weights_size,
        num_tensors=len(header.tensors),
        layers=layers,
    )
