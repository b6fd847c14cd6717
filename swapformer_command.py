"""The `swapformer` command line (pyproject.toml: [project.scripts]): its subcommand table, its error
contract and the process it runs in.

Importing the `swapformer` package imports torch and transformers and registers the models, which takes
seconds. This module lives outside the package, so `swapformer`, `--help`, `--version` and `swapformer
backends` (the capability table is plain data) answer without that import; any other subcommand imports
only its own module, in the package.

Errors: a mistake the user can fix (a ValueError, TypeError, OSError or ImportError, argparse's own usage
errors) prints one line naming the value and the fix and exits with code 2; anything else is a failure of
the run (exit code 1). No traceback unless `--debug` is given.

The console script owns its process (`main`): it drops the few lines libraries print about themselves as
they are imported (`IMPORT_NOISE`; `--debug` shows them) and stops quietly when the reader of its output
has gone (`swapformer backends | head -1`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import re
import sys
import traceback
import types
from importlib.metadata import version
from pathlib import Path

DESCRIPTION = "The `swapformer` command line."
# name -> (module with add_subcommand(subparsers), or "module:function", and the line `swapformer --help` shows)
SUBCOMMANDS = {
    "train": ("swapformer.training.cli", "pretrain a model with Accelerate and write a Hub-ready folder"),
    "convert": (
        "swapformer.conversion.cli",
        "convert a transformers checkpoint folder into swapformer (or back with --to-hf), verified",
    ),
    "backends": (
        "swapformer_command:add_backends",
        "print the attention backend capability table (Markdown)",
    ),
    "env": (
        "swapformer.env:add_env",
        "print versions, machine, speed routes and dependency checks for a bug report",
    ),
    "build-kernels": (
        "swapformer.env:add_build_kernels",
        "compile the sparse backend's native CPU kernels ahead of first use",
    ),
    "attention": (
        "swapformer.visualize_cli:add_attention",
        "draw a model's attention on a text as heatmaps (PNG, SVG or PDF)",
    ),
    "pattern": (
        "swapformer.visualize_cli:add_pattern",
        "draw which keys each layer type of a config lets a token attend (PNG, SVG or PDF)",
    ),
}
USER_ERRORS = (ValueError, TypeError, OSError, ImportError)
# what a shell reports for a Unix tool stopped by SIGPIPE (13) when the reader closed the pipe
CLOSED_PIPE_EXIT = 128 + 13
# (logger, the start of the message's format string) of what a library logs about itself as it is imported,
# nothing a user can act on: torchao (the quant and dev extras) on a CPU build of torch cannot load its CUDA
# kernels, and registers its Enums with a torch function that now warns (torch.utils._pytree).
IMPORT_NOISE = (
    ("torchao", re.compile(r"Failed to load \S+\.so: ")),
    (
        "torch.utils._pytree",
        re.compile(r"%s is an Enum subclass and is now natively supported by torch\.compile"),
    ),
)


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (its usage block for `train` alone is 20 lines)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def top_parser() -> tuple:
    """The `swapformer` parser and its subparsers action (no subcommand added yet)."""
    parser = Parser(prog="swapformer", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"swapformer {version('swapformer')}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    return parser, commands


def chosen(argv: list[str]) -> str | None:
    """The subcommand named on the command line, unless a help flag comes first."""
    for arg in argv:
        if arg in ("-h", "--help"):
            return None
        if arg in SUBCOMMANDS:
            return arg
    return None


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The parser; the subcommand `chosen` gets its full parser, the others a stub with their summary."""
    parser, commands = top_parser()
    parser.commands = commands.choices  # name -> subparser
    for name, (module, summary) in SUBCOMMANDS.items():
        if name == chosen:
            module, _, function = module.partition(":")
            getattr(importlib.import_module(module), function or "add_subcommand")(commands)
            commands.choices[name].add_argument(
                "--debug",
                action="store_true",
                default=argparse.SUPPRESS,
                help="show the traceback of an error and what libraries print as they are imported",
            )
        else:
            commands.add_parser(name, help=summary, add_help=False)
    return parser


# `swapformer train` refuses an output folder that holds a finished run unless --overwrite or --resume is given
# (training/preflight.py: check_output_dir). Running the command again is how most people meet that refusal,
# so the launcher gives it before the package import (seconds of torch and transformers); whatever it cannot
# be sure of goes to the full command. tests/cli/test_fast_rerun.py holds the two to the same words.
TRAIN_OUTPUT_DIR = "swapformer-model"  # TrainArgs.output_dir's default
TRAIN_RUN_FILE = "training_args.json"  # training/checkpointing.py: RUN_FILE
# flags that change the answer; argparse also takes any unambiguous abbreviation of them
TRAIN_DECIDING = ("--overwrite", "--resume", "--help", "--output-dir")


def finished_run_refusal(words: list[str]) -> str | None:
    """The error `swapformer train WORDS` stops with because its output folder holds a finished run, or None."""
    folder = TRAIN_OUTPUT_DIR
    for i, word in enumerate(words):
        name, has_value, value = word.partition("=")
        if name == "--output-dir" and (has_value or i + 1 < len(words)):
            folder = value if has_value else words[i + 1]
        elif name == "-h" or (
            name.startswith("--") and any(flag.startswith(name) for flag in TRAIN_DECIDING)
        ):
            return None  # --overwrite, --resume, --help, an abbreviation, or --output-dir without a value
    out = Path(folder)
    if (out / TRAIN_RUN_FILE).is_file() and (out / "config.json").is_file():
        return (
            f"--output-dir {str(out)!r} already holds a run ({TRAIN_RUN_FILE}); pass --overwrite to replace it "
            "or --resume to continue it"
        )
    return None


def run(argv: list[str] | None = None) -> int:
    """Run the command line `argv` in this process (as `swapformer.cli.main`), under the error contract."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = chosen(argv)
    try:
        parser = build_parser(name)
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # reported by the subcommand, whose --help lists what it takes
            (parser.commands[args.command] if name else parser).error(
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
    except BrokenPipeError:  # the reader has gone; the caller decides (main: exit quietly)
        raise
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


def main(argv: list[str] | None = None) -> int:
    """The console script: `run` in a process of its own, quiet about imports, quiet on a closed pipe."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" not in argv:
        quiet_third_party_imports()
    refusal = finished_run_refusal(argv[argv.index("train") + 1 :]) if chosen(argv) == "train" else None
    if refusal:
        print(f"swapformer train: error: {refusal}", file=sys.stderr)
        return 2
    try:
        code = run(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        # `head` has what it wanted: stop as a Unix tool stopped by SIGPIPE does, without a message, and
        # point stdout at devnull so that the interpreter's last flush has nothing to complain about
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE_EXIT


def quiet_third_party_imports() -> None:
    """Drop exactly the `IMPORT_NOISE` messages, whenever they are logged; every other message of those
    loggers, and every warning, still shows. Installed by the console script, never by `import swapformer`;
    a script of your own may call it before importing transformers."""
    for name, start in IMPORT_NOISE:
        logging.getLogger(name).addFilter(lambda record, start=start: not start.match(str(record.msg)))


# `swapformer backends` -----------------------------------------------------------------------------


def add_backends(subparsers) -> None:
    subparsers.add_parser(
        "backends",
        description="Print the attention backend capability table (Markdown), as in the README.",
    ).set_defaults(func=print_backends)


def print_backends(args: argparse.Namespace) -> int:
    print(capability_table_markdown())
    return 0


def capability_table_markdown() -> str:
    """`swapformer.capability_table_markdown()` without importing the package, whose `__init__` imports torch
    and transformers. configuration/capability_markdown.py and capability_table.py import nothing but each
    other and the standard library, so they load as a package of their own from the folder the import
    system finds for `swapformer.configuration`."""
    name = "_swapformer_capabilities"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = package_folders("swapformer.configuration")
        sys.modules[name] = package
    return importlib.import_module(f"{name}.capability_markdown").capability_table_markdown()


def package_folders(fullname: str) -> list[str]:
    """The folders of the package `fullname`, asked of the import system's finders directly (as an import
    does, but without running the parent packages, which `importlib.util.find_spec` would)."""
    parent = importlib.util.find_spec(fullname.rpartition(".")[0])  # a top-level name: found, not run
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(fullname, parent.submodule_search_locations) if find and parent else None
        if spec is not None and spec.submodule_search_locations:
            return list(spec.submodule_search_locations)
    raise ImportError(f"{fullname} is not installed: reinstall swapformer (pip install -e . in its checkout)")


if __name__ == "__main__":
    sys.exit(main())
