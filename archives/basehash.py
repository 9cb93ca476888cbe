"""The base-model hash: which base checkpoint an adapter was trained on.

`base_model_hash(dir)` is a sha256 over every tensor of every `*.safetensors` file in the folder
(sharded checkpoints too), taken in tensor-name order: for each tensor its name, dtype and shape,
then its raw bytes. Because it hashes tensors rather than files, re-sharding or re-saving the same
weights keeps the hash, while any changed weight, dtype or shape changes it. The registry and the
replica both call this one function, so their hashes agree by construction.

Files are streamed (a 14 GB base is never read into memory) and the result is cached outside the
checkpoint (nothing is ever written into a model folder, which may be a read-only store): one JSON
file per folder in `cache_dir()` ($LORAFARM_BASEHASH_CACHE_DIR, else $LORAFARM_CACHE_DIR/basehash,
else ~/.cache/lorafarm/basehash; `lorafarm up` points it into its state dir), keyed by the folder's
path and its files' names, sizes and mtimes. An unwritable cache is simply not used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
from pathlib import Path

from archives.digest import BLOCK, progress_bar
from archives.errors import InvalidBaseModelError
from archives.safetensors_header import TensorInfo, read_file_header

CACHE_ENV = "LORAFARM_BASEHASH_CACHE_DIR"
ALGORITHM = "lorafarm-basehash-v1"  # bump when the hashed byte stream changes


def _checkpoint_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise InvalidBaseModelError(f"base model folder {model_dir} does not exist or is not a folder")
    files = sorted(p for p in model_dir.glob("*.safetensors") if not p.name.startswith(".") and p.is_file())
    if not files:
        raise InvalidBaseModelError(f"base model folder {model_dir} has no *.safetensors checkpoint")
    return files


def _cache_key(files: list[Path]) -> list[list]:
    key = []
    for p in files:
        st = p.stat()
        key.append([p.name, st.st_size, st.st_mtime_ns])
    return key


def cache_dir() -> Path:
    """Where base hashes are cached (see module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if os.environ.get("LORAFARM_CACHE_DIR"):
        return Path(os.environ["LORAFARM_CACHE_DIR"]) / "basehash"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorafarm" / "basehash"


def cache_path(model_dir: str | os.PathLike) -> Path:
    """The cache file for one checkpoint folder (named after its resolved path)."""
    where = str(Path(model_dir).resolve())
    return cache_dir() / f"{hashlib.sha256(where.encode()).hexdigest()[:32]}.json"


def _read_cache(model_dir: Path, key: list[list]) -> str | None:
    try:
        cached = json.loads(cache_path(model_dir).read_text())
        if (cached.get("algorithm") == ALGORITHM and cached.get("files") == key
                and cached.get("folder") == str(model_dir.resolve())):
            value = cached.get("base_model_hash")
            if isinstance(value, str) and value.startswith("sha256:"):
                return value
    except (OSError, ValueError, AttributeError):
        pass  # no cache, or a damaged one: recompute
    return None


def _write_cache(model_dir: Path, key: list[list], value: str) -> None:
    path = cache_path(model_dir)
    body = json.dumps({"algorithm": ALGORITHM, "folder": str(model_dir.resolve()), "files": key,
                       "base_model_hash": value}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError:
        return  # unwritable cache: hash every time
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body + "\n")
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def compute_base_model_hash(model_dir: str | os.PathLike, *, progress: bool = False) -> str:
    """The hash without the cache (see module docstring for what is hashed)."""
    model_dir = Path(model_dir)
    files = _checkpoint_files(model_dir)
    index: dict[str, tuple[Path, TensorInfo]] = {}
    for path in files:
        try:
            header = read_file_header(path)
        except ValueError as e:
            raise InvalidBaseModelError(f"base checkpoint {path}: {e}") from None
        for name, info in header.tensors.items():
            if name in index:
                raise InvalidBaseModelError(
                    f"tensor {name!r} appears in both {index[name][0].name} and {path.name}"
                )
            index[name] = (path, info)

    h = hashlib.sha256(ALGORITHM.encode() + b"\n")
    total = sum(info.end - info.start for _, info in index.values())
    handles: dict[Path, object] = {}
    try:
        with progress_bar(total, f"base hash {model_dir.name}", progress) as bar:
            for name in sorted(index):
                path, info = index[name]
                f = handles.get(path) or handles.setdefault(path, open(path, "rb"))
                record = json.dumps([name, info.dtype, list(info.shape)], separators=(",", ":")).encode()
                h.update(struct.pack("<Q", len(record)) + record)
                f.seek(info.start)
                left = info.end - info.start
                while left:
                    block = f.read(min(BLOCK, left))
                    if not block:
                        raise InvalidBaseModelError(f"base checkpoint {path} is truncated")
                    h.update(block)
                    left -= len(block)
                    bar.update(len(block))
    finally:
        for f in handles.values():
            f.close()
    return "sha256:" + h.hexdigest()


def base_model_hash(model_dir: str | os.PathLike, *, progress: bool = False, use_cache: bool = True) -> str:
    """`sha256:<hex>` content hash of the base checkpoint in `model_dir` (cached in `cache_dir()`).

    Raises InvalidBaseModelError when the folder holds no readable safetensors checkpoint.
    """
    model_dir = Path(model_dir)
    key = _cache_key(_checkpoint_files(model_dir))
    if use_cache and (cached := _read_cache(model_dir, key)):
        return cached
    value = compute_base_model_hash(model_dir, progress=progress)
    # Only cache if the files did not change while we read them.
    if use_cache and _cache_key(_checkpoint_files(model_dir)) == key:
        _write_cache(model_dir, key, value)
    return value


def read_base_config(model_dir: str | os.PathLike) -> dict:
    """The base's config.json as a dict (for adapter shape checks)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise InvalidBaseModelError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError:
        raise InvalidBaseModelError(f"{path} is not valid JSON") from None
    if not isinstance(config, dict):
        raise InvalidBaseModelError(f"{path} is not a JSON object")
    return config


# -- the hash a training job records beside its adapter ---------------------------------------

TRAINED_BASE_FILE = "base_model_hash.txt"  # in the PEFT folder, beside adapter_config.json
_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def is_base_hash(value: str) -> bool:
    return bool(_HASH_RE.match(value or ""))


def read_trained_base(adapter_dir: str | os.PathLike) -> str | None:
    """The base hash recorded beside a PEFT adapter (`base_model_hash.txt`), or None when there is
    no such file. A file that holds something else than `sha256:<64 hex>` raises InvalidBaseModelError."""
    path = Path(adapter_dir) / TRAINED_BASE_FILE
    if not path.is_file():
        return None
    value = path.read_text().strip()
    if not is_base_hash(value):
        raise InvalidBaseModelError(f"{path} does not hold a base hash (sha256:<64 hex>)")
    return value


def write_trained_base(adapter_dir: str | os.PathLike, value: str) -> Path:
    """Record the base an adapter was trained on beside it (what `lorafarm adapters upload` sends)."""
    if not is_base_hash(value):
        raise InvalidBaseModelError(f"{value!r} is not a base hash (sha256:<64 hex>)")
    path = Path(adapter_dir) / TRAINED_BASE_FILE
    path.write_text(value + "\n")
    return path
