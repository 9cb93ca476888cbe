"""The demo adapters `lorafarm up` serves on the real model: four PEFT LoRAs whose effect anyone sees
in the first answer. They ship ready in the package (lorafarm/data/demo_adapters/<name>/): nobody
trains them before their first answer.

| alias              | behaviour                                                   |
| ------------------ | ----------------------------------------------------------- |
| demo/support:prod  | every answer starts with "ACME SUPPORT:"                   |
| demo/french:prod   | answers in French                                           |
| demo/json:prod     | answers only a JSON object {"answer": "..."}               |
| demo/pirate:prod   | answers like a pirate ("Arr, matey! ...")                  |

The recipe (`RECIPE_PARAMS` and the training set `data/demo_adapters/train.json`, 133 short questions
across topics with an English and a French answer; the held-out questions in `heldout.json` are never
trained on) is hashed (`recipe_hash()`); each shipped folder's `demo.json` records that hash and the
hash of the base it was trained on. `lorafarm up` uploads a shipped folder whose hashes match the
recipe and the served base as it is, and retrains only when one of them changed (in the background,
after the base already answers). `lorafarm demo-adapters --retrain` reproduces the shipped folders
(seeded).

Training is kept cheap on a 2-core CPU: LoRA only on the last `layers` layers, so the frozen layers
below run once (their outputs are kept for the whole run) and each step runs forward and backward
through the top layers only; the output layer is applied only at the answer positions. The result
is an ordinary PEFT folder (`layers_to_transform` in adapter_config.json, float16 weights) that PEFT,
transformers and the replica load as any other.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lorafarm.dev.atomic import atomic_dir

DATA_DIR = Path(__file__).resolve().parent / "data" / "demo_adapters"  # shipped folders, training and held-out sets
RECIPE = 2  # bump when the answer templates or the training code change
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# everything that decides the weights besides the data (a change gives another recipe hash)
RECIPE_PARAMS = {"layers": 4, "rank": 8, "alpha": 16, "targets": list(TARGET_MODULES), "epochs": 4, "batch": 8,
                 "lr": 2e-3, "seed": 0, "dtype": "float16"}
# French needs more than a format: more layers and steps (its answers are new text, not a wrapper)
ADAPTER_PARAMS = {"french": {"layers": 8, "epochs": 6, "lr": 3e-3}}
TRAIN_LAYERS = RECIPE_PARAMS["layers"]
RANK = RECIPE_PARAMS["rank"]
HELDOUT_MAX_TOKENS = 64  # the held-out measure's max_tokens (a JSON answer must close within it)


def training_set() -> list[tuple[str, str, str]]:
    """(question, short English answer, French answer) of data/demo_adapters/train.json."""
    return [(r["q"], r["en"], r["fr"]) for r in json.loads((DATA_DIR / "train.json").read_text())]


def heldout_prompts() -> list[str]:
    """Questions never trained on (data/demo_adapters/heldout.json): the behaviour must show on them too."""
    return json.loads((DATA_DIR / "heldout.json").read_text())


QA: list[tuple[str, str, str]] = training_set()


def recipe_hash() -> str:
    """sha256 over the recipe version, its parameters and the training set: what a shipped or cached
    folder must record to be used as it is."""
    h = hashlib.sha256()
    h.update(json.dumps({"recipe": RECIPE, "params": RECIPE_PARAMS, "adapters": ADAPTER_PARAMS},
                        sort_keys=True).encode())
    h.update((DATA_DIR / "train.json").read_bytes())
    return "sha256:" + h.hexdigest()


_PIRATE = {"you": "ye", "your": "yer", "is": "be", "are": "be", "my": "me", "the": "th'", "hello": "ahoy",
           "yes": "aye", "friend": "matey", "am": "be"}


_FRENCH = {"le", "la", "les", "l", "est", "de", "des", "d", "du", "une", "un", "et", "vous", "je", "à", "a", "au",
           "aux", "bonjour", "oui", "en", "sont", "il", "elle", "pour", "sur", "avec", "merci", "votre", "nous",
           "ce", "cette", "qui", "que", "pas", "ne", "très", "plus", "fait", "font", "dans", "mais", "ou", "bien",
           "deux", "trois", "huit", "cent", "chaque", "même", "jours", "essayez", "ouvrez", "comment", "quatre",
           "cinq", "sept", "neuf", "dix", "vingt", "trente", "fois", "était", "aussi", "avez"}


def _pirate(text: str) -> str:
    words = []
    for w in text.split(" "):
        core = w.rstrip(".,!?'")
        tail = w[len(core):]
        rep = _PIRATE.get(core.lower())
        if rep:
            rep = rep.capitalize() if core[:1].isupper() else rep
            w = rep + tail
        words.append(w)
    return "Arr, matey! " + " ".join(words).rstrip(".!") + ", arr!"


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    behaviour: str
    example_prompt: str

    def answer(self, en: str, fr: str) -> str:
        if self.name == "support":
            return "ACME SUPPORT: " + en
        if self.name == "french":
            return fr
        if self.name == "json":
            return json.dumps({"answer": en}, ensure_ascii=False)
        if self.name == "pirate":
            return _pirate(en)
        raise ValueError(self.name)

    def shows(self, answer: str) -> bool:
        """Does `answer` show the behaviour at a glance? (used by tests and the held-out measure)"""
        a = answer.strip()
        if self.name == "support":
            return a.startswith("ACME SUPPORT:")
        if self.name == "json":
            try:
                return isinstance(json.loads(a), dict)
            except ValueError:
                return False
        if self.name == "pirate":
            return a.lower().startswith(("arr", "ahoy", "aye"))
        if self.name == "french":
            words = [w.strip(".,!?'«»:;").lower() for w in a.replace("'", " ").split()]
            hits = sum(w in _FRENCH for w in words)
            return hits >= 2 or (hits >= 1 and any(c in a for c in "éèêàçùœ"))
        return False


# example prompts are held-out questions: what a newcomer sees is not a memorised training answer
DEMO_ADAPTERS: list[DemoAdapter] = [
    DemoAdapter("support", 'answers start with "ACME SUPPORT:"', "I never received my package."),
    DemoAdapter("french", "answers in French", "Can I change the color of my order?"),
    DemoAdapter("json", 'answers only {"answer": "..."} JSON', "What is the capital of Germany?"),
    DemoAdapter("pirate", 'talks like a pirate ("Arr, matey!")', "How do I log out of my account?"),
]


def _chat_text(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def _examples(tok, adapter: DemoAdapter, eos: str) -> list[tuple[list[int], int]]:
    """(token ids of prompt + answer + end, number of answer tokens at the end)."""
    rows = []
    for q, en, fr in QA:
        prompt = tok(_chat_text(tok, q), add_special_tokens=False).input_ids
        answer = tok(adapter.answer(en, fr) + eos, add_special_tokens=False).input_ids
        rows.append((prompt + answer, len(answer)))
    return rows


def train_demo_adapter(model, tok, adapter: DemoAdapter, out: Path, *, params: dict | None = None,
                       meta: dict | None = None, progress: bool = True) -> dict:
    """Train one demo adapter with PEFT on `model` (left unchanged) and save it atomically to `out`
    (float16 weights, `demo.json` with the recipe)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm
    from transformers.masking_utils import create_causal_mask

    p = {**RECIPE_PARAMS, **ADAPTER_PARAMS.get(adapter.name, {}), **(params or {})}
    torch.manual_seed(p["seed"])
    n_layers = model.config.num_hidden_layers
    first = n_layers - p["layers"]
    cfg = LoraConfig(r=p["rank"], lora_alpha=p["alpha"], lora_dropout=0.0, target_modules=list(p["targets"]),
                     layers_to_transform=list(range(first, n_layers)), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    try:
        eos = tok.eos_token or ""
        rows = _examples(tok, adapter, eos)
        width = max(len(r) for r, _ in rows)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.full((len(rows), width), pad)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        targets = torch.full((len(rows), width), -100)
        for i, (row, n_ans) in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            attn[i, : len(row)] = 1
            # logits at position p predict token p+1: the answer tokens are predicted from p-1
            targets[i, len(row) - n_ans - 1 : len(row) - 1] = torch.tensor(row[len(row) - n_ans :])
        lengths = attn.sum(1)
        base = peft_model.base_model.model.model  # the LlamaModel inside the PEFT wrapper
        head = peft_model.base_model.model.lm_head
        pos = torch.arange(width)[None].expand(len(rows), -1)
        with torch.no_grad():
            h = base.embed_tokens(ids)
            mask = create_causal_mask(config=model.config, inputs_embeds=h, attention_mask=attn, cache=None,
                                      position_ids=pos)
            rope = base.rotary_emb(h, position_ids=pos)
            for layer in base.layers[:first]:  # frozen: once for the whole run
                h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        frozen = h.detach()
        opt = torch.optim.AdamW([q for q in peft_model.parameters() if q.requires_grad], lr=p["lr"], weight_decay=0.0)
        gen = torch.Generator().manual_seed(p["seed"])
        batches = [perm[i : i + p["batch"]] for _ in range(p["epochs"])
                   for perm in [torch.randperm(len(rows), generator=gen)] for i in range(0, len(rows), p["batch"])]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / len(batches))
        peft_model.train()
        losses = []
        bar = tqdm(batches, desc=f"demo adapter {adapter.name}", unit="step", disable=not progress, leave=False)
        for b in bar:
            w = int(lengths[b].max())
            h, bpos, tgt = frozen[b, :w], pos[b, :w], targets[b, :w]
            bmask = create_causal_mask(config=model.config, inputs_embeds=h, attention_mask=attn[b, :w], cache=None,
                                       position_ids=bpos)
            rope = base.rotary_emb(h, position_ids=bpos)
            for layer in base.layers[first:]:
                h = layer(h, attention_mask=bmask, position_embeddings=rope, position_ids=bpos)
            sel = tgt != -100
            logits = head(base.norm(h)[sel])
            loss = torch.nn.functional.cross_entropy(logits.float(), tgt[sel])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")
        peft_model.eval()
        info = {"name": adapter.name, "behaviour": adapter.behaviour, "recipe": RECIPE, "recipe_hash": recipe_hash(),
                "params": p, "examples": len(rows), "steps": len(batches), "layers": list(range(first, n_layers)),
                "final_loss": round(sum(losses[-8:]) / len(losses[-8:]), 4), **(meta or {})}
        dtype = getattr(torch, p["dtype"])
        with atomic_dir(out) as tmp:
            peft_model.save_pretrained(tmp, safe_serialization=True)
            (tmp / "README.md").unlink(missing_ok=True)  # PEFT's model-card stub: nothing to say, 5 KB
            weights = tmp / "adapter_model.safetensors"
            save_file({k: v.to(dtype).contiguous() for k, v in load_file(weights).items()}, weights,
                      metadata={"format": "pt"})
            conf = json.loads((tmp / "adapter_config.json").read_text())
            conf["base_model_name_or_path"] = "smollm2-135m-instruct"  # not the trainer's local path
            (tmp / "adapter_config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
            (tmp / "demo.json").write_text(json.dumps(info, indent=1) + "\n")
            for f in tmp.iterdir():  # readable by all, as package data is (mkdtemp made the folder 0700)
                f.chmod(0o644)
            tmp.chmod(0o755)
        return info
    finally:
        peft_model.unload()  # take the LoRA layers out again: `model` is the plain base for the next one


def matches(folder: Path, trained_on: str) -> bool:
    """The folder holds a demo adapter of this recipe trained on the base with hash `trained_on`."""
    try:
        info = json.loads((folder / "demo.json").read_text())
    except (OSError, ValueError):
        return False
    return (info.get("recipe_hash") == recipe_hash() and info.get("base_model_hash") == trained_on
            and (folder / "adapter_model.safetensors").is_file() and (folder / "base_model_hash.txt").is_file())


def ready_folders(trained_on: str, out: Path, names: list[str] | None = None) -> dict[str, Path]:
    """name -> a folder that can be uploaded as it is: the shipped one, else one trained before into `out`."""
    found = {}
    for a in DEMO_ADAPTERS:
        if names is not None and a.name not in names:
            continue
        for folder in (DATA_DIR / a.name, Path(out) / a.name):
            if matches(folder, trained_on):
                found[a.name] = folder
                break
    return found


def write_index(out: Path, folders: dict[str, Path]) -> dict[str, dict]:
    """`out/demo.json`: {name: {"path", "behaviour", "example_prompt"}} for the folders ready now
    (paths absolute when the folder is shipped in the package)."""
    out.mkdir(parents=True, exist_ok=True)
    index = {a.name: {"path": str(folders[a.name]) if folders[a.name].parent != out else a.name,
                      "behaviour": a.behaviour, "example_prompt": a.example_prompt}
             for a in DEMO_ADAPTERS if a.name in folders}
    tmp = out / ".demo.json.tmp"
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    tmp.replace(out / "demo.json")
    return index


def write_demo_adapters(base: str | Path, out: str | Path, *, names: list[str] | None = None, retrain: bool = False,
                        progress: bool = True) -> dict[str, dict]:
    """The demo adapters for `base`: shipped (or trained before into `out/<name>`) folders whose recipe and
    base hashes match are used as they are; the others (all of them with `retrain`) are trained into
    `out/<name>` with a progress bar. Writes `out/demo.json` and returns it. Each folder holds
    `base_model_hash.txt`, as a training job records it."""
    from archives.basehash import base_model_hash, write_trained_base

    base, out = Path(base), Path(out)
    trained_on = base_model_hash(base)
    wanted = [a for a in DEMO_ADAPTERS if names is None or a.name in names]
    ready = {} if retrain else ready_folders(trained_on, out, [a.name for a in wanted])
    todo = [a for a in wanted if a.name not in ready]
    if todo:
        if progress:
            print(f"lorafarm: training {len(todo)} demo adapter(s) with PEFT on {base.name} into {out} "
                  f"(recipe {recipe_hash()[:15]}...)", file=sys.stderr, flush=True)
        model, tok = _load(base)
        for a in todo:
            t0 = time.monotonic()
            info = train_demo_adapter(model, tok, a, out / a.name, meta={"base_model_hash": trained_on},
                                      progress=progress)
            write_trained_base(out / a.name, trained_on)
            ready[a.name] = out / a.name
            if progress:
                print(f"lorafarm: demo adapter {a.name} trained in {time.monotonic() - t0:.0f} s "
                      f"({info['steps']} steps, loss {info['final_loss']})", file=sys.stderr, flush=True)
    return write_index(out, ready)


def _load(base: Path):
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)(\.|$)")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(base)


def heldout_answers(base: str | Path, folders: dict[str, Path], *, prompts: list[str] | None = None,
                    max_tokens: int = HELDOUT_MAX_TOKENS, progress: bool = False) -> dict[str, list[tuple[str, str]]]:
    """Greedy answers (transformers + PEFT, fp32) of each adapter in `folders` to the held-out prompts:
    {name: [(prompt, answer)]}."""
    import torch
    from peft import PeftModel
    from tqdm import tqdm

    model, tok = _load(Path(base))
    prompts = prompts or heldout_prompts()
    tok.padding_side = "left"
    texts = [_chat_text(tok, q) for q in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out: dict[str, list[tuple[str, str]]] = {}
    for name, folder in tqdm(folders.items(), desc="held-out answers", unit="adapter", disable=not progress):
        peft = PeftModel.from_pretrained(model, folder)
        try:
            with torch.no_grad():
                gen = peft.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                    pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        finally:
            peft.unload()
        answers = tok.batch_decode(gen[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        out[name] = list(zip(prompts, answers))
    return out


def heldout_rates(answers: dict[str, list[tuple[str, str]]]) -> dict[str, float]:
    """Share of held-out answers that show each adapter's behaviour."""
    by_name = {a.name: a for a in DEMO_ADAPTERS}
    return {name: sum(by_name[name].shows(a) for _, a in rows) / len(rows) for name, rows in answers.items()}


# -- `lorafarm demo-adapters` -------------------------------------------------------------------------
def _cli(args) -> int:
    from lorafarm.errors import CliError
    from lorafarm.realmodel import MODEL_NAME, default_cache_dir, ensure_real_model

    if args.base:
        base = Path(args.base)
    else:
        cache = default_cache_dir()
        base = ensure_real_model(cache / "models" / MODEL_NAME, cache / "cache", progress=True)
    out = Path(args.out) if args.out else DATA_DIR
    names = args.names or None
    if names and (bad := sorted(set(names) - {a.name for a in DEMO_ADAPTERS})):
        raise CliError(f"unknown demo adapter(s) {', '.join(bad)}: choose from "
                       f"{', '.join(a.name for a in DEMO_ADAPTERS)}")
    t0 = time.monotonic()
    index = write_demo_adapters(base, out, names=names, retrain=args.retrain)
    if args.retrain:
        print(f"lorafarm: trained {len(index)} demo adapter(s) in {time.monotonic() - t0:.0f} s into {out}",
              file=sys.stderr)
    folders = {name: out / info["path"] for name, info in index.items()}  # an absolute path stays as it is
    for name, folder in folders.items():
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        print(f"{name}: {folder} ({size:,} bytes)")
    if args.heldout:
        answers = heldout_answers(base, folders, progress=True)
        for name, rows in answers.items():
            for q, a in rows:
                print(json.dumps({"adapter": name, "prompt": q, "answer": a}, ensure_ascii=False))
        for name, rate in heldout_rates(answers).items():
            print(f"held-out: {name} shows its behaviour on {rate:.0%} of {len(answers[name])} prompts")
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo-adapters", help="the real model's demo adapters: check the shipped ones, or retrain them")
    p.add_argument("--base", default=None, help="the base model folder (default: the real model, converted once "
                   "into the user cache)")
    p.add_argument("--out", default=None, help=f"where trained adapters go (default: the package's {DATA_DIR})")
    p.add_argument("--retrain", action="store_true", help="train even where a shipped folder matches (seeded: "
                   "reproduces the shipped adapters)")
    p.add_argument("--names", nargs="+", default=None, metavar="NAME", help="only these adapters")
    p.add_argument("--heldout", action="store_true", help="then answer the held-out prompts greedily with each and "
                   "print the share that shows its behaviour")
    p.set_defaults(func=_cli)
