"""`linear(x, w, b)`: F.linear, through our small-M kernel (handler/model/csrc/small_gemm.c) when a CPU
decode step multiplies 1-64 float32 rows by a weight.

Measured on the 2-core EPYC box (SmolLM2-135M shapes, `make bench -k small_gemm`): MKL's sgemm costs
2-4x more for 2-8 rows than for one, although the work is bound by reading the weight once; the kernel
reads each weight row once for all rows (past 8 rows, once per tile for every chunk of rows), and beat
MKL up to 64 rows on 2 threads. Above MAX_ROWS (prefill) MKL's blocked GEMM is used as before.

The kernel is compiled at first use with the system C compiler into a cache folder keyed by the
sources, compiler, architecture and flags ($LORAFARM_KERNEL_DIR, else the compile cache's kernels/:
handler/model/compile_cache.py), written atomically, and loaded with ctypes. Where it cannot be had
(no compiler, no AVX2/FMA, another OS) or LORAFARM_SMALL_GEMM=0, `linear` is F.linear: the kernel is an optimisation, never a requirement.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from handler.model import compile_cache

log = logging.getLogger(__name__)

MAX_ROWS = 64  # past it (prefill) MKL's blocked GEMM; below, measured faster than MKL on 2 threads up to 64 rows
# Threads only for a product this big (multiply-adds; the LM head, not a layer's weights): a parallel
# region is a barrier, and on a busy box a barrier per projection waits on a descheduled thread (measured
# under stress-ng: 2 threads on every product made a decode step 2.4x slower than MKL, which keeps such
# small products on one thread). LORAFARM_PARALLEL_PRODUCTS=all puts every product (and the C decode
# step's LoRA rows) on torch's threads: for a host whose cores serve the replica alone, where it makes a
# single-stream decode step of SmolLM2 1.4x faster on 2 cores (docs/benchmarks.md).
PARALLEL_MIN = 0 if os.environ.get("LORAFARM_PARALLEL_PRODUCTS", "") == "all" else 8 << 20
# one library for the CPU kernels: decode_step.c includes small_gemm.c (its products go through it)
CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "decode_step.c"
SOURCES = (CSRC / "small_gemm.c", SOURCE)
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
LIBS = ["-lm"]

_lock = threading.Lock()
_lib = None  # the loaded library, or False when it cannot be had (checked once per process)
_fn = None  # its small-M linear, or False


def _cache_dir() -> Path:
    env = os.environ.get(compile_cache.KERNEL_ENV)
    return Path(env) if env else compile_cache.default_root() / "kernels"


def _compiler_id(cc: str) -> str:
    """The compiler's own version line: a cache shared between machines never mixes compilers."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.splitlines() or [""])[0]


def _cpu_ok() -> bool:
    """AVX2 with FMA, as torch's own dispatch sees the CPU ("AVX2" implies both, "AVX512" too)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernels (once per sources and flags) and return the shared library's path.
    Raises RuntimeError with the compiler's message when it cannot be built."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    # keyed by every source's bytes: a library built from other sources is never reused (and the C decode
    # step's ABI table is checked at load besides: handler/model/decode_step.py `abi_mismatch`)
    src = b"\0".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(src + "\0".join([cc, _compiler_id(cc), platform.machine(), *FLAGS, *LIBS]).encode()
                         ).hexdigest()[:16]
    d = out_dir or _cache_dir()
    lib = d / f"lorafarm_kernels-{key}.so"
    if lib.exists():
        return lib
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".lorafarm_kernels-", suffix=".so", dir=d)
    os.close(fd)
    try:  # compile to a private name, then rename: a concurrent process never loads half a file
        r = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, *LIBS], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def library():
    """The kernels' shared library (ctypes.CDLL), or False where it cannot be had or
    LORAFARM_SMALL_GEMM=0 (then decode steps use torch alone)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        if os.environ.get("LORAFARM_SMALL_GEMM", "1") == "0" or not _cpu_ok():
            _lib = False
            return _lib
        try:
            _lib = ctypes.CDLL(str(build()))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("CPU decode kernels unavailable, decode steps use torch alone: %s", e)
            _lib = False
    return _lib


def _load():
    global _fn
    if _fn is not None:
        return _fn
    lib = library()
    if not lib:
        _fn = False
        return _fn
    f = lib.lf_small_m_linear
    f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    f.restype = ctypes.c_int
    _fn = f
    return _fn


def available() -> bool:
    """Whether `linear` uses the kernel for small row counts in this process."""
    return bool(_load())


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The kernel's domain: 1-64 contiguous float32 CPU rows by a contiguous float32 CPU weight."""
    return (
        x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and w.dtype == torch.float32
        and x.device.type == "cpu" and w.device.type == "cpu" and x.is_contiguous() and w.is_contiguous()
        and not x.requires_grad and not w.requires_grad and x.shape[1] == w.shape[1]
    )  # fmt: skip


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b); for 1-64 float32 rows on the CPU, the small-M kernel (same math, its own
    fixed reduction order per row)."""
    if not applies(x, w):
        return F.linear(x, w, b)
    fn = _load()
    if not fn:
        return F.linear(x, w, b)
    M, K = x.shape
    D = w.shape[0]
    y = torch.empty((M, D), dtype=torch.float32)
    threads = torch.get_num_threads() if M * K * D >= PARALLEL_MIN else 1
    if fn(x.data_ptr(), w.data_ptr(), y.data_ptr(), M, K, D, threads) != 0:
        return F.linear(x, w, b)
    if b is not None:
        y += b
    return y
