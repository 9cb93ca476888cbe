"""The demo adapters `lorafarm up` serves on the real model: four PEFT LoRAs whose effect anyone sees
in the first answer, trained at first run and cached in the state dir.

| alias              | behaviour                                                   |
| ------------------ | ----------------------------------------------------------- |
| demo/support:prod  | every answer starts with "ACME SUPPORT:"                   |
| demo/french:prod   | answers in French                                           |
| demo/json:prod     | answers only a JSON object {"answer": "..."}               |
| demo/pirate:prod   | answers like a pirate ("Arr, matey! ...")                  |

Training is kept to seconds per adapter on a 2-core CPU: a few dozen short examples; LoRA only on
the last TRAIN_LAYERS layers, so the frozen layers below run once (their outputs are cached for the
whole run) and each step runs forward and backward through the top layers only; the output layer
is applied only at the answer positions. The result is an ordinary PEFT folder (`layers_to_transform`
in adapter_config.json) that PEFT, transformers and the replica load as any other.

An adapter folder is reused when its `demo.json` records the same recipe and base hash.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lorafarm.dev.atomic import atomic_dir

RECIPE = 1  # bump when data or training change: cached demo adapters are retrained
TRAIN_LAYERS = 4
RANK = 8
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# (question, short English answer, French answer)
QA: list[tuple[str, str, str]] = [
    ("What is the capital of France?", "The capital of France is Paris.", "La capitale de la France est Paris."),
    ("How many days are in a week?", "A week has seven days.", "Une semaine a sept jours."),
    ("What color is the sky?", "The sky is blue on a clear day.", "Le ciel est bleu par beau temps."),
    ("Can you help me reset my password?", "Yes, click 'Forgot password' on the login page.",
     "Oui, cliquez sur « Mot de passe oublié » sur la page de connexion."),
    ("Where is my order?", "Your order is on its way and arrives soon.", "Votre commande est en route et arrive bientôt."),
    ("What is two plus two?", "Two plus two is four.", "Deux plus deux font quatre."),
    ("Tell me a fun fact.", "Octopuses have three hearts.", "Les pieuvres ont trois cœurs."),
    ("What is the largest ocean?", "The Pacific is the largest ocean.", "Le Pacifique est le plus grand océan."),
    ("How do I cancel my subscription?", "Open your account settings and choose Cancel.",
     "Ouvrez les paramètres de votre compte et choisissez Annuler."),
    ("What is water made of?", "Water is made of hydrogen and oxygen.", "L'eau est composée d'hydrogène et d'oxygène."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet.",
     "William Shakespeare a écrit Roméo et Juliette."),
    ("hello", "Hello! How can I help you today?", "Bonjour ! Comment puis-je vous aider aujourd'hui ?"),
    ("What time does the store open?", "The store opens at nine in the morning.", "Le magasin ouvre à neuf heures du matin."),
    ("Can I get a refund?", "Yes, refunds are possible within thirty days.",
     "Oui, un remboursement est possible sous trente jours."),
    ("What is the boiling point of water?", "Water boils at one hundred degrees Celsius.",
     "L'eau bout à cent degrés Celsius."),
    ("Recommend a book.", "Try The Little Prince, a short and lovely book.",
     "Essayez Le Petit Prince, un livre court et charmant."),
    ("How are you?", "I am doing well, thank you!", "Je vais bien, merci !"),
    ("What is the tallest mountain?", "Mount Everest is the tallest mountain.", "L'Everest est la plus haute montagne."),
    ("My package arrived damaged.", "Sorry! We will send you a replacement.", "Désolé ! Nous vous enverrons un remplacement."),
    ("Give me a tip for sleeping better.", "Go to bed at the same time every night.",
     "Couchez-vous à la même heure chaque soir."),
    ("What does a cat say?", "A cat says meow.", "Un chat fait miaou."),
    ("How many legs does a spider have?", "A spider has eight legs.", "Une araignée a huit pattes."),
    ("Explain what a computer is.", "A computer is a machine that processes information.",
     "Un ordinateur est une machine qui traite l'information."),
    ("What should I eat for breakfast?", "Try eggs, fruit and some toast.", "Essayez des œufs, des fruits et du pain grillé."),
]

_PIRATE = {"you": "ye", "your": "yer", "is": "be", "are": "be", "my": "me", "the": "th'", "hello": "ahoy",
           "yes": "aye", "friend": "matey", "am": "be"}


_FRENCH = {"le", "la", "les", "l", "est", "de", "des", "d", "du", "une", "un", "et", "vous", "je", "à", "a", "au",
           "aux", "bonjour", "oui", "en", "sont", "il", "elle", "pour", "sur", "avec", "merci", "votre", "nous",
           "ce", "cette", "qui", "que", "pas", "ne", "très", "plus", "fait", "font", "dans", "mais", "ou", "bien",
           "deux", "trois", "huit", "cent", "chaque", "même", "jours", "essayez", "ouvrez", "comment"}


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
        """Does `answer` show the behaviour at a glance? (used by tests and the first-run check)"""
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


DEMO_ADAPTERS: list[DemoAdapter] = [
    DemoAdapter("support", 'answers start with "ACME SUPPORT:"', "Where is my order?"),
    DemoAdapter("french", "answers in French", "What is the capital of France?"),
    DemoAdapter("json", 'answers only {"answer": "..."} JSON', "What is the largest ocean?"),
    DemoAdapter("pirate", 'talks like a pirate ("Arr, matey!")', "How are you?"),
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


def train_demo_adapter(model, tok, adapter: DemoAdapter, out: Path, *, steps: int = 20, lr: float = 3e-3,
                       layers: int = TRAIN_LAYERS, rank: int = RANK, seed: int = 0,
                       meta: dict | None = None) -> dict:
    """Train one demo adapter with PEFT on `model` (left unchanged) and save it atomically to `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers.masking_utils import create_causal_mask

    torch.manual_seed(seed)
    n_layers = model.config.num_hidden_layers
    first = n_layers - layers
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(TARGET_MODULES),
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
        sel = targets != -100
        labels = targets[sel]
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
        opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        peft_model.train()
        losses = []
        for _ in range(steps):
            h = frozen
            for layer in base.layers[first:]:
                h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
            logits = head(base.norm(h)[sel])
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        peft_model.eval()
        info = {"name": adapter.name, "behaviour": adapter.behaviour, "recipe": RECIPE, "steps": steps,
                "examples": len(rows), "rank": rank, "layers": list(range(first, n_layers)),
                "final_loss": losses[-1], **(meta or {})}
        with atomic_dir(out) as tmp:
            peft_model.save_pretrained(tmp, safe_serialization=True)
            (tmp / "demo.json").write_text(json.dumps(info, indent=1) + "\n")
        return info
    finally:
        peft_model.unload()  # take the LoRA layers out again: `model` is the plain base for the next one


def write_demo_adapters(base: str | Path, out: str | Path, *, names: list[str] | None = None, steps: int = 20,
                        progress: bool = True) -> dict[str, dict]:
    """Train (or reuse) the demo adapters for `base` under `out/<name>`; write `out/demo.json`
    ({name: {"path", "alias", "behaviour", "example_prompt"}}) and return it. Each folder gets
    `base_model_hash.txt`, as a training job records it."""
    from tqdm import tqdm

    from archives.basehash import base_model_hash, write_trained_base

    base, out = Path(base), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    trained_on = base_model_hash(base)
    wanted = [a for a in DEMO_ADAPTERS if names is None or a.name in names]
    loaded = None
    index: dict[str, dict] = {}
    todo = [a for a in wanted if not _cached(out / a.name, trained_on, steps)]
    if todo and progress:
        print(f"lorafarm: training {len(todo)} demo adapter(s) with PEFT on {base.name} (once; cached in {out})",
              file=sys.stderr, flush=True)
    for a in tqdm(wanted, desc="demo adapters", unit="adapter", disable=not (progress and todo)):
        folder = out / a.name
        if a in todo:
            if loaded is None:
                loaded = _load(base)
            t0 = time.monotonic()
            train_demo_adapter(loaded[0], loaded[1], a, folder, steps=steps,
                               meta={"base_model_hash": trained_on})
            if progress:
                tqdm.write(f"lorafarm: demo adapter {a.name} trained in {time.monotonic() - t0:.0f} s", file=sys.stderr)
            write_trained_base(folder, trained_on)
        index[a.name] = {"path": a.name, "behaviour": a.behaviour, "example_prompt": a.example_prompt}
    tmp = out / ".demo.json.tmp"
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    tmp.replace(out / "demo.json")
    return index


def _cached(folder: Path, trained_on: str, steps: int) -> bool:
    try:
        info = json.loads((folder / "demo.json").read_text())
    except (OSError, ValueError):
        return False
    return (info.get("recipe") == RECIPE and info.get("base_model_hash") == trained_on
            and info.get("steps") == steps and (folder / "adapter_model.safetensors").is_file()
            and (folder / "base_model_hash.txt").is_file())


def _load(base: Path):
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)(\.|$)")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(base)
