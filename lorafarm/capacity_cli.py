"""`lorafarm capacity`: the fleet's sizing arithmetic (lorafarm.capacity) as a table or JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from lorafarm.errors import CliError


def _capacity(args: argparse.Namespace) -> int:
    from lorafarm import capacity as cap

    inp = cap.inputs_from_args(args)
    try:
        report = cap.compute(inp)
    except (ValueError, ZeroDivisionError) as e:
        raise CliError(f"bad input: {e}") from None
    if args.json:
        print(json.dumps({"inputs": asdict(inp), **report.as_dict()}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lorafarm capacity", show_lines=False)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("from")
    for row in cap.rows(report, inp):
        table.add_row(*row)
    Console(width=max(100, Console().width)).print(table)
    return 0


def register(sub) -> None:
    from lorafarm.capacity import add_flags

    p = sub.add_parser("capacity", help="the fleet's sizing arithmetic: adapter and KV bytes, replicas, cost",
                       description="The seed's capacity math from its inputs (defaults are the seed's: 7B "
                                   "shapes, rank 16, an 80 GB GPU, 5,000 adapters at 40 req/s).")
    add_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=_capacity)
