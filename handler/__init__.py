"""The replica: one base model serving many LoRA adapters, as rooms a newcomer can name.

Each room is a sub-package with one concept; a room imports only the rooms listed before it, never
one after it (tests/handler/test_import_graph.py checks this and that there is no import cycle):

1. `handler.model`: the model runner (a Llama-family decoder in plain torch), the batched
   multi-LoRA layers and kernels, decode attention, the paged KV cache and its block pool, the C
   decode step (csrc/). Knows nothing of requests.
2. `handler.grammar`: untrusted grammar work (llguidance) behind a process boundary, the
   engine-side token masks and tool-call parsing.
3. `handler.engine`: continuous batching: the `Engine` façade over a scheduler, a slot table, a step
   executor and an output processor; sampling and speculative drafts.
4. `handler.adapters`: the tiered adapter cache (device <- RAM <- disk <- object store), its pure
   slot policy, the adapter sources and version retirement.
5. `handler.serving`: the HTTP app (Litestar), `LoraHandler` (TorchServe's initialize / preprocess /
   inference / postprocess), load shedding, streaming and metrics.
6. `handler.embed`: the embedding worker, a replica of another task (serving's contract).

Over every room, `handler.cli` (`lorafarm replica`) reads the flags and starts a replica or an
embedding worker; nothing imports it but lorafarm's CLI. Any room may import `handler.threads`
(thread priority, per-tenant fair queues and the thread pool that serves them), which imports nothing
of handler/.

Shared with the router and registry: `lorafarm` (OpenAI wire schemas, the max_tokens rule).
"""
