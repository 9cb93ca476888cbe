"""Synthetic LoRA adapters: random PEFT adapters on a base model, uploaded through the registry.

No training: each adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors) whose
tensors are drawn at random, so 1,000 adapters take seconds rather than the hours of training 1,000
canaries. They exercise everything the cache and the router see (ranks, target modules, bytes,
upload, signing, placement) but answer nothing meaningful; canaries stay where a marker is the point.

Weights, per target module with (in, out) features and rank r, scaling alpha / r = 2:

    A ~ U(-1/sqrt(in), 1/sqrt(in))   shape [r, in]   (PEFT's kaiming-uniform range for A)
    B ~ N(0, 0.02^2)                 shape [out, r]  (PEFT starts B at 0: a no-op; 0.02 is small)

so the update 2 * B @ A x has about 0.04 * sqrt(r / 3) times the norm of x: the base dominates
and every logit stays finite. Adapter i is seeded by (seed, i): the same command writes the same
bytes, and the registry's idempotent upload returns the same adapter ids on a rerun.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from archives.peft_dir import module_shapes
from lorafarm.dev.adapters import MODULE_SETS

TARGETS = {"all": ["all"], "attn": ["attention"], "mlp": ["mlp"], "mixed": ["all", "attention", "mlp"]}
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


@dataclass(frozen=True)
class SynthSpec:
    index: int
    rank: int
    target_modules: tuple[str, ...]
    seed: int

    @property
    def name(self) -> str:
        return f"synth-{self.index:05d}"


def synth_specs(count: int, ranks: list[int], targets: str, seed: int = 0) -> list[SynthSpec]:
    """Adapter i: rank ranks[i % len(ranks)]; with --targets mixed the module set cycles too
    (all, attention, mlp), offset so every rank meets every module set."""
    sets = TARGETS[targets]
    out = []
    for i in range(count):
        module_set = sets[(i // len(ranks)) % len(sets)]
        out.append(SynthSpec(i, ranks[i % len(ranks)], tuple(MODULE_SETS[module_set]), seed))
    return out


def write_synth_adapter(base_config: dict, spec: SynthSpec, out: Path, base_path: str = "",
                        dtype: str = "float32", b_std: float = 0.02) -> Path:
    """Write one random adapter in the PEFT layout (what `save_pretrained` writes) to `out`, its
    tensors stored as `dtype` (float32 or float16: drawn in float32 either way, then cast). `b_std`:
    the standard deviation of B (0.02 above; larger makes an adapter that changes the base's answers)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng([spec.seed, spec.index])
    shapes = module_shapes(base_config)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(int(base_config["num_hidden_layers"])):
        for module in spec.target_modules:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{_BLOCK[module]}.{module}"
            bound = 1.0 / np.sqrt(fan_in)
            tensors[f"{prefix}.lora_A.weight"] = rng.uniform(-bound, bound, (spec.rank, fan_in)).astype(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (b_std * rng.standard_normal((fan_out, spec.rank))).astype(dtype)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": spec.rank,
        "lora_alpha": 2 * spec.rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(spec.target_modules),
        "fan_in_fan_out": False,
        "use_dora": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


@dataclass
class SynthResult:
    adapters: dict[str, str]  # name -> adapter id
    aliases: dict[str, str]  # alias -> adapter id
    created: int
    seconds: float
    bytes: int
    tenant_adapters: int
    registry_adapters: int
    registry_aliases: int
    api_key: str | None = None  # set when the tenant was created here

    @property
    def per_s(self) -> float:
        return len(self.adapters) / self.seconds if self.seconds else float("inf")

    def summary(self, tenant: str) -> str:
        return (
            f"{len(self.adapters)} adapters ({self.created} new) in {self.seconds:.1f} s: "
            f"{self.per_s:.1f} adapters/s, {self.bytes / 1e6:.1f} MB uploaded; registry rows: "
            f"{self.registry_adapters} adapters ({self.tenant_adapters} of tenant {tenant}), "
            f"{self.registry_aliases} aliases"
        )


async def synth_upload(
    registry_url: str,
    admin_token: str,
    base_dir: Path,
    tenant: str,
    count: int,
    ranks: list[int],
    targets: str = "mixed",
    aliases: bool = False,
    seed: int = 0,
    concurrency: int = 8,
    progress: bool = True,
) -> SynthResult:
    """Write `count` random adapters and upload each through the registry with the base hash, as a
    training job would; create the tenant when it does not exist."""
    from tqdm import tqdm

    from archives.basehash import base_model_hash, read_base_config
    from lorafarm.registry_client import RegistryClient

    base_config = read_base_config(base_dir)
    base_hash = await asyncio.to_thread(base_model_hash, base_dir)
    specs = synth_specs(count, ranks, targets, seed)
    adapters: dict[str, str] = {}
    alias_map: dict[str, str] = {}
    created = 0
    nbytes = 0
    api_key = None
    sem = asyncio.Semaphore(concurrency)
    async with RegistryClient(registry_url, admin_token, timeout=120.0) as reg:
        if tenant not in {t["tenant_id"] for t in await reg.list_tenants()}:
            api_key = (await reg.create_tenant(tenant))["api_key"]
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="lorafarm-synth-") as tmp, tqdm(
            total=count, desc="synth adapters", unit="adapter", disable=not progress
        ) as bar:

            async def one(spec: SynthSpec) -> None:
                nonlocal created, nbytes
                async with sem:
                    folder = Path(tmp) / spec.name
                    await asyncio.to_thread(write_synth_adapter, base_config, spec, folder, str(base_dir))
                    nbytes += sum(f.stat().st_size for f in folder.iterdir())
                    alias = f"{tenant}/{spec.name}:prod" if aliases else None
                    out = await reg.upload_adapter(folder, tenant, alias=alias, base_model=base_hash,
                                                   base_model_hash=base_hash)  # trained on: the served base
                    for f in folder.iterdir():
                        f.unlink()
                    folder.rmdir()
                adapters[spec.name] = out["adapter_id"]
                created += bool(out.get("created", True))
                if alias:
                    alias_map[alias] = out["adapter_id"]
                bar.update(1)

            tasks = [asyncio.create_task(one(s)) for s in specs]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        seconds = time.perf_counter() - start
        all_adapters = await reg.list_adapters()
        all_aliases = await reg.list_aliases()
    return SynthResult(
        adapters=dict(sorted(adapters.items())),
        aliases=dict(sorted(alias_map.items())),
        created=created,
        seconds=seconds,
        bytes=nbytes,
        tenant_adapters=sum(a.get("tenant_id") == tenant for a in all_adapters),
        registry_adapters=len(all_adapters),
        registry_aliases=len(all_aliases),
        api_key=api_key,
    )
