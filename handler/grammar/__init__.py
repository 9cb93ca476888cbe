"""The grammar room: constrained decoding with llguidance, whose input (JSON schemas, tools) is
untrusted.

Owns the worker pool that compiles and test-runs grammars behind a process boundary (`pool`), the
engine-side matchers and allowed-token masks (`constrained`), and chat messages with tools as
prompts and tool-call parsing (`tools_prompt`).

May import: `handler.threads`, llguidance, torch, and modules of this room.
"""
