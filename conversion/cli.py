"""`swapformer convert SRC OUT [--to-hf] [--overwrite] [--allow-unpickling] [--max-length N --layer-types T
--window W --global-tokens K]`."""

from __future__ import annotations

import argparse


def parse_layer_types(text: str):
    """`--layer-types`: one name (for every layer) or a JSON list with one name per layer."""
    from .rules import json_list

    text = text.strip()
    if not text.startswith("["):
        return text
    try:
        return json_list(
            text,
            str,
            f"--layer-types {text} is not a valid JSON list",
            'write one name for every layer, or a list such as \'["sliding_global_attention", "full_attention"]\'',
            f"--layer-types {text} must be a JSON list of layer type names",
        )
    except ValueError as e:  # argparse reports ArgumentTypeError messages as one usage line, exit code 2
        raise argparse.ArgumentTypeError(str(e)) from e


def add_subcommand(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        description=(
            "Convert a Hugging Face checkpoint folder (BERT, RoBERTa, Longformer, BigBird, GPT-2, Llama, Mistral, T5, BART; the family "
            "is read from config.json) into a swapformer folder, then run both on the same padded batch and "
            "fail, writing nothing, if outputs differ by more than the tolerance. The folder is written under a "
            "hidden name beside OUT and renamed into place at the end: an error, Ctrl-C or SIGTERM leaves "
            "nothing behind, and an existing OUT (with --overwrite) stays intact until the new one replaces it."
        ),
    )
    parser.add_argument("src", help="folder with config.json and weights")
    parser.add_argument("out", help="folder to write (must not exist or be empty, unless --overwrite)")
    parser.add_argument(
        "--to-hf",
        action="store_true",
        help="SRC is a converted swapformer folder: write the transformers model back",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty OUT (only once the new folder is verified)",
    )
    parser.add_argument(
        "--allow-unpickling",
        action="store_true",
        help="read pickle weights (pytorch_model.bin); unpickling can run code from the file, so only for trusted checkpoints",
    )
    parser.add_argument(
        "--tolerance", type=float, default=1e-4, help="largest max abs diff (fp32) accepted (default: 1e-4)"
    )
    long = parser.add_argument_group(
        "long model (BERT, RoBERTa)",
        "Longformer's recipe: copy the learned position table up to --max-length rows and make the layers "
        "windowed, e.g. --max-length 4096 --layer-types sliding_global_attention --window 512 --global-tokens 1. "
        "Verified on inputs as long as the window, where the outputs must equal the source's; a "
        "sentence-transformers max_seq_length and the tokenizer's model_max_length become --max-length.",
    )
    long.add_argument(
        "--max-length",
        type=int,
        help="the longest input in tokens: rows of the new position table, at least the source's (RoBERTa: not "
        "counting its 2 padding-offset rows; Longformer: 4096)",
    )
    long.add_argument(
        "--layer-types",
        type=parse_layer_types,
        help="one layer type for every layer (full_attention, sliding_attention, sliding_global_attention, "
        "bigbird_attention) or a JSON list with one per layer",
    )
    long.add_argument("--window", type=int, help="sliding_window of the windowed layers")
    long.add_argument(
        "--global-tokens", type=int, help="how many leading tokens are global (Longformer: 1, [CLS])"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    """Errors (ConversionError is a ValueError; so are config errors) reach `swapformer.cli.main`,
    which prints them as one line with exit code 2."""
    import sys

    from transformers.utils import logging

    from .atomic import ConversionInterrupted
    from .checkpoint import convert

    logging.disable_progress_bar()  # the loading bars of four loads would bury the measured diffs
    try:
        convert(
            args.src,
            args.out,
            to_hf=args.to_hf,
            overwrite=args.overwrite,
            allow_unpickling=args.allow_unpickling,
            tolerance=args.tolerance,
            max_length=args.max_length,
            layer_types=args.layer_types,
            window=args.window,
            global_tokens=args.global_tokens,
        )
    except ConversionInterrupted as e:
        print(f"swapformer convert: {e}", file=sys.stderr)
        return 128 + e.signum
    return 0
