"""Render the benchmark results of `make bench` (var/bench/*.json) into docs/benchmarks.md and
its plots: the explicit step that rewrites tracked files (a benchmark run never does).

    make bench-docs        # or: python -m benchmarks.render_docs [results folder]
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.conftest import DOCS, RESULTS, render


def main(argv: list[str]) -> int:
    results = Path(argv[0]) if argv else RESULTS
    if not any(results.glob("*.json")):
        print(f"render_docs: no results in {results}; run `make bench` first", file=sys.stderr)
        return 2
    render(results, DOCS)
    print(f"render_docs: {DOCS / 'benchmarks.md'} from {results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
