"""`EngineConfig`: every setting of the engine, declared once.

The replica's CLI adds the flags of the fields that carry a `flag` in their metadata
(`add_arguments`) and reads them back (`from_args`); the config then travels whole, unchanged,
from the CLI through the replica's configuration to `Engine(model_dir, config)`. A new engine
setting is one field here (with its flag, if users set it), nothing more.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

from handler.engine.fairness import W_DECODE, W_PREFILL
from handler.engine.speculate import SPECULATE_MAX_ROWS, SPECULATE_TOKENS

DEFAULT_RANK_POOLS = {8: 8, 16: 8, 32: 8, 64: 4}
# decode rows per contended step on the CPU (fairness.py: contended steps). A first token waits for the
# step in progress, then for its own prefill step; a step no longer than that prefill step keeps it
# within about twice its time alone. SmolLM2-135M, 2 cores: an 8-row decode step 76-84 ms, 16 rows
# 104-140 ms, a newcomer's ~10-token prefill step 60-77 ms; per token 8 rows cost 1.2-1.5x 16 rows.
CPU_CONTENDED_ROWS = 8
DTYPES = ("float32", "bfloat16", "float16")  # names, so that building the CLI's parser needs no torch


def _flag(flag: str, help: str, **argparse_kw) -> dict:
    return {"flag": flag, "help": help, **argparse_kw}


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. Fields with a `flag` are `lorafarm replica` flags of the same meaning."""

    device: str | None = field(default=None, metadata=_flag(
        "--device", "torch device (default cuda when available, else cpu)"))
    # None: bfloat16 on cuda, float32 on the CPU (`resolved`)
    dtype: str | None = field(default=None, metadata=_flag(
        "--dtype", "weights dtype (default bfloat16 on cuda, float32 on cpu)", choices=list(DTYPES)))
    # None: max_batch requests of min(max_position_embeddings, 2048) tokens, capped at 2 GiB
    kv_cache_bytes: int | None = field(default=None, metadata=_flag(
        "--kv-cache-bytes", "KV cache budget (default: sized from the model's dims and the machine's memory, "
        "handler/serving/sizing.py)", size=True))
    max_batch: int = field(default=32, metadata=_flag(
        "--max-batch", "requests in the running batch (default 32)"))
    max_prefill_tokens: int = field(default=2048, metadata=_flag(
        "--max-prefill-tokens", "prompt tokens prefilled per engine step, over all requests (a longer prompt is "
        "split across steps; more: a burst's first tokens sooner, running streams wait longer; default 2048, "
        "vLLM's CPU API-server default)"))
    rank_pools: Mapping[int, int] | None = None  # {pool rank: slots}; None: DEFAULT_RANK_POOLS; {}: no slots
    max_context: int | None = None  # None: min(max_position_embeddings, the cache's capacity)
    block_size: int = 16
    merged_adapter: Any = None  # a `handler.model.merge.MergedAdapter`: serve only it, folded into the weights
    kv_reserve: str = "demand"  # "demand" (grow, preempt) or "max_tokens" (reserve at admission; for comparison)
    attention: str = field(default="auto", metadata=_flag(
        "--attention", "decode attention: paged (read in place on the KV cache, a compiled kernel), gather "
        "(blocks copied out, then SDPA), or auto (a fixed rule of device and shapes, paged only where the kernel "
        "compiles and checks correct; nothing is timed at startup)", choices=["auto", "paged", "gather"]))
    compile: bool = field(default=False, metadata=_flag(
        "--compile", "torch.compile the layer pieces of decode steps, padded to batch buckets (CUDA graphs on "
        "cuda); compiles for a minute or more at first use"))
    batch_invariant: bool = field(default=False, metadata=_flag(
        "--batch-invariant", "a row's arithmetic independent of the batch around it (same tokens and logits at "
        "temperature 0 alone or in a batch; docs/architecture.md); excludes --compile"))
    prefix_cache: bool = field(default=False, metadata=_flag(
        "--no-prefix-cache", "prefill every prompt from scratch (default: KV blocks of identical prompt prefixes "
        "are reused, only within one tenant, adapter and base: docs/architecture.md, Prefix cache)",
        negate=True))
    cache_key: str | None = None  # the prefix cache's base identity (the replica: the base model hash)
    decode_step: bool | None = None  # the C decode step: None where it applies, True required, False never
    speculate: int = field(default=SPECULATE_TOKENS, metadata=_flag(
        "--speculate", "n-gram draft tokens per greedy request and decode step, checked in the same step (the "
        "answer is the same token for token; a few rows cost about one on CPU; 0: off; default "
        f"{SPECULATE_TOKENS}; handler/engine/speculate.py)", metavar="N"))
    speculate_max_rows: int = SPECULATE_MAX_ROWS
    scheduling: str = field(default="fair", metadata=_flag(
        "--scheduling", "which waiting request takes a batch row: fair (by tenant: the least served tenant's "
        "first, each tenant guaranteed its weighted share of --max-batch rows, rows beyond a share preempted "
        "when another tenant waits; one tenant alone is served first come, first served; "
        "handler/engine/fairness.py) or fifo (first come, first served over all tenants; for comparison)",
        choices=["fair", "fifo"]))
    # None: the device's rule (`resolved_contended_rows`)
    contended_rows: int | None = field(default=None, metadata=_flag(
        "--contended-rows", "fair scheduling, while a tenant below its share of rows has requests beside another "
        "tenant: decode rows per step at most (the batch's rows take turns), so that a step the light tenant waits "
        "on stays short (default: on the CPU, where a step's time grows with its rows, "
        f"{CPU_CONTENDED_ROWS}, a step about as long as a newcomer's own prefill step; --max-batch on an "
        "accelerator, where it hardly does)"))
    fair_prefill_weight: float = W_PREFILL  # a prompt token in the fairness counters
    fair_decode_weight: float = W_DECODE  # a generated token in the fairness counters

    def __post_init__(self) -> None:
        if self.attention not in ("auto", "paged", "gather"):
            raise ValueError(f"attention must be 'auto', 'paged' or 'gather', not {self.attention!r}")
        if self.kv_reserve not in ("demand", "max_tokens"):
            raise ValueError(f"kv_reserve must be 'demand' or 'max_tokens', not {self.kv_reserve!r}")
        if self.max_batch < 1 or self.max_prefill_tokens < 1 or self.block_size < 1:
            raise ValueError("max_batch, max_prefill_tokens and block_size must be positive")
        if self.speculate < 0 or self.speculate_max_rows < 1:
            raise ValueError("speculate must be >= 0 and speculate_max_rows >= 1")
        if self.batch_invariant and (self.compile or self.attention == "paged"):
            raise ValueError("batch_invariant excludes compile and attention 'paged' (padded buckets, a kernel "
                             "whose split depends on the batch)")
        if self.scheduling not in ("fair", "fifo"):
            raise ValueError(f"scheduling must be 'fair' or 'fifo', not {self.scheduling!r}")
        if self.contended_rows is not None and self.contended_rows < 1:
            raise ValueError("contended_rows must be positive")
        if self.fair_prefill_weight < 0 or self.fair_decode_weight < 0:
            raise ValueError("fair_prefill_weight and fair_decode_weight must be >= 0")
        if self.dtype is not None and not isinstance(self.dtype, str):  # a torch.dtype: kept by name
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")

    def resolved_contended_rows(self, device: torch.device) -> int:
        """Decode rows per contended step: the flag, or on the CPU `CPU_CONTENDED_ROWS` (at most the
        batch), and the whole batch on an accelerator."""
        if self.contended_rows is not None:
            return max(1, min(int(self.contended_rows), self.max_batch))
        return self.max_batch if device.type != "cpu" else max(1, min(CPU_CONTENDED_ROWS, self.max_batch))

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype by name, or where none is set bfloat16 on cuda and float32 elsewhere."""
        import torch  # lazy: this module is imported to build the CLI's parser, which needs no torch

        return getattr(torch, self.dtype or ("bfloat16" if device.type == "cuda" else "float32"))

    # ------------------------------------------------------------------------------ the CLI

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, parse_size=int, **defaults) -> None:
        """Add a flag for every field that declares one; `defaults` overrides a field's default for
        the CLI (the replica turns the prefix cache on)."""
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            if "flag" not in meta:
                continue
            flag, help_ = meta.pop("flag"), meta.pop("help")
            default = defaults.get(f.name, f.default)
            dest = f"engine_{f.name}"
            if meta.pop("negate", False):
                parser.add_argument(flag, dest=dest, action="store_false", default=True, help=help_)
            elif f.type in ("bool", bool):
                parser.add_argument(flag, dest=dest, action="store_true", default=bool(default), help=help_)
            else:
                typ = parse_size if meta.pop("size", False) else (str if "choices" in meta or f.name in (
                    "device", "dtype") else int)
                if "choices" not in meta:
                    meta.setdefault("metavar", flag.lstrip("-").upper().replace("-", "_"))
                parser.add_argument(flag, dest=dest, type=typ, default=default, help=help_, **meta)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """The config the flags added by `add_arguments` describe, with `overrides` on top."""
        values = {f.name: getattr(args, f"engine_{f.name}") for f in dataclasses.fields(cls)
                  if "flag" in f.metadata and hasattr(args, f"engine_{f.name}")}
        values.update(overrides)
        return cls(**values)
