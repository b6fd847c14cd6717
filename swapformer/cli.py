"""The `swapformer` command line.

Each subcommand lives beside the code it drives and registers itself through an
``add_subcommand(subparsers)`` function; heavy imports happen inside the handler, so
``swapformer --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# modules that contribute subcommands, each with add_subcommand(subparsers)
_SUBCOMMAND_MODULES = (
    "swapformer.training.cli",
    "swapformer.conversion.cli",
)


def _backends(args: argparse.Namespace) -> int:
    from .configuration import capability_table_markdown

    print(capability_table_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swapformer", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser("backends", help="print the attention backend capability table (Markdown)")
    backends.set_defaults(func=_backends)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).add_subcommand(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
