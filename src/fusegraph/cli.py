"""The `fusegraph` command: thin over the library. Each subcommand lives beside the code it
drives and registers itself through an `add_parser(subparsers)` function."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

# module paths that define add_parser(subparsers); each sets `func` on its parser.
COMMAND_MODULES = (
    "fusegraph.commands.demo",
    "fusegraph.commands.version",
    "fusegraph.tune.commands",
    "fusegraph.perf.commands",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusegraph", description="fusegraph: a deep-learning graph compiler "
                                     "for NVIDIA GPUs.")
    parser.add_argument("--version", action="version", version=f"fusegraph {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for path in COMMAND_MODULES:
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as err:
            if err.name == path:  # not written yet
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
