"""The serving room: a replica's HTTP face and the path of a request through it.

Owns `LoraHandler` with TorchServe's lifecycle (initialize / preprocess / admit / inference /
postprocess or stream: request preparation, load shedding, admission, SSE streaming; `handler`),
the Litestar app, its lifespan and the replica's registry duties, whose completion routes only read
the request and answer through the handler (`app`), the replica's configuration (`ReplicaConfig`,
`Limits`; the engine's settings ride in it whole as an `EngineConfig`: `config`), the fair
share rule of admission shedding (`shedding`), the per-tenant prep pool (`prep`), Prometheus
metrics (`metrics`), the memory defaults (`sizing`) and the `lorafarm replica` CLI (`cli`).

May import: every room before it (`handler.model`, `handler.grammar`, `handler.engine`,
`handler.adapters`), `lorafarm`, `archives`, and modules of this room.
"""
