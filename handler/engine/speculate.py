"""N-gram (prompt lookup) drafts for speculative decoding on the C decode step.

A decode step reads every weight once whatever its row count (`handler/model/csrc/small_gemm.c`), so on a
CPU a step of a few rows costs little more than a step of one. A greedy request whose last tokens
occurred before in its prompt or output is given the tokens that followed them there as a draft:

    rows  = [last, d_1, ..., d_k] at positions p, p + 1, ..., p + k   (one step, one block table)
    t_i   = argmax(logits of row i)
    taken = t_0, then t_i while d_i == t_{i-1} (i = 1..k)

Row i computes exactly what an ordinary decode step at position p + i computes once d_1..d_i are its
context (every row on its own, K/V written before any row attends; `handler/model/csrc/decode_step.c`), so
the tokens taken are the tokens plain decoding gives, bit for bit: speculation changes when tokens
arrive, never which. K/V a rejected draft wrote sits past the request's length and is overwritten by
the next step before anything reads it.

Only requests whose next token depends on the logits alone are drafted for: greedy, no penalties,
no logit bias, no logprobs, no grammar. The lookup is an index of the request's own n-grams, kept up
to date as tokens arrive (no scan of the context per step).
"""

from __future__ import annotations

# Defaults from SmolLM2-135M on the 2-core dev box (docs/peers.md): a C decode step of 2 rows costs what one
# does (21 ms), 3 rows 1.25x, 4 rows 1.4x. Greedy chat answers on the peers bench's prompts and adapters take
# the one draft token 30% of the time (1.13 tokens a step); longer drafts are taken too rarely to pay for
# their rows, and beside other requests a step already has its rows.
SPECULATE_TOKENS = 1  # draft tokens per request and step (Engine speculate; replica --speculate)
SPECULATE_MAX_ROWS = 2  # rows of a step, drafts included, beyond which nothing is drafted
MAX_NGRAM = 3  # the longest suffix looked up first
MIN_NGRAM = 1


def can_draft(params, state) -> bool:
    """Is the request's next token (`handler.engine.sampling` SamplingParams, RowState) the argmax of its
    logits alone, so that a draft can be checked?"""
    return (params.greedy and not params.counts_output and not params.logit_bias and params.logprobs is None
            and state.matcher is None)


class NgramIndex:
    """Where each n-gram (MIN_NGRAM..MAX_NGRAM tokens) of a token sequence last ended with a token
    after it: `propose` continues the sequence's current suffix from its latest earlier occurrence."""

    __slots__ = ("_tokens", "_at")

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._at: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            seq = self._tokens
            seq.append(t)
            end = len(seq) - 1  # the new token follows the n-grams ending just before it
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._at[tuple(seq[end - n:end])] = end

    def sync(self, prompt: list[int], out: list[int]) -> None:
        """Index the tokens of prompt + out not yet seen (the sequence only grows)."""
        have, np_ = len(self._tokens), len(prompt)
        if have < np_:
            self.extend(prompt[have:])
            have = np_
        if have - np_ < len(out):
            self.extend(out[have - np_:])

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix (MAX_NGRAM down to MIN_NGRAM tokens) the
        last time it occurred; [] when no suffix occurred before."""
        seq = self._tokens
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(seq) <= n:
                continue
            at = self._at.get(tuple(seq[-n:]))
            if at is not None:
                return seq[at:at + k]
        return []


def accepted(draft: list[int], tokens: list[int]) -> list[int]:
    """The tokens a verify step gives: tokens[0], then tokens[i] while draft[i - 1] == tokens[i - 1].

    tokens: the argmax of each row (len(draft) + 1 rows)."""
    out = [tokens[0]]
    for d, t_prev, t in zip(draft, tokens, tokens[1:]):
        if d != t_prev:
            break
        out.append(t)
    return out
