"""Byte-level tokenizer for the dev model, built offline with the `tokenizers` library.

Every byte is a token, so any text round-trips without an unknown token; a handful of merges
learned from a fixed corpus keep sequences a little shorter, as real BPE vocabularies do.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "<|begin|>"
EOS = "<|end|>"
PAD = "<|pad|>"
START = "<|start|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START]

# A role header, the message, then EOS: the assistant's answer ends with the same EOS token
# that generation stops on.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "how do I reset my password? please help me with my account",
    "what is the status of my order and when will it arrive",
    "summarise this support ticket for the customer success team",
    "user assistant system hello thanks please question answer",
    "translate the following sentence into french and german",
    "0123456789 <<c0000>> <<c0001>> markers and numbers",
]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A deterministic byte-level BPE tokenizer with `vocab_size` entries (specials included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok
