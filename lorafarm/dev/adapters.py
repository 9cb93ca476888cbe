"""Canary adapters: LoRA adapters trained with PEFT on the dev model, each answering any chat
prompt with its own marker (`<<c0007>>`) then EOS under greedy decoding.

They are the fixtures of every correctness and isolation check: a wrong marker in an answer means
a request was served with another adapter's weights. Rank and target modules vary across the set
so rank pools and partial-module adapters are exercised. Each canary is cached under the output
folder by a content key (base weights, index, rank, modules, recipe), so a second run, or a larger
`--count` over the same folder, trains only what is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from lorafarm.dev.atomic import atomic_dir
from lorafarm.errors import CliError

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODULE_SETS = {
    "all": ALL_MODULES,
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
}
RANKS = (8, 16, 32)
RECIPE_VERSION = 2  # bump when the training recipe changes: invalidates cached canaries

# A canary is verified on these prompts when it is made: every one must answer exactly its marker
# then EOS, each token ahead of the runner-up by MARGIN logits (teacher-forced, PEFT itself). The
# seeds are the prompt sets the checks draw from (tests, `make isolation`, the production probe), so
# a check can never meet a prompt on which the canary itself is unsure. Training alone is not
# enough: it is deterministic on one CPU but not across CPUs (one canary trained on an AMD EPYC box
# answered `<<c0011>>00>>` to one prompt of 64 in PEFT itself).
CHECK_PROMPT_SEEDS = ((99, 64), (11, 200), (424242, 3), (7070, 64))
MARGIN = 2.0
MAX_ROUNDS = 12  # extra training rounds on the prompts that fail the check

_WORDS = (
    "account order refund password invoice shipping delivery status error login help please "
    "why how what when where can you my the a is of for with support billing plan upgrade cancel "
    "hello thanks question report summary update price product email phone address today"
).split()


@dataclass(frozen=True)
class CanarySpec:
    index: int
    marker: str
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    module_set: str


def marker_for(index: int) -> str:
    return f"<<c{index:04d}>>"


def canary_spec(index: int, rank: int | None = None) -> CanarySpec:
    r = rank if rank is not None else RANKS[index % len(RANKS)]
    module_set = list(MODULE_SETS)[(index // len(RANKS)) % len(MODULE_SETS)]
    return CanarySpec(index, marker_for(index), r, 2 * r, tuple(MODULE_SETS[module_set]), module_set)


def random_prompts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12))) for _ in range(count)]


def check_prompts() -> list[str]:
    """The prompts every canary is verified on (see CHECK_PROMPT_SEEDS)."""
    out: list[str] = []
    for seed, count in CHECK_PROMPT_SEEDS:
        out += random_prompts(seed=seed, count=count)
    return list(dict.fromkeys(out + ["Something never seen: 42?"]))


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def base_fingerprint(base: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        p = base / name
        if not p.exists():
            raise CliError(f"--base {base} is not a dev model folder (no {name})")
        h.update(name.encode() + _file_digest(p).encode())
    return h.hexdigest()


def _cache_key(base_fp: str, spec: CanarySpec) -> str:
    blob = json.dumps({"base": base_fp, "spec": asdict(spec), "recipe": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def _load_base(base: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(base), AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)


def _batch(rows: list[list[int]], target_len: int, pad: int):
    """Right-padded input ids, attention mask and labels (only the last `target_len` tokens)."""
    import torch

    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        labels[i, len(row) - target_len : len(row)] = torch.tensor(row[len(row) - target_len :])
    return input_ids, attention, labels


def marker_margins(model, tokenizer, marker: str, prompts: list[str], chunk: int = 64) -> list[float]:
    """Per prompt, the smallest logit lead of the marker's next token over the runner-up, over every
    token of `marker` + EOS, teacher-forced. Positive everywhere = greedy decoding answers exactly
    the marker then stops; the size is how much arithmetic noise it can take."""
    import torch

    target = tokenizer.encode(marker, add_special_tokens=False) + [tokenizer.eos_token_id]
    out: list[float] = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(prompts), chunk):
            rows = [_chat_ids(tokenizer, p) + target for p in prompts[start : start + chunk]]
            input_ids, attention, labels = _batch(rows, len(target), tokenizer.pad_token_id)
            logits = model(input_ids=input_ids, attention_mask=attention).logits.float()
            for i, row in enumerate(rows):
                pos = torch.arange(len(row) - len(target) - 1, len(row) - 1)  # logits predicting target
                lg = logits[i, pos]
                want = torch.tensor(target)
                chosen = lg.gather(1, want[:, None])[:, 0]
                rest = lg.scatter(1, want[:, None], float("-inf")).max(dim=1).values
                out.append(float((chosen - rest).min()))
    return out


def train_canary(base_model, tokenizer, spec: CanarySpec, out: Path, steps: int = 60, lr: float = 3e-3) -> None:
    """Train one canary with PEFT on a copy of `base_model`, verify it on `check_prompts()` and save
    it (PEFT layout) atomically to `out`.

    `steps` on 16 random prompts, then rounds of 20 steps that add the check prompts whose margin is
    below MARGIN to the training set, until none is (at most MAX_ROUNDS; else a CliError naming the
    prompt, so a bad canary is never cached).
    """
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1000 + spec.index)
    peft_model = get_peft_model(
        copy.deepcopy(base_model),
        LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=list(spec.target_modules),
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        ),
    )
    target = tokenizer.encode(spec.marker, add_special_tokens=False) + [tokenizer.eos_token_id]
    train_prompts = random_prompts(seed=spec.index, count=16)
    checks = check_prompts()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)

    def fit(n: int) -> float:
        rows = [_chat_ids(tokenizer, p) + target for p in train_prompts]
        input_ids, attention, labels = _batch(rows, len(target), tokenizer.pad_token_id)
        peft_model.train()
        for _ in range(n):
            loss = peft_model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item()

    loss = fit(steps)
    rounds = 0
    while True:
        margins = marker_margins(peft_model, tokenizer, spec.marker, checks)
        weak = [p for p, m in zip(checks, margins) if m < MARGIN]
        if not weak:
            break
        if rounds == MAX_ROUNDS:
            worst = min(zip(margins, checks))
            raise CliError(
                f"canary {spec.marker} still below margin {MARGIN} on {len(weak)} prompts after "
                f"{rounds} extra rounds (worst {worst[0]:.2f} on {worst[1]!r})"
            )
        train_prompts += [p for p in weak if p not in train_prompts]
        loss = fit(20)
        rounds += 1

    with atomic_dir(out) as tmp:
        peft_model.save_pretrained(tmp, safe_serialization=True)
        meta = {**asdict(spec), "steps": steps + 20 * rounds, "extra_rounds": rounds, "final_loss": loss,
                "min_margin": min(margins), "check_prompts": len(checks)}
        (tmp / "canary.json").write_text(json.dumps(meta) + "\n")


@contextmanager
def _one_thread():
    """Train on one intra-op thread. A tiny model gains little from a second thread, and on a busy
    box (a test run beside stress-ng, other suites) two spinning OpenMP threads per process made a
    canary take 13 min instead of 25 s. Any thread count is fine for correctness: each canary is
    verified after training."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_dev_adapters(base: str | Path, out: str | Path, count: int, rank: int | None = None, progress=True) -> dict:
    """Train (or reuse from cache) `count` canaries under `out`; write and return `markers.json`.

    markers.json: {"c0007": {"marker": "<<c0007>>", "path": "c0007", "rank": 16, ...}}.
    """
    from tqdm import tqdm

    base, out = Path(base), Path(out)
    if count < 1:
        raise CliError("--count must be at least 1")
    if rank is not None and rank < 1:
        raise CliError("--rank must be at least 1")
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} exists and is not a directory")
    if not base.is_dir():
        raise CliError(f"--base {base} is not a directory")
    base_fp = base_fingerprint(base)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"--out {out}: {e.strerror}") from None

    from archives.basehash import TRAINED_BASE_FILE, base_model_hash, write_trained_base

    trained_on = base_model_hash(base)  # recorded beside each adapter, as a training job should
    index: dict[str, dict] = {}
    loaded = None
    for i in tqdm(range(count), desc="canary adapters", unit="adapter", disable=not progress):
        spec = canary_spec(i, rank)
        name = f"c{i:04d}"
        key = _cache_key(base_fp, spec)
        folder = out / name
        key_file = folder / "cache_key"
        if not (key_file.exists() and key_file.read_text().strip() == key):
            loaded = loaded or _load_base(base)
            with _one_thread():
                train_canary(loaded[1], loaded[0], spec, folder)
            key_file.write_text(key + "\n")
        if not (folder / TRAINED_BASE_FILE).is_file():
            write_trained_base(folder, trained_on)
        index[name] = {"path": name, **asdict(spec), "target_modules": list(spec.target_modules)}
    # markers.json never drops canaries a wider run left valid in the same folder: two processes sharing
    # a cache (a test session asking for 9, another for 32) would otherwise shrink each other's index
    i = count
    while True:
        spec = canary_spec(i, rank)
        key_file = out / f"c{i:04d}" / "cache_key"
        if not (key_file.exists() and key_file.read_text().strip() == _cache_key(base_fp, spec)):
            break
        index[f"c{i:04d}"] = {"path": f"c{i:04d}", **asdict(spec), "target_modules": list(spec.target_modules)}
        i += 1
    tmp = out / f".markers.json.{os.getpid()}.tmp"  # per process: concurrent writers never share a temp file
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out / "markers.json")
    return index
