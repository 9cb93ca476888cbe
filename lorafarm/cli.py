"""The `lorafarm` command. Each package registers its own subcommands through a
`register(subparsers)` function in its `cli` module; heavy imports happen inside the handlers so
`lorafarm --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

from lorafarm.errors import CliError

# Modules with a `register(subparsers)` function, in the order their commands are listed.
COMMAND_MODULES = [
    "lorafarm.dev.cli",
    "lorafarm.realmodel",
    "archives.cli",
    "handler.cli",
    "registry.cli",
    "lorafarm.farm_cli",
    "loadtests.cli",
    "router.cli",
    "lorafarm.capacity_cli",
    "loadtests.simulate_cli",
    "lorafarm.probe",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other CLI error
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lorafarm", description="Serve thousands of LoRA adapters on one base model.")
    from lorafarm import __version__

    parser.add_argument("--version", action="version", version=f"lorafarm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import warnings

    # transformers/PEFT deprecation notices (e.g. `is_gradient_checkpointing` while training the demo
    # adapters) are for their callers' developers, not for someone running a farm
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)(\.|$)")
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except CliError as e:
        print(f"lorafarm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unwritable or missing paths: a message, not a traceback
        where = f" {e.filename}" if e.filename else ""
        print(f"lorafarm {args.command}: error:{where}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
