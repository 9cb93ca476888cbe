"""The step executor: how a planned step runs on the model, chosen once at start-up.

Owns the choices made when the engine is built, from the configuration and the machine, never again
per step:

- batch-invariant mode: a row's arithmetic independent of the batch (docs/architecture.md, "Answers
  independent of load"): every product on at least `model.INVARIANT_MIN_ROWS` rows, the LoRA delta
  per token (the "invariant" kernel), attention one call per sequence (decode gathered);
- compile: the torch.compile'd layer pieces for decode-only steps, padded to batch buckets
  (`Runner.compile`; CUDA graphs on CUDA); steps with prefill stay eager;
- decode attention: "paged" (in place on the cache, `handler.model.paged_attention`), "gather" (each
  bucket's blocks copied out, then SDPA) or "auto": a fixed rule of device and shapes
  (`paged_attention.prefers_paged`), paged only where the probe also finds it compiles and is
  correct; nothing is timed. A compile failure of the paged kernel inside a step (a shape the probe
  did not see) switches to gathered for good and reruns the step;
- the C decode step (`handler.model.decode_step`): None (default) where it applies and attention is
  "auto" without compile or batch_invariant, True required, False never. It runs steps of at most
  DECODE_STEP_ROWS decode rows, or C_PREFILL_TOKENS rows in all with prefill.

Per step (`prepare` under the engine's lock, then `run` outside it): the rows of the plan (a prefill
chunk's tokens; one row per decode request, plus n-gram drafts of greedy requests on decode-only C
steps whose rows stay within speculate_max_rows, `handler.engine.speculate`), the forward pass, the
rows that produce a token (decode rows, prompts that complete), sampling, and the tokens each
request takes (a drafted request's up to its first wrong draft).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

import torch

from handler.engine.request import Request
from handler.engine.sampling import sample
from handler.engine.scheduler import StepPlan
from handler.engine.speculate import NgramIndex, accepted, can_draft
from handler.model import paged_attention
from handler.model.decode_step import MAX_ROWS as DECODE_STEP_ROWS
from handler.model.decode_step import DecodeStep
from handler.model.decode_step import why_not as decode_step_why_not
from handler.model.kvcache import KVCache
from handler.model.lora import ModelLoRA
from handler.model.paged_attention import DecodeTables
from handler.model.runner import Runner, StepBuffers, bucket_rows, build_step_batch
from handler.model.tensors import to_device

log = logging.getLogger(__name__)

C_PREFILL_TOKENS = 16  # steps with prefill of at most this many rows in all run on the C decode step (_c_step_takes)


@dataclass
class StepRows:
    """A planned step as rows: `seqs` (tokens, start position, block table) per prefill chunk and per
    decode token (drafts included), the LoRA slot of every token, the request of every entry of seqs."""

    plan: StepPlan
    seqs: list[tuple[list[int], int, list[int]]]
    slots: list[int]
    owners: list[Request]
    drafts: dict[str, list[int]]  # request id -> draft tokens checked in this step


class StepExecutor:
    def __init__(self, runner: Runner, kv: KVCache, lora: ModelLoRA | None, lock: threading.RLock, *,
                 max_batch: int, max_context: int, attention: str, compile: bool, batch_invariant: bool,
                 decode_step: bool | None, speculate: int, speculate_max_rows: int):
        self.runner, self.kv, self.lora, self.device = runner, kv, lora, runner.device
        self._lock, self.max_batch, self.max_context = lock, max_batch, max_context
        self._buffers = StepBuffers(self.device)
        runner.batch_invariant = batch_invariant
        if lora is not None and batch_invariant:
            lora.kernel = "invariant"
        self.compiled = bool(compile)
        if self.compiled:
            runner.compile()
        # fixed for every torch step: compiled decode-only steps are padded to their bucket; the
        # batch-invariant mode attends per row
        self._padded_rows = bucket_rows if self.compiled else _unpadded
        self._batch_kw = dict(pad_block=kv.null_block, scratch_slot=kv.scratch_block * kv.block_size,
                              per_row=batch_invariant)
        # the probe runs here, before the engine serves: compiling in a thread beside serving (or
        # beside a test runner) imports modules concurrently with code iterating over them (a CI run
        # failed on "dictionary changed size during iteration"), and takes the GIL from serving
        c = runner.config
        self.decode_tables: DecodeTables | None = None  # None: gathered decode attention
        if attention == "paged" or (attention == "auto" and not batch_invariant
                                    and paged_attention.prefers_paged(self.device, c.num_kv_heads, c.head_dim)):
            self.decode_tables = self.probe_attention(required=attention == "paged")
        self.decode_step: DecodeStep | None = None
        if decode_step or (decode_step is None and attention == "auto" and not compile and not batch_invariant):
            self.decode_step = self._c_decode_step(required=bool(decode_step))
        self.speculate = int(speculate)
        self.speculate_max_rows = min(int(speculate_max_rows), DECODE_STEP_ROWS)
        self.drafted = self.draft_accepted = 0

    # ------------------------------------------------------------------------------- start-up

    def _c_decode_step(self, required: bool) -> DecodeStep | None:
        why = decode_step_why_not(self.runner, self.kv, self.lora)
        if why and required:
            raise ValueError(f"decode_step: {why}")
        step = DecodeStep(self.runner, self.kv, self.lora) if why is None else None
        log.info("decode steps of 1-%d rows: %s", DECODE_STEP_ROWS, why or "C decode step")
        return step

    def measure_attention(self, timed: bool = True) -> paged_attention.Probe:
        """The paged decode kernel compiled and checked against the gathered path for this engine's
        shapes and, with `timed` (benchmarks only), both paths timed (`paged_attention.measure`;
        cached per process)."""
        c = self.runner.config
        fn = paged_attention.measure if timed else paged_attention.probe
        try:
            return fn(self.device, self.runner.dtype, c.num_heads, c.num_kv_heads, c.head_dim,
                      self.kv.block_size, windows=self.runner.windows, rows=min(self.max_batch, 32))
        except Exception as e:  # noqa: BLE001 - the probe's own failure: stay on the gathered path
            return paged_attention.Probe(False, f"probe failed: {type(e).__name__}: {e}")

    def probe_attention(self, required: bool = False) -> DecodeTables | None:
        """The paged kernel's tables once the probe found it correct: with `required` ("paged") a
        failure is an error, else ("auto", where the rule chose it) the gathered path. No timing."""
        p = self.measure_attention(timed=False)
        if required and not p.ok:
            raise ValueError(f"attention 'paged': {p.reason}")
        if not p.ok:
            log.info("decode attention: gathered (paged %s)", p.reason)
            return None
        log.info("decode attention: paged (%s)", p.reason)
        return DecodeTables(self.kv, self.max_batch)

    # ------------------------------------------------------------------------------- one step

    def prepare(self, plan: StepPlan) -> StepRows:
        """The step's rows (under the engine's lock: drafts may grow a request's blocks)."""
        drafts = self._drafts(plan.decode) if not plan.prefill else {}
        seqs = [(r.ctx[r.prefilled : r.prefilled + n], r.prefilled, r.blocks) for r, n in plan.prefill]
        slots = [r.slot for r, n in plan.prefill for _ in range(n)]
        owners = [r for r, _ in plan.prefill]
        for r in plan.decode:  # a drafted request: its last token and each draft token, a row each
            p = len(r.prompt) + len(r.out) - 1
            toks = [r.out[-1], *drafts.get(r.id, ())]
            seqs += [([t], p + i, r.blocks) for i, t in enumerate(toks)]
            slots += [r.slot] * len(toks)
            owners += [r] * len(toks)
        return StepRows(plan, seqs, slots, owners, drafts)

    def run(self, rows: StepRows) -> list[tuple[Request, list[int]]]:
        """Forward, sample, and the tokens each request takes from the step, in row order."""
        logits = self._forward_or_fall_back(rows)
        pick = self._producing_rows(rows)
        if not pick:
            return []
        owners = [rows.owners[i] for i in pick]
        if pick == list(range(pick[0], pick[0] + len(pick))):
            picked = logits[pick[0] : pick[0] + len(pick)]
        else:  # an index built on the host, moved without a host sync
            picked = logits.index_select(0, to_device(torch.tensor(pick), self.device))
        tokens = sample(picked, [r.params for r in owners], [r.gen for r in owners])
        return self._taken(rows, owners, tokens)

    def _forward_or_fall_back(self, rows: StepRows) -> torch.Tensor:
        try:
            return self._forward(rows)
        except Exception as e:  # noqa: BLE001 - re-raised unless the paged kernel's compile failed
            if self.decode_tables is None or not paged_attention.is_compile_error(e):
                raise
            if self.device.type == "cuda":  # the step buffers' pending copies, before refilling
                torch.cuda.synchronize(self.device)
            # a recompile of the paged kernel failed (a shape the probe did not see): the gathered
            # path from now on; the step is rerun (rewriting the same K/V is harmless)
            log.exception("paged decode attention failed; switching to the gathered path")
            self.decode_tables = None
            return self._forward(rows)

    def _forward(self, rows: StepRows) -> torch.Tensor:
        if self._c_step_takes(rows.seqs, len(rows.plan.prefill)):
            return self._c_forward(rows)
        return self._torch_forward(rows)

    def _c_step_takes(self, seqs: list, prefilling: int) -> bool:
        """Does the C decode step run this step? Decode rows (and drafts) up to its row limit; with
        prefill chunks, steps of at most C_PREFILL_TOKENS rows in all: a continuation after a
        prefix-cache hit (less than a block) beside a few decode rows costs one C step instead of a
        torch forward (~9,000 ops). Bigger prefill steps keep the torch path, which computes only
        each sequence's last logits (the C step computes every row's: 32 continuations of a burst
        would pay the LM head 32 times over)."""
        rows = sum(len(ids) for ids, _, _ in seqs)
        return self.decode_step is not None and rows <= (C_PREFILL_TOKENS if prefilling else DECODE_STEP_ROWS)

    def _c_forward(self, rows: StepRows) -> torch.Tensor:
        """Every token a row (a prefill chunk's rows at consecutive positions attend to the K/V the
        rows before them write in the step); a sequence's logits are its last row's."""
        flat = [(t, start + i, table) for ids, start, table in rows.seqs for i, t in enumerate(ids)]
        logits = self.decode_step(flat, rows.slots)
        if rows.plan.prefill:
            ends = list(itertools.accumulate(len(ids) for ids, _, _ in rows.seqs))
            logits = logits[[e - 1 for e in ends]]
        return logits

    def _torch_forward(self, rows: StepRows) -> torch.Tensor:
        prefill = rows.plan.prefill
        pad_to = None if prefill else self._padded_rows(len(rows.seqs))
        slots = rows.slots if pad_to is None else rows.slots + [0] * (pad_to - len(rows.slots))
        batch = build_step_batch(rows.seqs, self.kv.block_size, self.device, self.runner.windows,
                                 decode_from=len(prefill), decode_tables=self.decode_tables, buffers=self._buffers,
                                 pad_to=pad_to, **self._batch_kw)
        if self.lora is not None:
            batch.lora = self.lora.prepare(slots, prefill=bool(prefill))
        return self.runner.forward(batch, self.kv)

    @staticmethod
    def _producing_rows(rows: StepRows) -> list[int]:
        """Rows that produce a token: decode rows (drafts included), and prefill rows whose prompt
        is complete."""
        prefill = rows.plan.prefill
        pick = [i for i, (r, n) in enumerate(prefill) if r.prefilled + n == len(r.ctx)]
        pick += range(len(prefill), len(rows.seqs))
        return pick

    # ------------------------------------------------------------------------------- speculation

    def _drafts(self, decode: list[Request]) -> dict[str, list[int]]:
        """Draft tokens for this decode-only step (`handler.engine.speculate`), request id -> tokens: while
        the step's rows stay within speculate_max_rows, for requests whose next token is the argmax
        alone, no further than their max_tokens and max_context allow, on blocks they hold or the
        pool has free (a draft never preempts anyone). Only on the C decode step, which writes every
        row's K/V before any row attends (none once set_attention has turned it off)."""
        if not self.speculate or self.decode_step is None or len(decode) >= self.speculate_max_rows:
            return {}
        out: dict[str, list[int]] = {}
        spare = self.speculate_max_rows - len(decode)
        for r in decode:
            if spare <= 0:
                break
            if not can_draft(r.params, r.gen):
                continue
            length = len(r.prompt) + len(r.out)  # positions once this step's first token is written
            k = min(self.speculate, spare, r.params.max_tokens - len(r.out) - 1, self.max_context - length)
            if k <= 0:
                continue
            if r.ngrams is None:
                r.ngrams = NgramIndex()
            r.ngrams.sync(r.prompt, r.out)
            d = r.ngrams.propose(k)
            if not d:
                continue
            if not self.kv.grow(r.blocks, length + len(d)):  # what the blocks it holds cover, then
                d = d[: len(r.blocks) * self.kv.block_size - length]
            if d:
                out[r.id] = d
                spare -= len(d)
        return out

    def _taken(self, rows: StepRows, owners: list[Request], tokens: list[int]) -> list[tuple[Request, list[int]]]:
        """Each request's tokens from the step, in row order: a drafted request's up to its first
        wrong draft (the tokens plain decoding gives), counted."""
        by_id: dict[str, list[int]] = {}
        for r, tok in zip(owners, tokens):
            by_id.setdefault(r.id, []).append(tok)
        taken = []
        for r in dict.fromkeys(owners):
            toks = by_id[r.id]
            if r.id in rows.drafts:
                toks = accepted(rows.drafts[r.id], toks)
                with self._lock:
                    self.drafted += len(rows.drafts[r.id])
                    self.draft_accepted += len(toks) - 1
            taken.append((r, toks))
        return taken


def _unpadded(rows: int) -> None:
    return None
