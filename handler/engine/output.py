"""The output processor: from sampled tokens to a request's events.

Owns what happens once a step has run: the step's bookkeeping (prefill progress, cancellations
that waited for the forward pass), each new token (grammar errors, EOS and stop tokens, incremental
detokenisation, stop strings, max_tokens), building `TokenEvent`s, finishing a request (it leaves
the scheduler, frees its cache and its adapter reference; its final event carries the held-back
text) and calling `on_event` callbacks outside the lock. A failed step fails its requests.

Every event carries the running usage: `prompt_tokens` and `completion_tokens` (generated tokens,
the final EOS included). `text` is the new detokenized text of the step (possibly empty while a
multi-byte character or a possible stop-string prefix is held back); stop strings are not part of
the text.
"""

from __future__ import annotations

import logging
import threading

from handler.engine.request import Request, TokenEvent
from handler.engine.scheduler import Scheduler, StepPlan
from handler.engine.slot_table import SlotTable

log = logging.getLogger(__name__)

Events = list[tuple[Request, TokenEvent]]


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int], scheduler: Scheduler, slots: SlotTable,
                 lock: threading.RLock, cond: threading.Condition):
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.scheduler, self.slots = scheduler, slots
        self._lock, self._cond = lock, cond
        self.generated = 0  # tokens generated, over all requests
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = backend.decode if backend is not None else (
            lambda x, skip_special_tokens: tokenizer.decode(x, skip_special_tokens=skip_special_tokens))

    # ------------------------------------------------------------------------------- a step's end

    def commit(self, plan: StepPlan, taken: list[tuple[Request, list[int]]]) -> Events:
        """The step ran: advance its prefill chunks, finish what was cancelled during the forward
        pass, then give each request its tokens in order, until one ends it. The events, for
        `dispatch` once the step lock is let go."""
        events: Events = []
        with self._lock:
            self.scheduler.end_step()
            for r, n in plan.prefill:
                self.scheduler.prefilled(r, n)
                if r.cancelled:
                    self.finish(r, None, "cancelled", events)
            for r in plan.decode:
                if r.cancelled:
                    self.finish(r, None, "cancelled", events)
            for r, toks in taken:
                for tok in toks:
                    if r.id not in self.scheduler.requests or r.cancelled:
                        break
                    self.on_token(r, tok, events)
            self._cond.notify_all()
        return events

    def fail(self, plan: StepPlan, e: Exception) -> None:
        """The step raised: fail its requests ("cancelled" for those cancelled meanwhile) and call
        their callbacks (the caller still holds the step lock), keep serving."""
        log.exception("engine step failed; failing %d requests", len(plan.requests))
        events: Events = []
        with self._lock:
            self.scheduler.end_step(failed=True)
            for r in plan.requests:
                if r.id in self.scheduler.requests:
                    self.finish(r, None, "cancelled" if r.cancelled else "error", events,
                                error=None if r.cancelled else f"{type(e).__name__}: {e}")
            self._cond.notify_all()
        self.dispatch(events)

    # ------------------------------------------------------------------------------- tokens

    def on_token(self, r: Request, tok: int, events: Events) -> None:
        r.out.append(tok)
        self.generated += 1
        p = r.params
        if r.gen.matcher is not None and (gerr := r.gen.grammar_error()) is not None:
            # a grammar that hit a parser limit: an error, never a "stop" with a broken document
            self.finish(r, None, "error", events, error=f"grammar: {gerr}")
            return
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            self.finish(r, tok, "stop", events)
            return
        r.text += self._detok(r)
        if r.max_stop:
            start = max(0, r.emitted - r.max_stop)
            hits = [i for i in (r.text.find(s, start) for s in p.stop) if i >= 0]
            if hits:
                r.text = r.text[: min(hits)]
                self.finish(r, tok, "stop", events)
                return
        if len(r.out) >= p.max_tokens:
            self.finish(r, tok, "length", events)
            return
        upto = len(r.text) - (r.max_stop - 1 if r.max_stop else 0)
        delta = ""
        if upto > r.emitted:
            delta = r.text[r.emitted : upto]
            r.emitted = upto
        events.append((r, TokenEvent(r.id, tok, delta, False, None, len(r.prompt), len(r.out), logprobs=r.gen.logprobs,
                                     cached_tokens=r.cached)))

    def _detok(self, r: Request) -> str:
        """Incremental detokenization: new text once it no longer ends in a partial character."""
        ids, dec = r.out, self._decode
        prefix = dec(ids[r.prefix_off : r.read_off], skip_special_tokens=True) if r.read_off > r.prefix_off else ""
        full = dec(ids[r.prefix_off :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            r.prefix_off, r.read_off = r.read_off, len(ids)
            return full[len(prefix) :]
        return ""

    # ------------------------------------------------------------------------------- the end

    def finish(self, r: Request, tok: int | None, reason: str, events: Events, error: str | None = None) -> None:
        """Remove a request everywhere, free its cache and adapter reference, queue its final event
        (the caller holds the lock)."""
        self.scheduler.retire(r)
        self.slots.release(r.adapter_id)
        delta = r.text[r.emitted :] if reason in ("stop", "length") else ""
        r.emitted = len(r.text)
        events.append((r, TokenEvent(r.id, tok, delta, True, reason, len(r.prompt), len(r.out), error,
                                     r.gen.logprobs if tok is not None else None, r.cached)))

    @staticmethod
    def dispatch(events: Events) -> None:
        """Call the events' callbacks, outside the lock; a broken callback never stops the engine."""
        for r, ev in events:
            if r.on_event is None:
                continue
            try:
                r.on_event(ev)
            except Exception:  # noqa: BLE001 - a broken callback must not stop the engine
                log.exception("on_event callback failed for request %s", ev.request_id)
