"""Read and validate a safetensors header without loading tensors (and without torch).

Used on untrusted bytes (archive members, uploaded adapters) and on 14 GB base checkpoints, so it
reads only the header, checks every offset against the file size, and reports problems as
`ValueError` messages that callers wrap in their own `ArchiveError` subclass.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

from archives.limits import MAX_SAFETENSORS_HEADER_BYTES

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

# Leading bytes of formats people save by mistake: a clearer message than "bad header".
_PICKLE_MAGIC = b"\x80"  # pickle protocol 2+ (torch.save before 1.6, plain pickle)
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save since 1.6: a zip holding a pickle


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offsets of the tensor's bytes
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int


def read_header(f: BinaryIO, size: int) -> SafetensorsHeader:
    """Parse the header of a safetensors file of `size` bytes read from `f` (positioned at 0)."""
    if size < 8:
        raise ValueError(f"too short for safetensors ({size} bytes)")
    prefix = f.read(8)
    if len(prefix) != 8:
        raise ValueError("truncated safetensors header")
    if prefix.startswith(_ZIP_MAGIC) or prefix.startswith(_PICKLE_MAGIC):
        raise ValueError("this is a pickle (torch.save) file, not safetensors; pickles are never loaded")
    (n,) = struct.unpack("<Q", prefix)
    if n == 0 or n > MAX_SAFETENSORS_HEADER_BYTES or 8 + n > size:
        raise ValueError(f"not a safetensors file (header length {n} for a {size}-byte file)")
    raw = f.read(n)
    if len(raw) != n:
        raise ValueError("truncated safetensors header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ValueError("safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("safetensors __metadata__ must map strings to strings")

    data_start = 8 + n
    data_len = size - data_start
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"tensor {name!r}: shape must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ValueError(f"tensor {name!r}: data_offsets must be two integers")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"tensor {name!r}: data_offsets {offsets} outside the {data_len}-byte data")
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes for shape {shape} of {dtype}")
        tensors[name] = TensorInfo(dtype, tuple(shape), data_start + begin, data_start + end)
        spans.append((begin, end))
    # Like the safetensors library: the tensors tile the data section exactly, no gaps or overlaps
    # (so no hidden bytes ride along unchecked).
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            raise ValueError("safetensors data has gaps or overlapping tensors")
        pos = end
    if pos != data_len:
        raise ValueError(f"safetensors data is {data_len} bytes but its tensors cover {pos}")
    return SafetensorsHeader(tensors, metadata, data_start)


def read_file_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The header of a safetensors file on disk (ValueError when it is malformed)."""
    with open(path, "rb") as f:
        return read_header(f, os.fstat(f.fileno()).st_size)
