"""Image build step (deploy/Dockerfile): the real model's demo adapters for `BASE` in `OUT`, self-contained.

`lorafarm.demo_adapters.write_demo_adapters` uses the folders shipped in the installed package where
their recipe and base hashes match (else trains them into OUT); the shipped ones are copied into OUT
too, so OUT/demo.json names folders beside it and the image's seed step (deploy/compose/seed.py)
reads nothing from site-packages.

    python deploy/image/demo_adapters.py BASE OUT
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from lorafarm.demo_adapters import write_demo_adapters


def main(base: str, out: str) -> None:
    out_dir = Path(out)
    index = write_demo_adapters(base, out_dir)
    for name, info in index.items():
        folder = Path(info["path"])
        if folder.is_absolute() and folder != out_dir / name:
            shutil.copytree(folder, out_dir / name, dirs_exist_ok=True)
            info["path"] = name
        size = sum(f.stat().st_size for f in (out_dir / name).iterdir() if f.is_file())
        print(f"demo adapter {name}: {out_dir / name} ({size:,} bytes)", flush=True)
    (out_dir / "demo.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
