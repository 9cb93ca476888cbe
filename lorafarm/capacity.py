"""Capacity arithmetic of a multi-LoRA fleet: the seed's sizing study as code (pure, no I/O).

Every input is a dataclass field with the seed's value as default (7B Llama shapes, rank 16 on
attention + MLP, an 80 GB GPU, 5,000 adapters at 40 req/s, 750 prompt + 250 output tokens).

The math (h = hidden, m = MLP width, q = heads x head_dim, v = kv_heads x head_dim, L = layers):
- LoRA values per matrix W[d, k] at rank r: r x (k + d). Per layer: q_proj r(h+q), k_proj and
  v_proj r(h+v), o_proj r(q+h), each MLP matrix r(h+m). Adapter values = L x that; bytes = x dtype.
- KV bytes per token = 2 (K and V) x L x v x dtype bytes; total = x batch x max tokens per request.
- GPU left for adapters = memory - base - KV total - working memory; adapters that fit = left /
  adapter bytes; the slot cache is capped (the seed's 250).
- Decode replicas = rate x output tokens / (batch / s per token); prefill replicas = rate x prompt
  tokens / prefill tokens per s; replicas = ceil((decode + prefill) x (1 + headroom)).
- Placements = adapters x owners; per replica = ceil(placements / replicas), host RAM = that x bytes.
- Load time of one adapter from a tier = bytes / tier bandwidth; the base = base bytes / its bandwidth.
- Cost per hour = replicas x GPU price; per million tokens = cost per hour / (tokens per hour / 1e6),
  against one GPU per customer (adapters x price).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

GB = 1e9  # the seed's units are decimal: 80 MB, 33.6 GB
MB = 1e6


@dataclass(frozen=True)
class ModelDims:
    layers: int = field(default=32, metadata={"help": "decoder layers"})
    hidden: int = field(default=4096, metadata={"help": "hidden size"})
    intermediate: int = field(default=11008, metadata={"help": "MLP width"})
    heads: int = field(default=32, metadata={"help": "attention heads"})
    kv_heads: int = field(default=32, metadata={"help": "key/value heads (grouped-query attention)"})
    dtype_bytes: int = field(default=2, metadata={"help": "bytes per value (2: 16-bit)"})
    base_gb: float = field(default=14.0, metadata={"help": "base weights in GPU memory, GB"})

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features k, out_features d) of every LoRA-targetable projection."""
        h, m = self.hidden, self.intermediate
        q, v = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, v), "v_proj": (h, v), "o_proj": (q, h),
                "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}

    @classmethod
    def from_hf_config(cls, cfg: dict, dtype_bytes: int = 2) -> ModelDims:
        """From a Hugging Face config.json (Llama family)."""
        return cls(layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
                   heads=cfg["num_attention_heads"],
                   kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"], dtype_bytes=dtype_bytes)


@dataclass(frozen=True)
class GpuSpec:
    gpu_memory_gb: float = field(default=80.0, metadata={"help": "GPU memory, GB"})
    working_gb: float = field(default=4.0, metadata={"help": "working memory (activations etc.), GB"})
    slot_cap: int = field(default=250, metadata={"help": "cap of the device adapter cache, adapters"})
    gpu_price_per_h: float = field(default=2.5, metadata={"help": "USD per GPU-hour"})


@dataclass(frozen=True)
class Workload:
    adapters: int = field(default=5000, metadata={"help": "adapters (customers)"})
    rank: int = field(default=16, metadata={"help": "LoRA rank"})
    targets: str = field(default="all", metadata={"help": "adapted modules: all (attention + MLP) or attn"})
    rate: float = field(default=40.0, metadata={"help": "requests per second at peak"})
    prompt_tokens: int = field(default=750, metadata={"help": "prompt tokens per request"})
    output_tokens: int = field(default=250, metadata={"help": "output tokens per request"})
    batch: int = field(default=32, metadata={"help": "requests running at once on a replica"})
    max_request_tokens: int = field(default=2000, metadata={"help": "KV tokens reserved per running request"})
    owners: int = field(default=2, metadata={"help": "owner replicas per adapter"})


@dataclass(frozen=True)
class Throughput:
    s_per_token_unmerged: float = field(default=0.05, metadata={"help": "decode step, unmerged adapters, s"})
    s_per_token_merged: float = field(default=0.04, metadata={"help": "decode step, merged weights, s"})
    prefill_tokens_per_s: float = field(default=8000.0, metadata={"help": "prefill tokens/s per GPU"})
    headroom: float = field(default=0.3, metadata={"help": "spare capacity on top of the need (0.3 = 30%%)"})
    store_mb_per_s: float = field(default=200.0, metadata={"help": "object store bandwidth, MB/s"})
    disk_mb_per_s: float = field(default=2000.0, metadata={"help": "local disk bandwidth, MB/s"})
    ram_to_gpu_mb_per_s: float = field(default=10000.0, metadata={"help": "host RAM -> GPU bandwidth, MB/s"})
    base_load_mb_per_s: float = field(default=1000.0, metadata={"help": "base model load bandwidth, MB/s"})


@dataclass(frozen=True)
class CapacityInputs:
    model: ModelDims = field(default_factory=ModelDims)
    gpu: GpuSpec = field(default_factory=GpuSpec)
    workload: Workload = field(default_factory=Workload)
    throughput: Throughput = field(default_factory=Throughput)


def target_modules(targets: str) -> tuple[str, ...]:
    if targets == "all":
        return ATTN + MLP
    if targets == "attn":
        return ATTN
    raise ValueError(f"targets must be all or attn, not {targets!r}")


def adapter_values(model: ModelDims, rank: int, modules: tuple[str, ...] = ATTN + MLP) -> int:
    """LoRA values of one adapter: L x sum over modules of r x (k + d)."""
    shapes = model.module_shapes()
    return model.layers * sum(rank * (shapes[m][0] + shapes[m][1]) for m in modules)


def adapter_bytes(model: ModelDims, rank: int, modules: tuple[str, ...] = ATTN + MLP) -> int:
    return adapter_values(model, rank, modules) * model.dtype_bytes


def kv_bytes_per_token(model: ModelDims) -> int:
    """2 (K, V) x layers x kv_heads x head_dim x dtype bytes."""
    return 2 * model.layers * model.kv_heads * model.head_dim * model.dtype_bytes


def slots_for_budget(budget_bytes: int, rank_mix: dict[int, float], model: ModelDims,
                     modules: tuple[str, ...] = ATTN + MLP) -> dict[int, int]:
    """Device slots per rank pool from a LoRA memory budget: pool r gets the share w_r / sum(w) of
    the budget, so slots_r = floor(budget x w_r / sum(w) / bytes of one rank-r slot). A pool's slot
    stack holds every targetable module, so a slot costs adapter_bytes(r) over all of them."""
    if budget_bytes < 0:
        raise ValueError("the LoRA memory budget must be >= 0")
    if not rank_mix or any(r < 1 or w < 0 for r, w in rank_mix.items()) or sum(rank_mix.values()) <= 0:
        raise ValueError(f"bad rank mix {rank_mix!r}: ranks >= 1, weights >= 0, not all zero")
    total = sum(rank_mix.values())
    return {r: int(budget_bytes * w / total // adapter_bytes(model, r, modules)) for r, w in sorted(rank_mix.items())}


def pools_bytes(pools: dict[int, int], model: ModelDims, modules: tuple[str, ...] = ATTN + MLP) -> int:
    """Device bytes of the slot stacks of `pools` {rank: slots}."""
    return sum(s * adapter_bytes(model, r, modules) for r, s in pools.items())


@dataclass(frozen=True)
class CapacityReport:
    adapter_values: int
    adapter_bytes: int
    all_adapters_bytes: int
    merged_copies_bytes: int
    kv_bytes_per_token: int
    kv_total_bytes: int
    gpu_left_bytes: float
    adapters_fit: int
    slot_cache_adapters: int
    slot_cache_bytes: int
    decode_tokens_per_s: float
    replica_decode_tokens_per_s: float
    decode_replicas: float
    prefill_tokens_per_s: float
    prefill_replicas: float
    replicas_needed: float
    replicas: int
    placements: int
    adapters_per_replica: int
    host_ram_per_replica_bytes: int
    load_s: dict[str, float]
    cost_per_h: float
    dedicated_cost_per_h: float
    cost_per_m_output_tokens: float
    cost_per_m_tokens: float
    dedicated_cost_per_m_output_tokens: float
    merged_replica_threshold_tokens_per_s: float

    def as_dict(self) -> dict:
        return asdict(self)


ZERO_OK = {"working_gb", "headroom", "base_gb", "slot_cap", "gpu_price_per_h", "rate"}


def check(inp: CapacityInputs) -> None:
    """Raise ValueError naming the first input out of range (numbers > 0; a few may be 0)."""
    for part in (inp.model, inp.gpu, inp.workload, inp.throughput):
        for f in fields(part):
            v = getattr(part, f.name)
            if isinstance(v, (int, float)) and (v < 0 or (v == 0 and f.name not in ZERO_OK)):
                raise ValueError(f"--{f.name.replace('_', '-')} must be > 0 (got {v})")
    if inp.model.hidden % inp.model.heads:
        raise ValueError("--hidden must be a multiple of --heads")
    target_modules(inp.workload.targets)


def compute(inp: CapacityInputs = CapacityInputs()) -> CapacityReport:
    """The seed's arithmetic, in the seed's order (see the module docstring)."""
    m, g, w, t = inp.model, inp.gpu, inp.workload, inp.throughput
    check(inp)
    mods = target_modules(w.targets)
    values = adapter_values(m, w.rank, mods)
    nbytes = values * m.dtype_bytes
    kv_tok = kv_bytes_per_token(m)
    kv_total = kv_tok * w.batch * w.max_request_tokens
    left = g.gpu_memory_gb * GB - m.base_gb * GB - kv_total - g.working_gb * GB
    fit = max(0, int(left // nbytes))
    cache = min(fit, g.slot_cap)
    decode_need = w.rate * w.output_tokens
    per_replica = w.batch / t.s_per_token_unmerged
    decode_r = decode_need / per_replica
    prefill_need = w.rate * w.prompt_tokens
    prefill_r = prefill_need / t.prefill_tokens_per_s
    need = decode_r + prefill_r
    replicas = max(1, math.ceil(need * (1 + t.headroom) - 1e-9))
    placements = w.adapters * min(w.owners, replicas)
    per_rep = math.ceil(placements / replicas)
    load = {
        "gpu": 0.0,
        "ram": nbytes / (t.ram_to_gpu_mb_per_s * MB),
        "disk": nbytes / (t.disk_mb_per_s * MB),
        "remote": nbytes / (t.store_mb_per_s * MB),
        "base": m.base_gb * GB / (t.base_load_mb_per_s * MB),
    }
    cost = replicas * g.gpu_price_per_h
    dedicated = w.adapters * g.gpu_price_per_h
    out_per_h = decode_need * 3600 / 1e6
    all_per_h = (decode_need + prefill_need) * 3600 / 1e6
    return CapacityReport(
        adapter_values=values,
        adapter_bytes=nbytes,
        all_adapters_bytes=nbytes * w.adapters,
        merged_copies_bytes=int(m.base_gb * GB) * w.adapters,
        kv_bytes_per_token=kv_tok,
        kv_total_bytes=kv_total,
        gpu_left_bytes=left,
        adapters_fit=fit,
        slot_cache_adapters=cache,
        slot_cache_bytes=cache * nbytes,
        decode_tokens_per_s=decode_need,
        replica_decode_tokens_per_s=per_replica,
        decode_replicas=decode_r,
        prefill_tokens_per_s=prefill_need,
        prefill_replicas=prefill_r,
        replicas_needed=need,
        replicas=replicas,
        placements=placements,
        adapters_per_replica=per_rep,
        host_ram_per_replica_bytes=per_rep * nbytes,
        load_s=load,
        cost_per_h=cost,
        dedicated_cost_per_h=dedicated,
        cost_per_m_output_tokens=cost / out_per_h if out_per_h else math.inf,
        cost_per_m_tokens=cost / all_per_h if all_per_h else math.inf,
        dedicated_cost_per_m_output_tokens=dedicated / out_per_h if out_per_h else math.inf,
        merged_replica_threshold_tokens_per_s=per_replica,
    )


def replica_memory_bytes(model: ModelDims, pools: dict[int, int], *, kv_cache_bytes: int, working_gb: float,
                         modules: tuple[str, ...] = ATTN + MLP) -> float:
    """Device memory of one replica: base + KV cache + slot stacks + working memory."""
    return model.base_gb * GB + kv_cache_bytes + pools_bytes(pools, model, modules) + working_gb * GB


def rows(r: CapacityReport, inp: CapacityInputs) -> list[tuple[str, str, str]]:
    """(quantity, value, how) lines for the table."""
    w, g = inp.workload, inp.gpu

    def gb(x: float) -> str:
        return f"{x / GB:,.1f} GB"

    return [
        ("adapter values", f"{r.adapter_values:,}", f"rank {w.rank}, {w.targets} modules, {inp.model.layers} layers"),
        ("adapter bytes", f"{r.adapter_bytes / MB:,.0f} MB", f"{inp.model.dtype_bytes} bytes per value"),
        ("all adapters", f"{r.all_adapters_bytes / GB:,.0f} GB", f"{w.adapters:,} adapters"),
        ("merged copies", f"{r.merged_copies_bytes / 1e12:,.0f} TB", "one full base copy per adapter"),
        ("KV bytes per token", f"{r.kv_bytes_per_token:,}", "2 x layers x kv width x dtype"),
        ("KV cache", gb(r.kv_total_bytes), f"{w.batch} requests x {w.max_request_tokens:,} tokens"),
        ("GPU left for adapters", gb(r.gpu_left_bytes), f"{g.gpu_memory_gb:g} - base - KV - {g.working_gb:g} working"),
        ("adapters that fit", f"{r.adapters_fit:,}", f"capped at {g.slot_cap}: {r.slot_cache_adapters} slots, "
                                                      f"{gb(r.slot_cache_bytes)}"),
        ("decode replicas", f"{r.decode_replicas:.1f}", f"{r.decode_tokens_per_s:,.0f} tok/s / "
                                                      f"{r.replica_decode_tokens_per_s:,.0f} per replica"),
        ("prefill replicas", f"{r.prefill_replicas:.1f}", f"{r.prefill_tokens_per_s:,.0f} tok/s / "
                                                        f"{inp.throughput.prefill_tokens_per_s:,.0f} per GPU"),
        ("replicas", f"{r.replicas}", f"{r.replicas_needed:.1f} x (1 + {inp.throughput.headroom:g}) rounded up"),
        ("placements", f"{r.placements:,}", f"{w.owners} owners per adapter"),
        ("adapters per replica", f"{r.adapters_per_replica:,}", f"host RAM {r.host_ram_per_replica_bytes / GB:,.0f} GB"),
        ("load: RAM -> GPU", f"{r.load_s['ram'] * 1000:,.0f} ms", ""),
        ("load: disk", f"{r.load_s['disk'] * 1000:,.0f} ms", ""),
        ("load: object store", f"{r.load_s['remote']:,.2f} s", ""),
        ("load: base model", f"{r.load_s['base']:,.0f} s", ""),
        ("cost per hour", f"{r.cost_per_h:,.0f} USD", f"vs {r.dedicated_cost_per_h:,.0f} USD, one GPU per customer"),
        ("cost per M output tokens", f"{r.cost_per_m_output_tokens:,.2f} USD",
         f"vs {r.dedicated_cost_per_m_output_tokens:,.0f} USD dedicated; {r.cost_per_m_tokens:,.2f} USD per M "
         f"prompt+output tokens"),
        ("merged replica above", f"{r.merged_replica_threshold_tokens_per_s:,.0f} tok/s", "one customer's traffic"),
    ]


SECTIONS = {"model": ModelDims, "gpu": GpuSpec, "workload": Workload, "throughput": Throughput}


def add_flags(parser) -> None:
    """One `--flag` per input field (underscores become dashes), defaults from the dataclasses."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in fields(cls):
            group.add_argument("--" + f.name.replace("_", "-"), dest=f"{section}__{f.name}", type=type(f.default),
                               default=f.default, help=f"{f.metadata.get('help', '')} (default {f.default})")


def inputs_from_args(args) -> CapacityInputs:
    parts = {}
    for section, cls in SECTIONS.items():
        parts[section] = cls(**{f.name: getattr(args, f"{section}__{f.name}") for f in fields(cls)})
    return CapacityInputs(**parts)
