"""The serving room: a replica's HTTP face and the path of a request through it.

Owns the Litestar app and its lifespan (`app`), `LoraHandler` with TorchServe's lifecycle
(initialize / preprocess / inference / postprocess: request preparation, admission, streaming;
`handler`), Prometheus metrics (`metrics`), the memory defaults (`sizing`) and the `lorafarm
replica` CLI (`cli`).

May import: every room before it (`handler.model`, `handler.grammar`, `handler.engine`,
`handler.adapters`), `lorafarm`, `archives`, and modules of this room.
"""
