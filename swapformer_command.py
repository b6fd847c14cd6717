"""The `swapformer` console script (pyproject.toml: [project.scripts]).

Importing the `swapformer` package imports torch and transformers and registers the models, which takes
seconds. This module lives outside the package, so `swapformer`, `swapformer --help` and
`swapformer --version` answer from here without that import; a subcommand is handed to
`swapformer.cli.main`, which imports only that subcommand's module. The table of subcommands and their
one-line summaries is kept here and read by `swapformer.cli`.
"""

from __future__ import annotations

import argparse
import sys
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
    "backends": ("swapformer.cli", "print the attention backend capability table (Markdown)"),
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if chosen(argv) is None:  # help, version or a usage error: argparse answers and exits
        parser, commands = top_parser()
        for name, (_module, summary) in SUBCOMMANDS.items():
            commands.add_parser(name, help=summary, add_help=False)
        try:
            parser.parse_known_args(argv)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    refusal = finished_run_refusal(argv[argv.index("train") + 1 :]) if chosen(argv) == "train" else None
    if refusal:
        print(f"swapformer train: error: {refusal}", file=sys.stderr)
        return 2
    from swapformer.cli import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
