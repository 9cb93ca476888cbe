"""The adapters room: where every adapter of a replica sits and how it gets there.

Owns the tiered adapter cache (device slot <- host RAM <- local disk <- object store: `cache`), its
pure slot policy (`slots`, which the fleet simulator runs too), why an adapter cannot be served
(`errors`), the sources of the remote tier (`sources/`) and retiring old versions (`retire`).

May import: `handler.threads`, `handler.model`, `handler.engine`, `archives`, `lorafarm`, and
modules of this room.
"""
