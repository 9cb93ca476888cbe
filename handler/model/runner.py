"""The model runner: a compact Llama-family decoder in plain torch.

Covers Llama (1/2/3), Mistral and Qwen2 style checkpoints: RMSNorm, rotary position embeddings
with the config's theta and scaling, grouped-query attention (with optional sliding window),
SwiGLU MLP, optional q/k/v (and o) biases, tied or untied output head. Weights are read from the
Hugging Face safetensors layout by tensor name (single file or sharded with
`model.safetensors.index.json`); transformers supplies only the config (and the tokenizer, in the
engine).

The forward pass works on a flat list of tokens from many sequences at once: every linear layer
(and its batched LoRA delta, see `handler.model.lora`) runs once over all tokens of the step; only
attention is per sequence, reading keys and values from the paged KV cache (`handler.model.kvcache`).
A step may mix prefill chunks (many tokens of one sequence) and decode rows (one token each);
each kind is an `AttnGroup` so decode rows are not padded to the prefill length.

q/k/v and gate/up are fused into one weight each (one matmul instead of three or two); LoRA deltas
are added into the matching output slice, so results equal the unfused model.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from archives.safetensors_header import read_file_header
from handler.model import small_gemm
from handler.model.kvcache import KVCache
from handler.model.tensors import to_device, zeroed  # noqa: F401 - zeroed: importable from here as before

log = logging.getLogger(__name__)

# Module names as PEFT and Hugging Face spell them; the order of the fused slices.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTN_MODULES + MLP_MODULES

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class ModelLoadError(Exception):
    """The checkpoint folder is missing files, tensors, or has an unsupported architecture."""


@dataclass(frozen=True)
class ModelConfig:
    """What the runner needs from a Hugging Face `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_parameters: dict = field(default_factory=dict)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # per layer: None (full attention) or the window length (keys with q_pos - key_pos < window)
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def module_shape(self, module: str) -> tuple[int, int]:
        """(out_features d, in_features k) of a projection: W is [d, k]."""
        h, i = self.hidden_size, self.intermediate_size
        qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (qd, h),
            "k_proj": (kvd, h),
            "v_proj": (kvd, h),
            "o_proj": (h, qd),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }[module]

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """From a transformers config object (LlamaConfig, MistralConfig, Qwen2Config)."""
        mt = getattr(hf, "model_type", "llama")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(f"unsupported model_type {mt!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        if not rope:  # transformers 4.x spelling
            rope = dict(getattr(hf, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.get("type", "default"))
        theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))

        n = hf.num_hidden_layers
        window = getattr(hf, "sliding_window", None)
        layer_types = getattr(hf, "layer_types", None)
        if mt == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        if window:
            if layer_types:
                windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
            else:
                windows = (window,) * n
        else:
            windows = (None,) * n

        if mt == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=n,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=int(hf.max_position_embeddings),
            rope_theta=theta,
            rope_parameters=rope,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            hidden_act=getattr(hf, "hidden_act", "silu"),
            sliding_windows=windows,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )


# config.json keys whose transformers defaults differ by model type or are not ModelConfig.from_hf's
# getattr defaults: a config.json must name them all to be read without transformers
_CONFIG_REQUIRED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                    "bos_token_id", "eos_token_id")


def load_hf_config(model_dir: str | Path):
    """The model's config: config.json read as is (a namespace) when it names every field ModelConfig
    reads whose transformers default is not `from_hf`'s own and its RoPE is computed here; else
    transformers' AutoConfig (defaults filled in per model type, yarn/longrope parameters). The fast
    path skips importing transformers (~2 s of CPU at a replica's start, issue 36)."""
    cfg = json_config(model_dir)
    if cfg is not None:
        return cfg
    from transformers import AutoConfig  # lazy: slow to import

    return AutoConfig.from_pretrained(str(model_dir))


def json_config(model_dir: str | Path):
    """config.json as a SimpleNamespace where that is exactly what AutoConfig gives ModelConfig.from_hf; None
    where transformers must fill in defaults."""
    from types import SimpleNamespace

    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or any(k not in raw for k in _CONFIG_REQUIRED):
        return None
    mt = raw["model_type"]
    if mt not in ("llama", "mistral", "qwen2"):
        return None
    if mt in ("mistral", "qwen2") and "sliding_window" not in raw:
        return None
    if mt == "qwen2" and raw.get("use_sliding_window"):
        return None  # transformers derives the per-layer windows (max_window_layers)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) not in ("default", "linear",
                                                                                               "llama3"):
        return None
    if "rope_theta" not in raw and "rope_theta" not in rope:
        return None
    return SimpleNamespace(**raw)


# ----------------------------------------------------------------------------------------- weights


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index json, or the one file."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        if not names:
            raise ModelLoadError(f"{index} has an empty weight_map")
        for n in names:
            if Path(n).name != n or n in (".", ".."):
                raise ModelLoadError(f"{index.name} names a shard outside the folder: {n!r}")
            if not (d / n).exists():
                raise ModelLoadError(f"shard {n} named by {index.name} is missing")
        return [d / n for n in names]
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    any_st = sorted(d.glob("*.safetensors"))
    if any_st:
        return any_st
    raise ModelLoadError(f"{d} holds no safetensors checkpoint (model.safetensors or an index json)")


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)


class Checkpoint:
    """The tensors of a safetensors checkpoint, read with plain file reads into tensors the caller owns.

    Why not `safe_open`: its tensors are views of one private mapping of the whole file. The runner
    kept some of them as they were (embeddings, o_proj, down_proj) and copied the rest into its fused
    q/k/v and gate/up weights, so the mapping stayed for the process's lifetime, and the kernel counts
    every page of it that was ever touched (the whole file, soon after the first request) in the
    process's RSS beside the fused copies: SmolLM2-135M in float32 held 513 MiB of file pages next to
    278 MiB of copies, 1.84 GB RSS in all. Read here, every weight is in the process once, in memory
    it owns; fused weights are read straight into their slices (no intermediate copy), and the file's
    page cache is the kernel's, not the replica's RSS.
    """

    def __init__(self, model_dir: str | Path):
        self.index: dict[str, tuple[Path, Any]] = {}
        for path in checkpoint_files(model_dir):
            try:
                header = read_file_header(path)
            except ValueError as e:
                raise ModelLoadError(f"{path}: {e}") from None
            for name, info in header.tensors.items():
                if info.dtype not in _ST_DTYPES:
                    raise ModelLoadError(f"{path.name}: tensor {name} has unsupported dtype {info.dtype}")
                self.index[name] = (path, info)
        self._files: dict[Path, Any] = {}

    def keys(self) -> list[str]:
        return list(self.index)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.index[name][1].shape)

    def stored_dtype(self, name: str) -> torch.dtype:
        return _ST_DTYPES[self.index[name][1].dtype]

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (any dtype and device, the tensor's shape; a contiguous row slice of a fused
        weight is fine) with the stored tensor. Same dtype on the CPU: read straight into it."""
        path, info = self.index[name]
        if tuple(out.shape) != tuple(info.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(info.shape)}, expected {tuple(out.shape)}")
        stored = _ST_DTYPES[info.dtype]
        direct = out.device.type == "cpu" and out.dtype == stored and out.is_contiguous()
        dest = out if direct else torch.empty(info.shape, dtype=stored)
        if dest.numel():
            view = memoryview(dest.view(-1).view(torch.uint8).numpy())
            if len(view) != info.end - info.start:
                raise ModelLoadError(f"tensor {name}: {info.end - info.start} bytes stored for {len(view)}")
            f = self._files.get(path)
            if f is None:
                f = self._files[path] = open(path, "rb", buffering=0)
            f.seek(info.start)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise ModelLoadError(f"{path} is truncated (tensor {name})")
                done += n
        if not direct:
            out.copy_(dest)
        return out

    def get(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A new tensor owned by the caller: floating-point tensors cast to `dtype`, others kept."""
        stored = self.stored_dtype(name)
        dt = dtype if stored.is_floating_point else stored
        return self.read_into(name, torch.empty(self.shape(name), dtype=dt, device=device))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_weights(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint by name (with any leading `model.` kept), cast to dtype/device,
    each in memory of its own (no file mapping kept alive, see `Checkpoint`)."""
    with Checkpoint(model_dir) as ck:
        return {name: ck.get(name, dtype, device) for name in ck.keys()}


# -------------------------------------------------------------------------------------------- rope


def rope_inv_freq(cfg: ModelConfig, hf_config: Any = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scaling factor for the config's RoPE type."""
    rtype = cfg.rope_parameters.get("rope_type", "default")
    dim = cfg.head_dim
    if rtype == "default":
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    if rtype == "linear":
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv / float(cfg.rope_parameters["factor"]), 1.0
    if rtype == "llama3":
        p = cfg.rope_parameters
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old = float(p.get("original_max_position_embeddings", cfg.max_position_embeddings))
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn, longrope, ...: the config-derived frequencies exactly as transformers computes them
    if hf_config is None:
        raise ModelLoadError(f"rope_type {rtype!r} needs the transformers config")
    if rtype == "dynamic":
        log.warning("dynamic NTK RoPE: frequencies fixed at the base length (no rescaling past it)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rtype not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unsupported rope_type {rtype!r}")
    inv, factor = ROPE_INIT_FUNCTIONS[rtype](hf_config, torch.device("cpu"))
    return inv.float(), float(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as the Hugging Face Llama does."""
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dt)


_ACTS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


# --------------------------------------------------------------------------------- batch metadata


class StepBuffers:
    """Persistent device buffers for the per-step index tensors (token ids, positions, cache slots,
    logits rows), filled from persistent pinned host buffers with non-blocking copies: no device or
    pinned allocation and no host sync per step, and fixed device addresses. Each name is written once per step; the
    host staging is reused safely because a step reads its sampled tokens (a sync) before the next
    one builds. On CPU the host tensor is used as it is."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._host: dict[str, torch.Tensor] = {}
        self._dev: dict[str, torch.Tensor] = {}

    def put(self, name: str, values: list[int]) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(values, dtype=torch.long)
        n = len(values)
        host = self._host.get(name)
        if host is None or host.numel() < n:
            cap = max(n, 256, 2 * (host.numel() if host is not None else 0))
            host = torch.empty(cap, dtype=torch.long, pin_memory=self.device.type == "cuda")
            self._host[name] = host
            self._dev[name] = torch.empty(cap, dtype=torch.long, device=self.device)
        host[:n].copy_(torch.tensor(values, dtype=torch.long))
        out = self._dev[name][:n]
        out.copy_(host[:n], non_blocking=True)
        return out


@dataclass
class AttnGroup:
    """Query tokens of one step attended together by one `scaled_dot_product_attention` call.

    kind "self":  `num_seqs` prefill chunks of `max_q` tokens each that start at position 0 and
                  sit back to back at tokens [start, end): they attend only to themselves, so
                  keys and values are the step's own (no cache read) and the mask is causal
                  (`masks[w]` None: is_causal, else the windowed causal mask [L, L]);
    kind "cache": the queries read the paged cache through `block_tables` [B, nb]: one prefill
                  continuation (tokens [start, end), mask [1, 1, L, nb*bs]), a bucket of them
                  (`index` [B*L]: each chunk's token indices, padded to the longest chunk by
                  repeating its last; mask [B, 1, L, nb*bs]), or a bucket of decode rows (`index`
                  [B]: their token indices; mask [B, 1, 1, nb*bs]). Rows are bucketed by context
                  length (within a bucket the longest is < 2x the shortest + one block), so one
                  long row pads only its own bucket, not every row;
    kind "paged": every decode row of the step (tokens [start, end)), attended in place on the
                  cache by `handler.model.paged_attention` (no gather, no padding; `paged` holds the
                  block tables).
    """

    kind: str
    start: int
    end: int
    num_seqs: int
    max_q: int
    index: torch.Tensor | None  # decode buckets: token indices of the rows, else None (the range)
    block_tables: torch.Tensor | None  # [B, nb] long (kind "cache")
    masks: dict  # window (None or int) -> bool mask or None (plain causal)
    paged: Any = None  # kind "paged": handler.model.paged_attention.PagedDecode


@dataclass
class StepBatch:
    """Everything the forward pass needs for one step, built once and shared by all layers."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    cache_slots: torch.Tensor  # [T] flat cache index block*block_size + offset
    groups: list[AttnGroup]
    logits_index: torch.Tensor | None  # [R] flat token indices whose logits are wanted (None: all)
    lora: Any = None  # handler.model.lora.LoRABatch or None
    rows: int | None = None  # a bucketed decode step: its real rows (the rest are padding)


def _window_mask(qpos: torch.Tensor, klen: int, w: int | None) -> torch.Tensor:
    """[..., q, klen] bool: key position j visible from query position p (j <= p, p - j < w)."""
    kpos = torch.arange(klen)
    m = kpos <= qpos.unsqueeze(-1)
    if w is not None:
        m &= kpos > qpos.unsqueeze(-1) - w
    return m


def _buckets(lengths: list[int], block_size: int, per_row: bool) -> list[list[int]]:
    """`_decode_buckets`, or every row alone (the engine's batch-invariant mode)."""
    return [[i] for i in range(len(lengths))] if per_row else _decode_buckets(lengths, block_size)


def _decode_buckets(ctx: list[int], block_size: int) -> list[list[int]]:
    """Row indices grouped by context length, shortest first: a bucket's longest row holds fewer
    than 2 x (its shortest row's blocks) + 1 blocks, so padding stays under half of a bucket."""
    order = sorted(range(len(ctx)), key=lambda i: ctx[i])
    buckets: list[list[int]] = []
    lo = 0
    for i in order:
        nb = -(-ctx[i] // block_size)
        if buckets and nb <= 2 * lo + 1:
            buckets[-1].append(i)
        else:
            buckets.append([i])
            lo = nb
    return buckets


def _continuations(rows: list[int], ctxs: list[int], seqs, first: list[int], block_size: int, windows: set, device,
                   tables) -> "AttnGroup":
    """One "cache" group for prefill continuations `rows` (contexts `ctxs`): a lone one keeps its token
    range; more have their queries padded to the longest chunk by repeating each one's last query (same
    query, same mask: the same result, written twice to the same token)."""
    nb = -(-max(ctxs) // block_size)
    if len(rows) == 1:
        r, q = rows[0], len(seqs[rows[0]][0])
        qpos = torch.arange(seqs[r][1], ctxs[0])
        masks = {w: to_device(_window_mask(qpos, nb * block_size, w).view(1, 1, q, -1), device) for w in windows}
        return AttnGroup("cache", first[r], first[r] + q, 1, q, None, tables([r], nb), masks)
    L = max(len(seqs[r][0]) for r in rows)
    qpos = torch.tensor([[min(seqs[r][1] + j, c - 1) for j in range(L)] for r, c in zip(rows, ctxs)])
    index = [first[r] + min(j, len(seqs[r][0]) - 1) for r in rows for j in range(L)]
    masks = {w: to_device(_window_mask(qpos, nb * block_size, w).view(len(rows), 1, L, -1), device) for w in windows}
    return AttnGroup("cache", -1, -1, len(rows), L, to_device(torch.tensor(index, dtype=torch.long), device),
                     tables(rows, nb), masks)


def build_step_batch(
    seqs: list[tuple[list[int], int, list[int]]],
    block_size: int,
    device: torch.device,
    windows: set,
    decode_from: int | None = None,
    all_logits: bool = False,
    pad_block: int = 0,
    decode_tables=None,
    buffers: StepBuffers | None = None,
    pad_to: int | None = None,
    scratch_slot: int = 0,
    per_row: bool = False,
) -> StepBatch:
    """Metadata for one forward over `seqs` = [(new token ids, start position, block table)].

    Sequences at index >= `decode_from` carry exactly one token each and are decode rows; the ones
    before are prefill chunks, each attended at its own length (varlen: never padded to another
    chunk). Logits are computed for the last token of each sequence (or for every token with
    all_logits). Block tables are padded with `pad_block` (the cache's zero null block). With
    `decode_tables` (a `handler.model.paged_attention.DecodeTables`) the decode rows form one "paged"
    group read in place; without, they are bucketed and gathered. Index tensors are built on the
    host and moved with `to_device` or into `buffers` (pinned, non-blocking on CUDA).

    `pad_to` (decode rows only): a bucketed step of `pad_to` rows, the rows past the real ones
    being padding (token 0 at position 0, K/V written to `scratch_slot`, attention zero); logits
    are those of the real rows (`StepBatch.rows`).

    `per_row` (the engine's batch-invariant mode): every sequence is an attention group of its own
    (a fresh chunk its own causal call, a decode row its own bucket padded to its own blocks), so its
    attention is the same call alone or in any batch: with more than one thread, SDPA on the CPU
    splits a batched call's work by its shape, and a row's result changes with its neighbours.
    """
    n = len(seqs)
    decode_from = n if decode_from is None else decode_from
    tok: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    last: list[int] = []
    first: list[int] = []
    for ids, start, table in seqs:
        first.append(len(tok))
        for j, t in enumerate(ids):
            p = start + j
            tok.append(t)
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        last.append(len(tok) - 1)

    def tables(rows: list[int], nb: int) -> torch.Tensor:
        t = torch.full((len(rows), nb), pad_block, dtype=torch.long)
        for b, i in enumerate(rows):
            used = min(nb, len(seqs[i][2]))
            t[b, :used] = torch.tensor(seqs[i][2][:used], dtype=torch.long)
        return to_device(t, device)

    groups: list[AttnGroup] = []
    i = 0
    cont: list[int] = []  # prefill continuations (chunks after a cached prefix or an earlier chunk)
    while i < decode_from:  # prefill chunks: runs of equal-length fresh chunks share one call
        ids, start, _ = seqs[i]
        q = len(ids)
        if start == 0:
            j = i + 1
            while not per_row and j < decode_from and seqs[j][1] == 0 and len(seqs[j][0]) == q:
                j += 1
            qpos = torch.arange(q)
            masks = {w: None if w is None or w >= q else to_device(_window_mask(qpos, q, w), device) for w in windows}
            groups.append(AttnGroup("self", first[i], first[i] + (j - i) * q, j - i, q, None, None, masks))
            i = j
            continue
        cont.append(i)
        i += 1
    # continuations bucketed like decode rows, one call per bucket: a burst of prompts on one cached
    # system prompt is 30 continuations, and a call each per layer cost more host time than their
    # products (31 x 36-token prompts: 930 attention calls). By context length (key padding), then by
    # chunk length (query padding), so a short chunk is never padded to a long one's length.
    cctx = [seqs[i][1] + len(seqs[i][0]) for i in cont]
    for by_ctx in _buckets(cctx, block_size, per_row):
        for by_len in _buckets([len(seqs[cont[b]][0]) for b in by_ctx], block_size, per_row):
            rows = [cont[by_ctx[b]] for b in sorted(by_len)]  # in context order
            ctxs = [cctx[by_ctx[b]] for b in sorted(by_len)]
            groups.append(_continuations(rows, ctxs, seqs, first, block_size, windows, device, tables))
    dec = list(range(decode_from, n))
    ctx = [seqs[i][1] + 1 for i in dec]
    if dec and decode_tables is not None:  # decode rows are the step's last tokens, one each
        meta = decode_tables.build(ctx, [seqs[i][2] for i in dec], windows)
        groups.append(AttnGroup("paged", first[decode_from], len(tok), len(dec), 1, None, None, {}, meta))
        dec, ctx = [], []
    for bucket in _buckets(ctx, block_size, per_row):
        rows = [dec[b] for b in bucket]
        nb = max(-(-ctx[b] // block_size) for b in bucket)
        qpos = torch.tensor([ctx[b] - 1 for b in bucket]).view(-1, 1)
        masks = {w: to_device(_window_mask(qpos, nb * block_size, w).view(len(rows), 1, 1, -1), device) for w in windows}
        index = to_device(torch.tensor([first[r] for r in rows], dtype=torch.long), device)
        groups.append(AttnGroup("cache", -1, -1, len(rows), 1, index, tables(rows, nb), masks))
    buffers = buffers or StepBuffers(device)
    rows = None
    if pad_to is not None:
        if decode_from != 0 or pad_to < n:
            raise ValueError("pad_to is for steps of decode rows only, at least as many as the rows")
        rows, all_logits = n, True
        extra = pad_to - n
        tok, pos, slots = tok + [0] * extra, pos + [0] * extra, slots + [scratch_slot] * extra
    return StepBatch(
        rows=rows,
        token_ids=buffers.put("token_ids", tok),
        positions=buffers.put("positions", pos),
        cache_slots=buffers.put("cache_slots", slots),
        groups=groups,
        logits_index=None if all_logits else buffers.put("logits_index", last),
    )


def attend_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch, kv, layer: int,
                window: int | None) -> torch.Tensor:
    """Attention of every query token of the step, group by group: [T, H, D] (padding rows of a
    bucketed step stay zero)."""
    out = (torch.zeros_like if batch.rows is not None else torch.empty_like)(q)
    for g in batch.groups:
        if g.index is None:
            sl = slice(g.start, g.end)
            out[sl] = attend_group(q[sl], k[sl], v[sl], g, kv, layer, window)
        else:
            out.index_copy_(0, g.index, attend_group(q[g.index], None, None, g, kv, layer, window))
    return out


def attend_group(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, g: AttnGroup, kv, layer: int,
                 window: int | None) -> torch.Tensor:
    """Attention of one group's queries; q [n, H, D] and the step's own k, v [n, KVH, D] for
    kind "self"; returns [n, H, D]. GQA goes to SDPA as `enable_gqa` (no repeated heads)."""
    H, D = q.shape[1], q.shape[2]
    KVH = kv.num_kv_heads
    gqa = KVH != H
    if g.kind == "paged":
        # the paged kernel, through the PagedDecode the injected DecodeTables built (the runner does not
        # import handler.model.paged_attention: that module's self-check runs this runner's gathered path)
        return g.paged.attend(q, kv.k[layer], kv.v[layer], window)
    if g.kind == "self":
        B, L = g.num_seqs, g.max_q
        qb = q.view(B, L, H, D).transpose(1, 2)
        kb = k.view(B, L, KVH, D).transpose(1, 2)
        vb = v.view(B, L, KVH, D).transpose(1, 2)
        mask = g.masks[window]
        if mask is None:
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(B * L, H, D)
    B, L = g.num_seqs, g.max_q
    kc, vc = kv.gather(layer, g.block_tables)  # [B, KVH, nb*bs, D]: the group's own blocks only
    qb = q.view(B, L, H, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(qb, kc, vc, attn_mask=g.masks[window], enable_gqa=gqa)
    return out.transpose(1, 2).reshape(B * L, H, D)


# ------------------------------------------------------------------------------- layer pieces
# The layer between its LoRA and attention calls, as plain tensor functions shared by every layer.
# Eager by default; `Runner.compile` wraps each in torch.compile for bucketed decode steps (static
# shapes): fused element-wise work on CPU, and on CUDA mode "reduce-overhead", one CUDA graph per
# piece and bucket. That is vLLM's piecewise graph: the pieces are captured, and what changes from
# step to step (which adapter each row uses, which blocks each row reads) stays outside them.


def _attn_in(x, d, norm, w, b, eps: float, linear=F.linear):
    """The residual of the previous layer's MLP (d, None on the first layer), RMSNorm, fused q/k/v."""
    if d is not None:
        x = x + d
    h = rms_norm(x, norm, eps)
    return x, h, linear(h, w, b)


def _rope(qkv, cos, sin, heads: int, kv_heads: int, head_dim: int):
    """q, k (rotated) and v of the fused q/k/v output."""
    T = qkv.shape[0]
    qd, kvd = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :qd].view(T, heads, head_dim)
    k = qkv[:, qd : qd + kvd].view(T, kv_heads, head_dim)
    v = qkv[:, qd + kvd :].view(T, kv_heads, head_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def _linear(x, w, b, linear=F.linear):
    return linear(x, w, b)


def _mlp_in(x, o, norm, w, b, eps: float, linear=F.linear):
    """The attention residual, RMSNorm, fused gate/up."""
    x = x + o
    h = rms_norm(x, norm, eps)
    return x, h, linear(h, w, b)


def _mlp_out(gu, w, b, act: str, linear=F.linear):
    half = gu.shape[1] // 2
    m = _ACTS[act](gu[:, :half]) * gu[:, half:]
    return m, linear(m, w, b)


def _head(x, d, norm, w, eps: float, linear=F.linear):
    return linear(rms_norm(x + d, norm, eps), w).float()


@dataclass
class Pieces:
    attn_in: Any = _attn_in
    rope: Any = _rope
    linear: Any = _linear
    mlp_in: Any = _mlp_in
    mlp_out: Any = _mlp_out
    head: Any = _head


# Eager steps multiply through `small_gemm.linear`: F.linear, except 1-64 float32 rows on the CPU (a
# decode step of few requests), where our kernel reads each weight once for all rows instead of MKL
# packing it per call. The compiled pieces keep F.linear (inductor sees through it).
def _small_m(piece):
    return partial(piece, linear=small_gemm.linear)


EAGER = Pieces(_small_m(_attn_in), _rope, _small_m(_linear), _small_m(_mlp_in), _small_m(_mlp_out), _small_m(_head))

# Batch-invariant pieces (`Runner.batch_invariant`): a row's products never depend on how many rows
# share the step. CPU BLAS picks another kernel (another reduction order over k) for a matmul of
# few rows (a gemv at 1 row, small-M kernels below 16 rows; see `test_padded_linear_is_row_invariant`),
# so every product runs on at least INVARIANT_MIN_ROWS rows, zero-padded: from there on the reduction
# order of a row is fixed (checked bitwise on this machine's MKL, float32 and bfloat16; not claimed
# for cuBLAS, whose split-K choice depends on the row count).
INVARIANT_MIN_ROWS = 16


def padded_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over at least INVARIANT_MIN_ROWS rows (zero rows appended, then dropped)."""
    T = x.shape[0]
    if T >= INVARIANT_MIN_ROWS:
        return F.linear(x, w, b)
    xp = torch.cat([x, x.new_zeros((INVARIANT_MIN_ROWS - T, x.shape[1]))])
    return F.linear(xp, w, b)[:T]


def _bi_attn_in(x, d, norm, w, b, eps: float):
    if d is not None:
        x = x + d
    h = rms_norm(x, norm, eps)
    return x, h, padded_linear(h, w, b)


def _bi_mlp_in(x, o, norm, w, b, eps: float):
    x = x + o
    h = rms_norm(x, norm, eps)
    return x, h, padded_linear(h, w, b)


# ATen runs an element-wise op on one thread below this many elements (at::internal::GRAIN_SIZE);
# above, threads split the flat range anywhere, even inside a row, and the part of a row that falls
# in a chunk's tail takes the scalar exp instead of the vectorized one: a last-bit difference that
# depends on the batch. In chunks of whole rows below it, every row is one inner loop of its own.
_GRAIN = 32768


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a transcendental element-wise fn, computed the same way for a row in any batch."""
    rows = max(1, (_GRAIN - 1) // max(1, x[0].numel()))
    if x.shape[0] <= rows:
        return fn(x)
    return torch.cat([fn(x[i : i + rows]) for i in range(0, x.shape[0], rows)])


def _bi_mlp_out(gu, w, b, act: str):
    half = gu.shape[1] // 2
    m = rowwise(_ACTS[act], gu[:, :half]) * gu[:, half:]
    return m, padded_linear(m, w, b)


def _bi_head(x, d, norm, w, eps: float):
    return padded_linear(rms_norm(x + d, norm, eps), w).float()


INVARIANT = Pieces(_bi_attn_in, _rope, padded_linear, _bi_mlp_in, _bi_mlp_out, _bi_head)


def bucket_rows(n: int) -> int:
    """The padded row count of a bucketed decode step: 1, 2, 4, 8, then multiples of 8."""
    return 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8


# ------------------------------------------------------------------------------------------ runner


class LayerWeights:
    __slots__ = ("in_norm", "post_norm", "qkv", "qkv_b", "o", "o_b", "gate_up", "gate_up_b", "down", "down_b")


class Runner:
    """Loads a checkpoint and runs forward passes over a `StepBatch` with a `KVCache`.

    `lora` (a `handler.model.lora.ModelLoRA`, optional) adds the batched multi-adapter deltas; the
    engine creates it. Without it the runner is the plain base (or merged) model.
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.model_dir = Path(model_dir)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.dtype = dtype
        self.hf_config = load_hf_config(self.model_dir)
        self.config = ModelConfig.from_hf(self.hf_config)
        self.lora = None
        with Checkpoint(self.model_dir) as ck:
            self._load(ck)
        inv, scale = rope_inv_freq(self.config, self.hf_config)
        t = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(self.device, dtype)
        self.sin = (emb.sin() * scale).to(self.device, dtype)
        self.windows = set(self.config.sliding_windows) | {None}

    # -- loading
    def _load(self, ck: "Checkpoint") -> None:
        """Every weight read once into memory the runner owns; q/k/v and gate/up straight into
        their fused tensors' slices."""
        cfg = self.config
        prefixed = any(k.startswith("model.") for k in ck.keys())
        dt, dev = self.dtype, self.device

        def stored(name: str) -> str:
            return name if prefixed or name.startswith("lm_head") else name.removeprefix("model.")

        def has(name: str) -> bool:
            return stored(name) in ck

        def take(name: str, shape: tuple[int, ...] | None = None, required: bool = True):
            if not has(name):
                if required:
                    raise ModelLoadError(f"tensor {name} missing from {self.model_dir}")
                return None
            if shape is not None and ck.shape(stored(name)) != shape:
                raise ModelLoadError(f"tensor {name} has shape {ck.shape(stored(name))}, expected {shape}")
            return ck.get(stored(name), dt, dev)

        def fused(names: list[str], shapes: list[tuple[int, ...]] | None) -> torch.Tensor:
            """One tensor of the named ones stacked on dim 0, each read into its own slice."""
            for n in names:
                if not has(n):
                    raise ModelLoadError(f"tensor {n} missing from {self.model_dir}")
            got = [ck.shape(stored(n)) for n in names]
            for n, g, want in zip(names, got, shapes or got):
                if g != tuple(want):
                    raise ModelLoadError(f"tensor {n} has shape {g}, expected {tuple(want)}")
            if any(g[1:] != got[0][1:] for g in got):
                raise ModelLoadError(f"tensors {names} cannot be fused: shapes {got}")
            out = torch.empty((sum(g[0] for g in got), *got[0][1:]), dtype=dt, device=dev)
            at = 0
            for n, g in zip(names, got):
                ck.read_into(stored(n), out[at:at + g[0]])
                at += g[0]
            return out

        self.embed = take("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        self.norm = take("model.norm.weight", (cfg.hidden_size,))
        head = take("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), required=not cfg.tie_word_embeddings)
        self.lm_head = head if head is not None else self.embed
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            L = LayerWeights()
            L.in_norm = take(p + "input_layernorm.weight", (cfg.hidden_size,))
            L.post_norm = take(p + "post_attention_layernorm.weight", (cfg.hidden_size,))
            qkv = ("q_proj", "k_proj", "v_proj")
            L.qkv = fused([p + f"self_attn.{m}.weight" for m in qkv], [cfg.module_shape(m) for m in qkv])
            L.qkv_b = fused([p + f"self_attn.{m}.bias" for m in qkv], None) if cfg.qkv_bias else None
            L.o = take(p + "self_attn.o_proj.weight", cfg.module_shape("o_proj"))
            L.o_b = take(p + "self_attn.o_proj.bias") if cfg.o_bias else None
            gu = ("gate_proj", "up_proj")
            L.gate_up = fused([p + f"mlp.{m}.weight" for m in gu], [cfg.module_shape(m) for m in gu])
            L.gate_up_b = fused([p + f"mlp.{m}.bias" for m in gu], None) if cfg.mlp_bias else None
            L.down = take(p + "mlp.down_proj.weight", cfg.module_shape("down_proj"))
            L.down_b = take(p + "mlp.down_proj.bias") if cfg.mlp_bias else None
            self.layers.append(L)
        # output slices of the fused weights, per module: (fused attribute, start, end)
        qd, kvd, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        self.slices = {
            "q_proj": ("qkv", 0, qd),
            "k_proj": ("qkv", qd, qd + kvd),
            "v_proj": ("qkv", qd + kvd, qd + 2 * kvd),
            "o_proj": ("o", 0, cfg.hidden_size),
            "gate_proj": ("gate_up", 0, i),
            "up_proj": ("gate_up", i, 2 * i),
            "down_proj": ("down", 0, cfg.hidden_size),
        }

    def module_weight(self, layer: int, module: str) -> torch.Tensor:
        """A view of one projection's weight [d, k] inside the fused tensors (writable: merge uses it)."""
        attr, a, b = self.slices[module]
        return getattr(self.layers[layer], attr)[a:b]

    # -- forward
    def compile(self) -> None:
        """torch.compile the layer pieces for bucketed decode steps (`StepBatch.rows` set): one
        static-shape graph per piece and bucket, CUDA-graphed on CUDA ("reduce-overhead")."""
        import torch._dynamo

        mode = "reduce-overhead" if self.device.type == "cuda" else None
        # a piece recompiles once per bucket (and once for the first layer's `d is None`)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.pieces = Pieces(*(torch.compile(f, mode=mode, dynamic=False) for f in
                               (_attn_in, _rope, _linear, _mlp_in, _mlp_out, _head)))

    pieces: Pieces | None = None
    batch_invariant = False  # INVARIANT pieces, always eager (`Engine(batch_invariant=True)`)
    compiled_steps = 0  # forward passes that ran the compiled pieces

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv) -> torch.Tensor:
        """Logits (float32) for `batch.logits_index` tokens (or all tokens), writing K/V into `kv`.

        Per layer: pieces (`attn_in`, `rope`, ...) and, between them, the LoRA deltas (added in
        place into each piece's output) and attention over the step's groups."""
        cfg = self.config
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        if self.batch_invariant:
            p = INVARIANT
        else:
            p = self.pieces if self.pieces is not None and batch.rows is not None else EAGER
        if p is not EAGER:
            self.compiled_steps += 1
        lora = self.lora if batch.lora is not None else None
        lb = batch.lora
        x = self.embed[batch.token_ids]
        T = x.shape[0]
        cos = self.cos[batch.positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[batch.positions].unsqueeze(1)
        d = None
        for li, L in enumerate(self.layers):
            window = cfg.sliding_windows[li]
            x, h, qkv = p.attn_in(x, d, L.in_norm, L.qkv, L.qkv_b, eps)
            if lora is not None:
                lora.apply(li, ("q_proj", "k_proj", "v_proj"), h, qkv, lb)
            q, k, v = p.rope(qkv, cos, sin, H, KVH, D)
            kv.write(li, batch.cache_slots, k, v)
            attn = attend_step(q, k, v, batch, kv, li, window).view(T, H * D)
            o = p.linear(attn, L.o, L.o_b)
            if lora is not None:
                lora.apply(li, ("o_proj",), attn, o, lb)
            x, h, gu = p.mlp_in(x, o, L.post_norm, L.gate_up, L.gate_up_b, eps)
            if lora is not None:
                lora.apply(li, ("gate_proj", "up_proj"), h, gu, lb)
            m, d = p.mlp_out(gu, L.down, L.down_b, cfg.hidden_act)
            if lora is not None:
                lora.apply(li, ("down_proj",), m, d, lb)
        if batch.logits_index is not None:
            x, d = x[batch.logits_index], d[batch.logits_index]
        logits = p.head(x, d, self.norm, self.lm_head, eps)
        return logits if batch.rows is None else logits[: batch.rows]

    # -- convenience for tests and tools
    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor | list, lora_slots: list[int] | None = None) -> torch.Tensor:
        """Full-sequence logits [B, L, V] (float32) of equal-length rows, on a scratch KV cache."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        B, L = ids.shape
        bs = 16
        nb = -(-L // bs)
        kv = KVCache.for_blocks(self.config, B * nb, bs, self.dtype, self.device)
        seqs = [(ids[b].tolist(), 0, list(range(b * nb, (b + 1) * nb))) for b in range(B)]
        batch = build_step_batch(seqs, bs, self.device, self.windows, all_logits=True, pad_block=kv.null_block)
        if lora_slots is not None and self.lora is not None:
            batch.lora = self.lora.prepare([s for s in lora_slots for _ in range(L)], prefill=True)
        return self.forward(batch, kv).view(B, L, -1)
