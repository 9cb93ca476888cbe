"""The embedding worker's model: a Hugging Face encoder run with transformers, pooled and normalised
as its sentence-transformers files say, with concurrent requests batched together.

Folder layout read (all optional but the transformers checkpoint):
- `modules.json`: the module chain; supported types are Transformer, Pooling and Normalize (a chain
  with anything else, e.g. Dense, is refused at start-up rather than served wrong);
- `1_Pooling/config.json` (the Pooling module's path): `pooling_mode` (new style) or the legacy
  `pooling_mode_*_tokens` booleans; without it: mean pooling;
- `sentence_bert_config.json`: `max_seq_length` (the context; longer inputs are refused, not
  truncated) and `do_lower_case`.

Pooling, for token states h_t (t = 1..T) and attention mask m_t:
- mean: sum_t m_t h_t / max(sum_t m_t, 1e-9);  mean_sqrt_len_tokens: sum_t m_t h_t / sqrt(sum_t m_t);
- cls: h_1;  max: max_t over {h_t : m_t = 1};  lasttoken: h_{last t with m_t = 1};
- several modes concatenate in sentence-transformers' order (cls, max, mean, mean_sqrt_len).
Normalize: e / max(||e||_2, 1e-12). `dimensions = d` keeps the first d components (Matryoshka
truncation) and then normalises again when the model normalises.

`EmbeddingBatcher` collects the inputs of concurrent requests into batches of at most `max_batch`
inputs and `max_batch_tokens` tokens (sorted by length inside a batch so padding stays small) and runs
each batch in a worker thread, so the event loop keeps accepting requests while the encoder runs.

Batches are formed fairly (`FairQueue`), not first-in-first-out: deficit round robin by tokens across
tenants (the router's `x-lorafarm-tenant`; a request without one is its own flow), and inside a tenant
round robin across its requests in chunks of at most `request_chunk` inputs. So one tenant's 2,048
inputs are split into bounded chunks interleaved with everyone else's, and a small request that arrives
behind them is in the next batch formed: it waits for at most the batch that is running.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("lorafarm.replica.embed")

_LEGACY_MODES = {  # sentence-transformers' concatenation order
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken")
_KNOWN_MODULES = {"Transformer": "transformer", "Pooling": "pooling", "Normalize": "normalize"}


class EmbeddingInputError(ValueError):
    """An input the encoder cannot take (too long, token ids out of range); answered as a 400."""

    def __init__(self, message: str, param: str = "input", code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class EncoderLayout:
    """What the sentence-transformers files say about the pipeline after the transformer."""

    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False

    @classmethod
    def read(cls, folder: Path) -> EncoderLayout:
        folder = Path(folder)
        pooling: tuple[str, ...] = ("mean",)
        normalize = False
        modules_file = folder / "modules.json"
        if modules_file.is_file():
            modules = json.loads(modules_file.read_text())
            for m in sorted(modules, key=lambda m: m.get("idx", 0)):
                kind = _KNOWN_MODULES.get(str(m.get("type", "")).rsplit(".", 1)[-1])
                if kind is None:
                    raise ValueError(f"{modules_file}: module {m.get('type')!r} is not supported "
                                     f"(only {', '.join(_KNOWN_MODULES)})")
                if kind == "pooling":
                    pooling = _pooling_modes(folder / str(m.get("path") or "") / "config.json")
                elif kind == "normalize":
                    normalize = True
        sb = folder / "sentence_bert_config.json"
        cfg = json.loads(sb.read_text()) if sb.is_file() else {}
        msl = cfg.get("max_seq_length")
        return cls(pooling=pooling, normalize=normalize, max_seq_length=int(msl) if msl else None,
                   do_lower_case=bool(cfg.get("do_lower_case", False)))


def _pooling_modes(config_file: Path) -> tuple[str, ...]:
    if not config_file.is_file():
        return ("mean",)
    cfg = json.loads(config_file.read_text())
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = tuple(v for k, v in _LEGACY_MODES.items() if cfg.get(k))
        if cfg.get("pooling_mode_weightedmean_tokens"):
            raise ValueError(f"{config_file}: weighted-mean pooling is not supported")
        modes = modes or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    for m in modes:
        if m not in _MODES:
            raise ValueError(f"{config_file}: pooling mode {m!r} is not supported (one of {', '.join(_MODES)})")
    order = {m: i for i, m in enumerate(_MODES)}
    return tuple(sorted(modes, key=order.__getitem__))


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """[B, T, H] token states and [B, T] mask -> [B, H * len(modes)] (see the module docstring)."""
    m = mask.to(hidden.dtype).unsqueeze(-1)
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[:, 0])
        elif mode == "max":
            out.append(hidden.masked_fill(m == 0, -1e9).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = (hidden * m).sum(dim=1)
            count = m.sum(dim=1)
            out.append(total / count.clamp(min=1e-9) if mode == "mean" else total / count.sqrt())
        elif mode == "lasttoken":
            last = (mask.long().cumsum(dim=1).argmax(dim=1))  # index of the last masked-in token
            out.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
    return torch.cat(out, dim=-1)


class Encoder:
    """A loaded encoder folder: tokenize, run, pool, normalise."""

    def __init__(self, folder: str | Path, device: str | None = None, dtype: torch.dtype = torch.float32):
        from transformers import AutoModel, AutoTokenizer

        self.folder = Path(folder)
        self.layout = EncoderLayout.read(self.folder)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.model = AutoModel.from_pretrained(self.folder, dtype=dtype).to(self.device).eval()
        cfg = self.model.config
        limits = [x for x in (self.layout.max_seq_length, getattr(cfg, "max_position_embeddings", None)) if x]
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if tok_max and tok_max < 10**9:
            limits.append(int(tok_max))
        self.max_tokens = int(min(limits)) if limits else 512
        self.hidden_size = int(cfg.hidden_size)
        self.dimension = self.hidden_size * len(self.layout.pooling)
        self.vocab_size = int(cfg.vocab_size)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._takes_token_types = "token_type_ids" in self.tokenizer.model_input_names
        self._tokenizer_lock = threading.Lock()

    # -- tokens -----------------------------------------------------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text, special tokens included, as sentence-transformers feeds the model."""
        if self.layout.do_lower_case:
            texts = [t.lower() for t in texts]
        with self._tokenizer_lock:  # a fast tokenizer is not safe to call from two threads at once
            return self.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]

    def check_ids(self, ids: list[list[int]]) -> None:
        for i, row in enumerate(ids):
            if not row:
                raise EmbeddingInputError(f"input[{i}] is empty")
            if len(row) > self.max_tokens:
                raise EmbeddingInputError(
                    f"input[{i}] has {len(row)} tokens; this model's maximum context length is "
                    f"{self.max_tokens} tokens. Please reduce the length of the input.",
                    code="context_length_exceeded")
            bad = next((t for t in row if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise EmbeddingInputError(f"input[{i}] holds token id {bad}, outside [0, {self.vocab_size})")

    # -- forward ----------------------------------------------------------------------------

    @torch.inference_mode()
    def embed_ids(self, ids: list[list[int]]) -> torch.Tensor:
        """[N, dimension] float32 on the CPU, pooled and (when the model says so) normalised."""
        width = max(len(r) for r in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        feed = {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self._takes_token_types:
            feed["token_type_ids"] = torch.zeros_like(feed["input_ids"])
        hidden = self.model(**feed).last_hidden_state
        emb = pool(hidden.float(), feed["attention_mask"], self.layout.pooling)
        if self.layout.normalize:
            emb = torch.nn.functional.normalize(emb, p=2, dim=1)
        return emb.cpu()

    def finish(self, emb: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        """Matryoshka truncation to `dimensions`, renormalised when the model normalises."""
        if dimensions is None or dimensions >= emb.shape[-1]:
            return emb
        emb = emb[..., :dimensions]
        if self.layout.normalize:
            emb = torch.nn.functional.normalize(emb, p=2, dim=-1)
        return emb


@dataclass
class _Job:
    ids: list[list[int]]
    future: asyncio.Future
    flow: str = ""
    done: int = 0
    out: list[torch.Tensor | None] = field(default_factory=list)
    next_row: int = 0  # the first row not yet handed to a batch

    @property
    def rows_left(self) -> int:
        return len(self.ids) - self.next_row


@dataclass
class _Flow:
    """One tenant's requests, in arrival order; `deficit` is its unspent token credit (DRR)."""

    key: str
    jobs: collections.deque = field(default_factory=collections.deque)
    deficit: int = 0
    chunk_taken: int = 0  # rows the head job gave since it became the head


class FairQueue:
    """Which rows go into the next batch: deficit round robin by tokens across flows (tenants), round
    robin in chunks of `request_chunk` rows across one flow's requests. Pure bookkeeping, no I/O: the
    scheduling order is unit-tested on its own (tests/handler/test_embed_fair.py).

    Each round visits the active flows in turn; a visited flow gets `quantum` tokens of credit and
    hands over rows (its head request's next ones) while their tokens fit its credit and the batch has
    room (`max_batch` rows, `max_batch_tokens` tokens; a batch always takes at least one row). A flow
    with nothing left leaves the round with its credit reset; a request that gave `request_chunk` rows
    in a row goes to the back of its flow. `quantum` is at least the longest row, so every visit takes
    at least one row: with F active flows a newly arrived row is in the next batch as long as
    F <= max_batch.
    """

    def __init__(self, max_batch: int = 32, *, quantum: int = 512, request_chunk: int | None = None,
                 max_batch_tokens: int | None = None):
        self.max_batch = max(1, max_batch)
        self.quantum = max(1, quantum)
        self.request_chunk = max(1, request_chunk if request_chunk is not None else max(1, self.max_batch // 4))
        self.max_batch_tokens = max_batch_tokens
        self._flows: collections.OrderedDict[str, _Flow] = collections.OrderedDict()  # active, visit order
        self._anon = itertools.count()

    def __len__(self) -> int:
        return sum(j.rows_left for f in self._flows.values() for j in f.jobs)

    def __bool__(self) -> bool:
        return bool(self._flows)

    def push(self, job: _Job) -> None:
        if not job.flow:
            job.flow = f"-{next(self._anon)}"  # no tenant: a flow of its own
        f = self._flows.get(job.flow)
        if f is None:
            f = self._flows[job.flow] = _Flow(job.flow)
        f.jobs.append(job)

    def _drop_finished(self, f: _Flow) -> None:
        while f.jobs and (f.jobs[0].rows_left == 0 or f.jobs[0].future.done()):
            f.jobs.popleft()
            f.chunk_taken = 0

    def next_batch(self) -> list[tuple[_Job, int]]:
        """The (request, row) pairs of the next batch (empty when nothing is waiting)."""
        batch: list[tuple[_Job, int]] = []
        tokens = 0
        while self._flows and len(batch) < self.max_batch:
            full = False
            for key in list(self._flows):
                f = self._flows[key]
                self._drop_finished(f)
                if not f.jobs:
                    del self._flows[key]
                    continue
                head = f.jobs[0]
                if batch and self.max_batch_tokens is not None and \
                        tokens + len(head.ids[head.next_row]) > self.max_batch_tokens:
                    full = True  # this flow's turn starts the next batch
                    break
                f.deficit += self.quantum
                while f.jobs and len(batch) < self.max_batch:
                    job = f.jobs[0]
                    n = len(job.ids[job.next_row])
                    if n > f.deficit and f.deficit < self.quantum:
                        break  # spent this round (a row longer than the quantum still goes on a fresh credit)
                    if batch and self.max_batch_tokens is not None and tokens + n > self.max_batch_tokens:
                        full = True
                        break
                    batch.append((job, job.next_row))
                    job.next_row += 1
                    tokens += n
                    f.deficit = max(0, f.deficit - n)
                    f.chunk_taken += 1
                    if job.rows_left == 0:
                        f.jobs.popleft()
                        f.chunk_taken = 0
                    elif f.chunk_taken >= self.request_chunk:
                        f.jobs.rotate(-1)  # this request had its chunk: the flow's next request goes on
                        f.chunk_taken = 0
                    self._drop_finished(f)
                self._flows.move_to_end(key)  # the next round (and the next batch) starts after it
                if not f.jobs:
                    del self._flows[key]
                    f.deficit = 0
                if full or len(batch) >= self.max_batch:
                    break
            if full:
                break
        return batch


class EmbeddingBatcher:
    """Batches the inputs of concurrent requests fairly (see the module docstring and `FairQueue`)."""

    def __init__(self, encoder: Encoder, max_batch: int = 32, on_batch=None, *, request_chunk: int | None = None,
                 max_batch_tokens: int | None = None):
        self.encoder = encoder
        self.max_batch = max(1, max_batch)
        self.on_batch = on_batch or (lambda n, seconds: None)
        self.queue = FairQueue(self.max_batch, quantum=max(1, int(getattr(encoder, "max_tokens", 512))),
                               request_chunk=request_chunk, max_batch_tokens=max_batch_tokens)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.in_flight_inputs = 0
        self.in_flight_tokens = 0
        self.running = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="embed-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def embed(self, ids: list[list[int]], tenant: str | None = None) -> torch.Tensor:
        """[len(ids), dimension] for one request's inputs (already checked); `tenant` is its flow."""
        job = _Job(ids=ids, future=asyncio.get_running_loop().create_future(), flow=tenant or "",
                   out=[None] * len(ids))
        tokens = sum(len(r) for r in ids)
        self.in_flight_inputs += len(ids)
        self.in_flight_tokens += tokens
        self.running += 1
        try:
            self.queue.push(job)
            self._wake.set()
            return await job.future
        finally:
            if not job.future.done():
                job.future.cancel()  # a cancelled request's rows are skipped by the queue
            self.in_flight_inputs -= len(ids)
            self.in_flight_tokens -= tokens
            self.running -= 1

    async def _loop(self) -> None:
        import time

        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [(j, i) for j, i in self.queue.next_batch() if not j.future.done()]
            if not batch:
                continue
            batch.sort(key=lambda ji: len(ji[0].ids[ji[1]]))
            started = time.perf_counter()
            try:
                emb = await asyncio.to_thread(self.encoder.embed_ids, [j.ids[i] for j, i in batch])
            except Exception as e:  # a failed batch fails its requests, not the loop
                log.exception("embedding batch failed")
                for j, _ in batch:
                    if not j.future.done():
                        j.future.set_exception(e)
                continue
            self.on_batch(len(batch), time.perf_counter() - started)
            for row, (j, i) in zip(emb, batch, strict=True):
                if j.future.done():
                    continue
                j.out[i] = row
                j.done += 1
                if j.done == len(j.ids):
                    j.future.set_result(torch.stack(j.out))  # type: ignore[arg-type]


def base64_float32(vector: torch.Tensor) -> str:
    """OpenAI's `encoding_format: base64`: the little-endian float32 bytes, base64-encoded."""
    import base64

    return base64.b64encode(vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode("ascii")
