"""The embedding room: a replica of another task, serving one encoder with the replica's contract.

Owns the encoder and its fair batcher (`model`) and its HTTP app (`app`).

May import: `handler.serving` (the shared HTTP pieces), `lorafarm`, and modules of this room.
"""
