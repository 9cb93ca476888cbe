"""`DecodeStep`: a whole CPU decode step of 1-64 rows in one call to handler/model/csrc/decode_step.c.

Why: on SmolLM2-135M (30 layers) one decode row cost 59 ms on one thread, of which the products took
36 ms; the rest was host work: ~9,000 torch ops per step (dispatch, views, small temporaries, the
gather of each row's cache blocks). The C step runs the same math (the file's docstring) with the
products through the small-M kernel, attention read in place from the paged cache, and each row's
adapter delta from the LoRA slot stacks, allocating nothing in Python.

Where it applies (`why_not` says why not otherwise, and the engine keeps the torch path):
float32 weights on the CPU, the kernels built (handler/model/small_gemm.py), SiLU MLPs, no sliding window,
LoRA stacks in float32; steps whose rows are all decode rows, at most MAX_ROWS of them; a library whose
ABI table (constants, `Model` layout, LoRA groups) matches this module's definitions (`abi_mismatch`).
LORAFARM_DECODE_STEP=0 turns it off.

A row's result does not depend on the other rows of the step (module docstring of the C file); it
differs from the torch path in the last bits (another reduction order), as MKL's kernels differ from
one row count to another.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from handler.model import small_gemm
from handler.model.lora import GROUPS

log = logging.getLogger(__name__)

# The C side's ABI, mirrored here by hand: MAX_ROWS, MAX_MODULES, the GROUPS order and `_Model`'s layout
# are checked against the library's own table (`abi_mismatch`) before it is used.
MAX_ROWS = 64  # decode_step.c MAX_ROWS
_MAX_MODULES = 3  # decode_step.c MAX_MODULES
_P = ctypes.c_void_p


class _Model(ctypes.Structure):
    """decode_step.c `Model`, field for field (its size and offsets are checked at load: `abi_mismatch`)."""

    _fields_ = [(n, ctypes.c_long) for n in
                ("hidden", "heads", "kv_heads", "head_dim", "inter", "vocab", "layers", "block_size")] + [
        ("eps", ctypes.c_float),
        *((n, ctypes.POINTER(_P)) for n in
          ("in_norm", "post_norm", "qkv", "qkv_b", "o", "o_b", "gate_up", "gate_up_b", "down", "down_b")),
        ("k_cache", _P), ("v_cache", _P), ("cache_layer_stride", ctypes.c_long),
        *((n, _P) for n in ("embed", "norm", "lm_head", "cos", "sin")),
        ("pools", ctypes.c_long), ("rank", ctypes.POINTER(ctypes.c_long)),
        ("lora_a", ctypes.POINTER(_P)), ("lora_b", ctypes.POINTER(_P)),
    ]  # fmt: skip


class _AbiItem(ctypes.Structure):
    """decode_step.c `AbiItem`: one (name, value) pair of the library's ABI table."""

    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_long)]


def expected_abi() -> dict[str, int]:
    """The ABI this module's definitions assume, named as decode_step.c's table names it."""
    want = {"MAX_ROWS": MAX_ROWS, "MAX_MODULES": _MAX_MODULES, "GROUPS": len(GROUPS),
            # the index arrays passed as `const long *` are int64 tensors
            "sizeof(long)": torch.empty((), dtype=torch.long).element_size(),
            "sizeof(Model)": ctypes.sizeof(_Model)}
    want.update({f"Model.{name}": getattr(_Model, name).offset for name, *_ in _Model._fields_})
    for g, (name, modules) in enumerate(GROUPS.items()):
        want[f"group.{name}"] = g
        want.update({f"group.{name}.{m}": j for j, m in enumerate(modules)})
    return want


def library_abi(lib) -> dict[str, int]:
    """The ABI table the library reports (decode_step.c `lf_decode_step_abi`)."""
    fn = lib.lf_decode_step_abi
    fn.argtypes = [ctypes.POINTER(ctypes.POINTER(_AbiItem))]
    fn.restype = ctypes.c_long
    items = ctypes.POINTER(_AbiItem)()
    n = fn(ctypes.byref(items))
    return {items[i].name.decode(): items[i].value for i in range(n)}


def abi_mismatch(lib=None) -> str | None:
    """Why the kernels' library (`small_gemm.library()` by default) does not match this module's
    definitions, naming each item that differs (the library's value first); None when it matches."""
    lib = small_gemm.library() if lib is None else lib
    try:
        have = library_abi(lib)
    except AttributeError:  # a library built from sources older than the table
        return "C decode step ABI mismatch: the library has no lf_decode_step_abi"
    want = expected_abi()
    names = [*have, *(n for n in want if n not in have)]
    names.sort(key=lambda n: n in have and n in want)  # an item one side lacks first (a field removed, added)
    bad = [f"{n} {have.get(n, 'missing')} vs {want.get(n, 'missing')}"
           for n in names if have.get(n) != want.get(n)]
    if not bad:
        return None
    more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
    return f"C decode step ABI mismatch (decode_step.c vs decode_step.py): {'; '.join(bad[:4])}{more}"


def _ptrs(tensors) -> ctypes.Array:
    return (_P * len(tensors))(*(t.data_ptr() if t is not None else None for t in tensors))


def why_not(runner, kv, lora) -> str | None:
    """Why the C step cannot serve this runner (None: it can)."""
    cfg = runner.config
    if os.environ.get("LORAFARM_DECODE_STEP", "1") == "0":
        return "LORAFARM_DECODE_STEP=0"
    if runner.device.type != "cpu" or runner.dtype != torch.float32:
        return "not float32 on the CPU"
    if cfg.hidden_act not in ("silu", "swish"):
        return f"activation {cfg.hidden_act}"
    if any(w is not None for w in cfg.sliding_windows):
        return "sliding-window layers"
    if cfg.num_heads % cfg.num_kv_heads or cfg.head_dim % 2:
        return "head layout"
    if lora is not None and lora.dtype != torch.float32:
        return "LoRA stacks not float32"
    if kv.dtype != torch.float32 or not (kv.k.is_contiguous() and kv.v.is_contiguous()):
        return "KV cache layout"
    tensors = [runner.embed, runner.norm, runner.lm_head, runner.cos, runner.sin]
    for L in runner.layers:
        tensors += [getattr(L, a) for a in L.__slots__ if getattr(L, a) is not None]
    if not all(t.is_contiguous() for t in tensors):
        return "non-contiguous weights"
    if not small_gemm.library():
        return "CPU kernels not built"
    if why := abi_mismatch():
        log.warning("%s: decode steps use the torch path", why)
        return why
    return None


class DecodeStep:
    """The C decode step bound to one runner, KV cache and (optional) `ModelLoRA`: the pointer tables
    are built once (weights, caches and stacks stay where they are; merge and slot writes happen in place)."""

    def __init__(self, runner, kv, lora=None):
        if why := abi_mismatch():  # `why_not` says so first; never call into a library laid out otherwise
            raise RuntimeError(why)
        cfg = runner.config
        self.runner, self.kv, self.lora = runner, kv, lora
        L = runner.layers
        self._keep = []  # every ctypes array the struct points into

        def arr(tensors):
            a = _ptrs(tensors)
            self._keep.append(a)
            return ctypes.cast(a, ctypes.POINTER(_P))

        m = _Model(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                   cfg.vocab_size, cfg.num_layers, kv.block_size, cfg.rms_norm_eps)
        for name in ("in_norm", "post_norm", "qkv", "qkv_b", "o", "o_b", "gate_up", "gate_up_b", "down", "down_b"):
            setattr(m, name, arr([getattr(layer, name) for layer in L]))
        m.k_cache, m.v_cache = kv.k.data_ptr(), kv.v.data_ptr()
        m.cache_layer_stride = kv.k.stride(0)
        m.embed, m.norm, m.lm_head = runner.embed.data_ptr(), runner.norm.data_ptr(), runner.lm_head.data_ptr()
        m.cos, m.sin = runner.cos.data_ptr(), runner.sin.data_ptr()
        if lora is not None:
            names = list(GROUPS)
            a, b = [], []
            for layer in lora.layers:
                for g in names:
                    grp = layer[g]
                    for p in range(len(lora.pools)):
                        a.append(grp.A[p])
                        b += [grp.B[p][j] if j < len(grp.modules) else None for j in range(_MAX_MODULES)]
            ranks = (ctypes.c_long * len(lora.pools))(*(r for r, _ in lora.pools))
            self._keep.append(ranks)
            m.pools, m.rank, m.lora_a, m.lora_b = len(lora.pools), ranks, arr(a), arr(b)
        self._model = m
        fn = small_gemm.library().lf_decode_step
        fn.argtypes = [ctypes.POINTER(_Model), ctypes.c_long] + [_P] * 4 + [ctypes.c_long] + [_P] * 3 + [
            ctypes.c_int, ctypes.c_long]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.steps = 0  # steps it ran (engine metrics, tests)

    def __call__(self, rows: list[tuple[int, int, list[int]]], slots: list[int]) -> torch.Tensor:
        """Logits [M, vocab] of decode rows [(token, position, block table)], each on global LoRA slot
        `slots[i]` (0: none); writes each row's K/V at its position."""
        M = len(rows)
        if not 1 <= M <= MAX_ROWS:
            raise ValueError(f"{M} rows: the C decode step takes 1-{MAX_ROWS}")
        bs = self.kv.block_size
        V, P, B = self.runner.config.vocab_size, self.runner.cos.shape[0], self.kv.k.shape[1]
        # C reads where these point: anything out of range is refused here, never read
        if not all(0 <= t < V and 0 <= p < P and 0 < p // bs + 1 <= len(tb) and all(0 <= b < B for b in tb[: p // bs + 1])
                   for t, p, tb in rows):
            raise ValueError("decode row out of range (token, position or block table)")
        nb = max(p // bs + 1 for _, p, _ in rows)
        tok = torch.tensor([t for t, _, _ in rows], dtype=torch.long)
        pos = torch.tensor([p for _, p, _ in rows], dtype=torch.long)
        cache = torch.tensor([tb[p // bs] * bs + p % bs for _, p, tb in rows], dtype=torch.long)
        tables = torch.tensor([tb[:nb] + [self.kv.null_block] * (nb - len(tb[:nb])) for _, _, tb in rows],
                              dtype=torch.long)
        where = [self.lora.pool_of(s) if s else (-1, 0) for s in slots] if self.lora is not None else [(-1, 0)] * M
        pool = torch.tensor([p for p, _ in where], dtype=torch.long)
        local = torch.tensor([s for _, s in where], dtype=torch.long)
        logits = torch.empty((M, V), dtype=torch.float32)
        rc = self._fn(ctypes.byref(self._model), M, tok.data_ptr(), pos.data_ptr(), cache.data_ptr(), tables.data_ptr(),
                      nb, pool.data_ptr(), local.data_ptr(), logits.data_ptr(), torch.get_num_threads(),
                      small_gemm.PARALLEL_MIN)
        if rc != 0:
            raise RuntimeError(f"decode step failed ({'out of memory' if rc == -2 else 'bad arguments'})")
        self.steps += 1
        return logits
