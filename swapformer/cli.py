"""The `swapformer` command line."""

from __future__ import annotations

import argparse
import sys


def _backends(args: argparse.Namespace) -> int:
    from .configuration import capability_table_markdown

    print(capability_table_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swapformer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser("backends", help="print the attention backend capability table (Markdown)")
    backends.set_defaults(func=_backends)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
