"""Console scripts of the running interpreter's environment.

`make test` runs `.venv/bin/python -m pytest` without activating the venv, so a script installed
there (`transformers`) is not on PATH: look next to `sys.executable` first."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def console_script(name: str) -> str | None:
    """The path of `name` in this interpreter's bin folder, else on PATH, else None."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    return shutil.which(name)
