"""The `swapformer` command line.

Each subcommand lives beside the code it drives, in a module with an ``add_subcommand(subparsers)``
function. Only the chosen subcommand's module is imported; the table of subcommands with the one-line
summaries that `swapformer --help` lists is in `swapformer_command.py`, the console script, which
answers `--help` and `--version` without importing this package (and with it torch and transformers).

Errors: a mistake the user can fix (a ValueError, TypeError, OSError or ImportError, argparse's own
usage errors) prints one line naming the value and the fix and exits with code 2; anything else is a
failure of the run (exit code 1). No traceback unless `--debug` is given.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from swapformer_command import SUBCOMMANDS, top_parser
from swapformer_command import chosen as chosen_subcommand

USER_ERRORS = (ValueError, TypeError, OSError, ImportError)


def add_subcommand(subparsers) -> None:
    subparsers.add_parser(
        "backends",
        description="Print the attention backend capability table (Markdown), as in the README.",
    ).set_defaults(func=_backends)


def _backends(args: argparse.Namespace) -> int:
    from .configuration import capability_table_markdown

    print(capability_table_markdown())
    return 0


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The parser; the subcommand `chosen` gets its full parser, the others a stub with their summary."""
    parser, commands = top_parser()
    parser.commands = commands.choices  # name -> subparser
    for name, (module, summary) in SUBCOMMANDS.items():
        if name == chosen:
            module, _, function = module.partition(":")
            getattr(importlib.import_module(module), function or "add_subcommand")(commands)
            sub = commands.choices[name]
            sub.add_argument(
                "--debug",
                action="store_true",
                default=argparse.SUPPRESS,
                help="show the traceback of an error",
            )
        else:
            commands.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = chosen_subcommand(argv)
    try:
        parser = build_parser(chosen)
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # reported by the subcommand, whose --help lists what it takes
            (parser.commands[args.command] if chosen else parser).error(
                f"unrecognized arguments: {' '.join(unknown)}"
            )
    except SystemExit as e:  # --help, --version, usage errors: argparse has printed what it had to say
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    prog = f"swapformer {args.command}"
    try:
        return args.func(args)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", 2)
        print(f"{prog}: interrupted{f' ({e})' if str(e) else ''}", file=sys.stderr)
        return 128 + signum
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        print(error_line(prog, e, debug=args.debug), file=sys.stderr)
        return 2 if isinstance(e, USER_ERRORS) else 1


def error_line(prog: str, error: BaseException, *, debug: bool = False) -> str:
    """One line for `error`: its message (the value and the fix, for our own errors), with the type
    for errors that are not the user's to fix."""
    message = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, USER_ERRORS):
        return f"{prog}: error: {message}"
    hint = "" if debug else "; rerun with --debug for the traceback"
    return f"{prog}: failed: {type(error).__name__}: {message}{hint}"


if __name__ == "__main__":
    sys.exit(main())
