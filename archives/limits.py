"""Size caps of archive members, checked against the tar header before any byte is read.

The weights cap leaves room for a rank-64 adapter of a 70B model in float32 (a few GB) while
stopping a member that claims terabytes; the small members are capped tightly because they are
read into memory whole.
"""

from __future__ import annotations

MAX_MANIFEST_BYTES = 64 * 1024
SIGNATURE_BYTES = 64  # a raw Ed25519 signature: exactly this size
MAX_CONFIG_BYTES = 1024 * 1024
MAX_WEIGHTS_BYTES = 16 * 1024**3
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

# Files above this size get a tqdm bar while being hashed (when the caller asks for progress).
PROGRESS_MIN_BYTES = 64 * 1024 * 1024
