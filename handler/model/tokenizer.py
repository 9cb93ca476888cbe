"""The model's tokenizer without transformers on the replica's start path (issue 36).

`transformers.AutoTokenizer` costs ~2 s of CPU to import (transformers' lazy module machinery pulls
in torch.distributed, torch.export, accelerate...), more than the rest of a warm start. A model folder
whose tokenizer is a plain fast tokenizer (`tokenizer.json` + a `tokenizer_config.json` that only
names special tokens and the chat template) needs none of it: `FastTokenizer` wraps the `tokenizers`
library's `Tokenizer` read from `tokenizer.json` (the very object transformers' fast tokenizer wraps,
its `backend_tokenizer`) and renders the chat template with jinja2 in the sandbox transformers uses
(`transformers.utils.chat_template_utils`: same environment options, filters and globals, same
message normalisation and special-token variables). Anything else (a slow or model-specific tokenizer
class, extra tokenizer options, several named templates, `continue_final_message`, ...) goes to
`transformers.AutoTokenizer` as before: `load_tokenizer` decides, exactness first.

tests/handler/test_start_fast.py checks token ids, decoded text and chat prompts against
AutoTokenizer on the real and the dev model.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# tokenizer classes that are the fast tokenizer itself, with no model-specific rebuild of the backend
_PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that do not change what the tokenizer produces (beside the special tokens)
_INERT = {"backend", "is_local", "local_files_only", "model_max_length", "tokenizer_class", "chat_template",
          "clean_up_tokenization_spaces", "added_tokens_decoder", "model_input_names", "padding_side",
          "truncation_side", "extra_special_tokens", "additional_special_tokens", "name_or_path", "processor_class",
          "split_special_tokens", "errors"}


def load_tokenizer(model_dir: str | Path):
    """A `FastTokenizer` when the folder's tokenizer is a plain fast tokenizer, else AutoTokenizer's."""
    model_dir = Path(model_dir)
    try:
        tok = FastTokenizer.load(model_dir)
    except _NotPlain as e:
        log.info("tokenizer through transformers (%s)", e)
        tok = None
    if tok is not None:
        return tok
    from transformers import AutoTokenizer  # lazy: slow to import; only for tokenizers FastTokenizer does not cover

    return AutoTokenizer.from_pretrained(str(model_dir))


class _NotPlain(Exception):
    """The folder's tokenizer needs transformers (the reason)."""


def _content(v) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    raise _NotPlain(f"special token {v!r}")


class FastTokenizer:
    """The subset of a transformers fast tokenizer the replica uses, on `tokenizers.Tokenizer`."""

    def __init__(self, backend, special: dict[str, str], chat_template: str | None, model_max_length=None):
        self.backend_tokenizer = backend
        self._special = special
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        for name in _SPECIAL:
            setattr(self, name, special.get(name))
            tid = backend.token_to_id(special[name]) if special.get(name) is not None else None
            setattr(self, f"{name}_id", tid)

    @classmethod
    def load(cls, model_dir: Path) -> "FastTokenizer":
        tj, tc = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
        if not tj.is_file() or not tc.is_file():
            raise _NotPlain("no tokenizer.json and tokenizer_config.json")
        if (model_dir / "chat_templates").is_dir():
            raise _NotPlain("named chat templates")
        cfg = json.loads(tc.read_text(encoding="utf-8"))
        if cfg.get("tokenizer_class") not in _PLAIN_CLASSES:
            raise _NotPlain(f"tokenizer_class {cfg.get('tokenizer_class')!r}")
        extra = set(cfg) - _INERT - set(_SPECIAL)
        if extra:
            raise _NotPlain(f"tokenizer options {sorted(extra)}")
        if cfg.get("clean_up_tokenization_spaces") or cfg.get("split_special_tokens"):
            raise _NotPlain("clean_up_tokenization_spaces / split_special_tokens")
        if cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens"):
            raise _NotPlain("extra special tokens")
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(tj))
        if backend.padding is not None or backend.truncation is not None:
            raise _NotPlain("padding or truncation in tokenizer.json")
        # transformers adds the config's added tokens missing from tokenizer.json: here they must be there already
        added = backend.get_added_tokens_decoder()
        for i, t in (cfg.get("added_tokens_decoder") or {}).items():
            have = added.get(int(i))
            if have is None or have.content != t.get("content") or bool(have.special) != bool(t.get("special")):
                raise _NotPlain(f"added token {i} not in tokenizer.json")
        special = {k: _content(cfg.get(k)) for k in _SPECIAL if cfg.get(k) is not None}
        for k, v in special.items():
            if backend.token_to_id(v) is None:
                raise _NotPlain(f"{k} {v!r} not in the vocabulary")
        template = cfg.get("chat_template")
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        elif (model_dir / "chat_template.json").is_file():
            raise _NotPlain("chat_template.json")
        if template is not None and not isinstance(template, str):
            raise _NotPlain("named chat templates")
        return cls(backend, special, template, cfg.get("model_max_length"))

    # -- what the replica calls ---------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {k: str(v) for k, v in self._special.items() if v is not None}

    @property
    def added_tokens_decoder(self):
        return self.backend_tokenizer.get_added_tokens_decoder()

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text, add_special_tokens: bool = True, **kw):
        if kw:
            raise TypeError(f"FastTokenizer.__call__ takes no {sorted(kw)}")
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        encs = self.backend_tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encs]}

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        _no_cleanup(clean_up_tokenization_spaces)
        if isinstance(ids, int):
            ids = [ids]
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, seqs, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        _no_cleanup(clean_up_tokenization_spaces)
        return self.backend_tokenizer.decode_batch([list(s) for s in seqs], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs):
        """transformers' `apply_chat_template` for one conversation (tokenize: ids without special tokens
        added, as transformers does; else the text)."""
        if kwargs.get("continue_final_message") or kwargs.get("return_assistant_tokens_mask") or \
                kwargs.get("sanitize_control_tokens"):
            raise NotImplementedError("continue_final_message / return_assistant_tokens_mask / "
                                      "sanitize_control_tokens: use transformers' tokenizer")
        for k in ("continue_final_message", "return_assistant_tokens_mask", "sanitize_control_tokens", "return_dict"):
            kwargs.pop(k, None)
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                             "template argument was passed!")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if tools is not None and any(not isinstance(t, dict) for t in tools):
            raise TypeError("FastTokenizer takes tools as JSON schemas (dicts)")
        if documents is not None and any(not isinstance(d, dict) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        chat = []
        for m in _plain(_to_dicts(conversation)):
            if not isinstance(m, dict):
                raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {m!r}.")
            m = {k: v for k, v in m.items() if v is not None}  # transformers' _normalize_chat_messages
            reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:  # transformers' _alias_reasoning_fields
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        text = _compiled(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                          add_generation_prompt=add_generation_prompt,
                                          **_plain({**self.special_tokens_map, **kwargs}))
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _no_cleanup(flag) -> None:
    if flag:
        raise NotImplementedError("clean_up_tokenization_spaces=True: use transformers' tokenizer")


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _to_dicts(value: Any) -> Any:
    """Message objects (pydantic models) to dicts, as transformers' _message_objects_to_dicts."""
    if isinstance(value, dict):
        return {k: _to_dicts(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_dicts(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _to_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """What the template may see: plain JSON types only (transformers' _plain_template_data)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=8)
def _compiled(template: str):
    """The template in the sandbox transformers renders chat templates in (its _compile_jinja_template)."""
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    class Generation(jinja2.ext.Extension):  # `{% generation %}` blocks render their body (no mask asked)
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)
