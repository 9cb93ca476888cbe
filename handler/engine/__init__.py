"""The engine room: continuous batching of many adapters' requests over one base model.

Owns the `Engine` façade (`engine`) and what it is made of: the configuration (`config`), the
requests and their events (`request`), the slot table of mounted adapters (`slot_table`), the
scheduler that admits, preempts and plans each step (`scheduler`) by the pure fairness policy
between tenants (`fairness`), the step executor chosen once at start-up (`executor`), the output
processor (detokenisation, stops, events: `output`), per-request sampling (`sampling`) and
speculative drafts (`speculate`).

May import: `handler.model`, `handler.grammar`, and modules of this room.
"""
