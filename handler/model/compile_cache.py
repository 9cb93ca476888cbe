"""Where a replica keeps what it compiles, so a restart (or the next test run) loads it instead of
compiling again: the C kernels (handler/model/csrc, `small_gemm.build`) and inductor's kernels
(torch.compile: the paged decode kernel, `--compile`), under one root shared by every replica of a
farm: `--cache-dir`, else $LORAFARM_CACHE_DIR, else ~/.cache/lorafarm.

Keys: a C library's file name hashes its sources, compiler and flags; inductor's folder is named
by the torch version and the CPU's instruction set (inside it, inductor keys each kernel by its
graph and options itself). A cache copied to another machine is reused only where all of that matches.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

KERNEL_ENV = "LORAFARM_KERNEL_DIR"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_root() -> Path:
    return Path(os.environ.get("LORAFARM_CACHE_DIR") or Path.home() / ".cache" / "lorafarm")


def inductor_key() -> str:
    """torch's version and the CPU's instruction set (as torch dispatches on it) and architecture."""
    return f"torch-{torch.__version__}-{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}".replace("+", "_")


def use(root: str | Path | None = None) -> dict[str, str]:
    """Point this process's compile caches under `root` (`--cache-dir`: it wins), else under
    `default_root()` where the environment does not name them already; returns the folders in use."""
    base = Path(root) if root else default_root()
    for env, path in ((KERNEL_ENV, base / "kernels"), (INDUCTOR_ENV, base / "inductor" / inductor_key())):
        if root or not os.environ.get(env):
            os.environ[env] = str(path)
    return {"kernels": os.environ[KERNEL_ENV], "inductor": os.environ[INDUCTOR_ENV]}
