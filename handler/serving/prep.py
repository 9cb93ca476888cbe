"""A replica's prep work, fair by tenant: large request bodies are parsed, rendered and tokenized
off the event loop on a few threads fed by per-tenant queues, and a prompt provably past the
context is refused before it is tokenized whole.

    prep = prep_pool(limits).start()           # handler.threads.FairThreadPool
    req = await prep.run(tenant, len(body), oai.parse_request, model_cls, body)
    bound = TokenBound.of(tokenizer)           # once, off the loop (a pass over the vocabulary)
    n = bound.least_tokens(text, max_ctx)      # a lower bound of len(tokenize(text)), or None

Why (issue 35, item 2): one `lorafarm-prep` thread served every tenant first come first served, so a
tenant looping 900 KB prompts (seconds of tokenizing each, then a 400) made another tenant's 18 KB
requests wait behind its whole backlog. Now:

- `Limits.prep_threads` threads (default 2) take jobs by deficit round robin of body bytes across
  tenants (`PREP_QUANTUM` of credit per turn), a tenant on at most all threads but one, so a
  tenant's stream of large bodies waits behind its own work only and leaves a thread to the others;
- a tenant has at most `Limits.prep_tenant_queue` jobs waiting (8; 429 `prep_queue_full` above),
  and all tenants together `Limits.prep_max_queued` (64), a tenant under its share of that always
  admitted;
- a job whose request went away (client disconnected) before it ran is dropped.

A prompt past the context is refused (400 context_length_exceeded) before it is tokenized whole:

- by bytes: every token of the vocabulary stands for at most L bytes of text (L = the longest token's
  decoded UTF-8 length + 1, measured once), so a text of B bytes has at least ceil(B / L) tokens;
  when that already reaches the context the prompt is refused at once (the tiny dev model: L = 11,
  so anything over ~22 KB; SmolLM2: L = 82, over ~670 KB for 8,192 tokens);
- incrementally, for a text under that bound but over `4 x context` characters (and over one
  chunk): tokenized in chunks of CHUNK_CHARS cut before a space that follows a non-space (a
  pre-tokenizer boundary of byte-level BPE tokenizers, where token counts add up exactly), until the
  count minus CUT_SLACK tokens per cut reaches the context. A text that ends first is tokenized
  whole, as before.

Both are used only where they hold: a tokenizer whose round trip (encode, decode) changes a probe
text (a normalizer that drops characters), with an added token that strips whitespace around it, or
whose chunked count of a probe text strays from its whole count by more than the slack, gets
neither (its prompts are tokenized whole, as before)."""

from __future__ import annotations

import logging

from handler.threads import FairThreadPool

log = logging.getLogger("lorafarm.replica.prep")

PREP_QUANTUM = 64 * 1024  # bytes of credit a tenant gets per turn (deficit round robin by body bytes)
CHUNK_CHARS = 32 * 1024  # incremental tokenizing: characters per chunk (cut at the next safe boundary)
CUT_SLACK = 2  # tokens a cut may add to a chunked count (a prefix re-added, a merge lost at the cut)
_PROBE = ("Hello  world,\tthis is a probe.\n\n  Indented line: x = [1, 2, 3]; caf\u00e9 na\u00efve \u00c5ngstr\u00f6m "
          "\u212b \ufb03 \u00a0nbsp \u3000ideographic \U0001F600 emoji, \u4e2d\u6587\u6587\u672c, \u0627\u0644\u0639"
          "\u0631\u0628\u064a\u0629 \u0000\u0001\u007f control 'quoted' \"double\" don't it's -- ... !!! ??? "
          "https://example.com/a_b-c?d=e&f=g  trailing   spaces   \r\nwindows line\r\n")


def prep_pool(limits) -> FairThreadPool:
    """The prep threads of a replica with `limits` (handler.serving.config.Limits)."""
    return FairThreadPool(limits.prep_threads, name="lorafarm-prep", tenant_cap=limits.prep_tenant_queue,
                          total_cap=limits.prep_max_queued, quantum=PREP_QUANTUM)


def _cuts(text: str, chunk: int) -> list[int]:
    """Chunk ends: after ~`chunk` characters, before the next space that follows a non-space."""
    out, pos, n = [], 0, len(text)
    while pos + chunk < n:
        j = text.find(" ", pos + chunk)
        while j > 0 and text[j - 1].isspace():
            j = text.find(" ", j + 1)
        if j <= 0:
            break
        out.append(j)
        pos = j
    return out


class TokenBound:
    """Lower bounds of a text's token count, without tokenizing it whole (see the module doc)."""

    def __init__(self, tokenizer, max_token_bytes: int | None, chunked: bool):
        self.tokenizer = tokenizer
        self.max_token_bytes = max_token_bytes  # L; None: no byte bound for this tokenizer
        self.chunked = chunked  # incremental counting holds for this tokenizer
        self.refused = 0  # prompts refused by a bound (counted by the handler)

    @classmethod
    def of(cls, tokenizer) -> "TokenBound":
        """Measure `tokenizer` (a Hugging Face tokenizer; a pass over its vocabulary: call it off the loop)."""
        try:
            return cls._measure(tokenizer)
        except Exception as e:  # noqa: BLE001 - no bound: every prompt is tokenized whole, as before
            log.warning("no early context check for this tokenizer: %s", e)
            return cls(tokenizer, None, False)

    @classmethod
    def _measure(cls, tok) -> "TokenBound":
        n = len(tok)
        texts = tok.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False)
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=0)
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        strips = any(getattr(a, "lstrip", False) or getattr(a, "rstrip", False) for a in added.values())
        spaced = any(any(c.isspace() for c in str(getattr(a, "content", a))) for a in added.values())
        ids = tok.encode(_PROBE, add_special_tokens=False)
        lossless = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == _PROBE
        if not lossless or strips or longest <= 0:
            log.info("no early context check for this tokenizer (lossless round trip: %s, stripping added "
                     "tokens: %s)", lossless, strips)
            return cls(tok, None, False)
        probe = _PROBE * 8
        cuts = _cuts(probe, 97)
        whole = len(tok.encode(probe, add_special_tokens=False))
        parts = sum(len(tok.encode(p, add_special_tokens=False)) for p in _split(probe, cuts))
        chunked = not spaced and 0 <= parts - whole <= CUT_SLACK * len(cuts) and bool(cuts)
        return cls(tok, longest + 1, chunked)

    def by_bytes(self, text: str) -> int:
        """At least this many tokens (0 when unknown)."""
        if not self.max_token_bytes:
            return 0
        b = len(text.encode("utf-8", "surrogatepass"))
        return -(-b // self.max_token_bytes)

    def least_tokens(self, text: str, limit: int, add_special_tokens: bool = False) -> int | None:
        """A lower bound of len(encode(text)) that is >= `limit` when the text provably has that many
        tokens, else None (tokenize it whole to know). Cheap by bytes first; then, for a text over
        4 x `limit` characters, by tokenizing chunks until the bound is reached."""
        n = self.by_bytes(text)
        if n >= limit:
            return n
        if not self.chunked or len(text) <= max(4 * limit, CHUNK_CHARS):  # (one chunk: as dear as the whole)
            return None
        count, start = 0, 0
        cuts = _cuts(text, CHUNK_CHARS)
        for k, end in enumerate([*cuts, len(text)]):
            piece = text[start:end]
            count += len(self.tokenizer.encode(piece, add_special_tokens=add_special_tokens and k == 0))
            start = end
            least = count - CUT_SLACK * k
            if least >= limit:
                return least
        return None


def _split(text: str, cuts: list[int]) -> list[str]:
    out, start = [], 0
    for end in [*cuts, len(text)]:
        out.append(text[start:end])
        start = end
    return out


class FairQueuesCollector:
    """Per-tenant depth of the replica's shared queues (prep threads, grammar workers, grammar
    builds), read at scrape time; a tenant appears while it has work waiting or running."""

    def __init__(self, handler):
        self._handler = handler

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        h = self._handler
        waiting = GaugeMetricFamily("lorafarm_tenant_queue_waiting",
                                    "Jobs a tenant has waiting in a shared replica queue.", labels=["queue", "tenant"])
        running = GaugeMetricFamily("lorafarm_tenant_queue_running",
                                    "Jobs a tenant has running from a shared replica queue.", labels=["queue", "tenant"])
        refused = CounterMetricFamily("lorafarm_tenant_queue_refused",
                                      "Jobs refused (429) because their tenant's queue was full.", labels=["queue"])
        cancelled = CounterMetricFamily("lorafarm_tenant_queue_cancelled",
                                        "Jobs dropped because their request went away.", labels=["queue"])
        bound = CounterMetricFamily("lorafarm_prompt_refused_before_tokenizing",
                                    "Prompts refused as past the context before being tokenized whole.")
        queues = []
        prep = getattr(h, "_prep", None)
        if prep is not None:
            queues.append(("prep", prep.stats()))
        pool = getattr(h, "grammar_pool", None)
        if pool is not None:
            st = pool.stats()
            queues.append(("grammar", {**st, "refused": st["busy"]}))
        builder = getattr(h, "grammar_builder", None)
        if builder is not None and builder.stats():
            queues.append(("grammar_build", builder.stats()))
        for name, st in queues:
            for tenant, t in st.get("tenants", {}).items():
                waiting.add_metric([name, tenant], t["waiting"])
                running.add_metric([name, tenant], t["running"])
            refused.add_metric([name], st.get("refused", 0))
            cancelled.add_metric([name], st.get("cancelled", 0))
        tb = getattr(h, "token_bound", None)
        bound.add_metric([], tb.refused if tb is not None else 0)
        yield from (waiting, running, refused, cancelled, bound)
