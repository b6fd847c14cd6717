"""`swapformer attention` and `swapformer pattern`: the pictures of `swapformer.visualize` from the shell.
Heavy imports happen in the handlers, so `--help` answers without torch."""

from __future__ import annotations

import argparse
import json
import os

FORMATS = (".png", ".svg", ".pdf")


def add_attention(subparsers) -> None:
    p = _picture_command(
        subparsers,
        "attention",
        _attention,
        "Draw the attention of a saved model on a text as heatmaps (query rows, key columns, token labels), "
        "on the backend it is loaded with. Long texts are block-averaged.",
    )
    p.add_argument("model", metavar="MODEL_DIR", help="a saved swapformer (or transformers) model folder")
    p.add_argument("--text", required=True, help="the text to look at")
    p.add_argument("--layer", type=int, nargs="+", default=None, help="layer index(es) (default: all)")
    p.add_argument(
        "--heads",
        default=None,
        help="'all', or comma-separated head indices (default: the mean over heads, one panel per layer)",
    )
    p.add_argument(
        "--backend", default=None, help="attn_implementation to load with (default: the saved one)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder, if MODEL_DIR has none")
    p.add_argument("--decoder-text", default=None, help="encoder-decoder models: the decoder's text")
    p.add_argument("--max-tokens", type=int, default=64, help="block-average beyond this many tokens")


def add_pattern(subparsers) -> None:
    p = _picture_command(
        subparsers,
        "pattern",
        _pattern,
        "Draw which keys each layer type of a config lets a query attend (window, global tokens, random "
        "blocks, causality), as the model of that config applies it.",
    )
    p.add_argument("config", metavar="CONFIG", help="a model folder or its config.json")
    p.add_argument("--seq-len", type=int, required=True, help="tokens in the row drawn")
    p.add_argument(
        "--global-positions",
        default=None,
        help="comma-separated positions marked global (as a global_attention_mask would), e.g. 0,17",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="block-average beyond this many tokens")


def _picture_command(subparsers, name: str, func, description: str) -> argparse.ArgumentParser:
    """The subcommand `name`, run by `func`, with the arguments every picture command takes (--out,
    --overwrite); the caller adds its own."""
    p = subparsers.add_parser(name, description=description)
    p.add_argument("--out", required=True, help=f"the picture to write ({', '.join(FORMATS)})")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=func)
    return p


def _check_out(args) -> None:
    """Refuse before any work: an unknown picture format, or a file the user has that would be replaced."""
    suffix = os.path.splitext(args.out)[1].lower()
    if suffix not in FORMATS:
        raise ValueError(f"--out {args.out!r} has suffix {suffix!r}; use one of {', '.join(FORMATS)}")
    if os.path.exists(args.out) and not args.overwrite:
        raise FileExistsError(
            f"--out {args.out!r} exists; pass --overwrite to replace it or choose another path"
        )
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")


def _integers(text: str | None, name: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} takes comma-separated integers, got {text!r}") from None


def _save(fig, out: str) -> int:
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


def _attention(args) -> int:
    _check_out(args)
    heads = args.heads if args.heads in (None, "all") else _integers(args.heads, "--heads")
    from transformers import AutoModel, AutoTokenizer

    from . import visualize

    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"MODEL_DIR {args.model!r} is not a folder")
    tokenizer_path = args.tokenizer or args.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"no tokenizer could be loaded from {tokenizer_path!r} ({e}); pass --tokenizer FOLDER"
        ) from e
    kwargs = {"attn_implementation": args.backend} if args.backend else {}
    model = AutoModel.from_pretrained(args.model, **kwargs)
    fig = visualize.plot_attention(
        model,
        tokenizer,
        args.text,
        layers=args.layer,
        heads=heads,
        max_tokens=args.max_tokens,
        decoder_text=args.decoder_text,
    )
    return _save(fig, args.out)


def _pattern(args) -> int:
    _check_out(args)
    positions = _integers(args.global_positions, "--global-positions")
    from transformers import AutoConfig

    from . import visualize

    if os.path.isdir(args.config):
        config = AutoConfig.from_pretrained(args.config)
    elif os.path.isfile(args.config):
        with open(args.config, encoding="utf-8") as f:
            values = json.load(f)
        if "model_type" not in values:
            raise ValueError(f"{args.config!r} has no model_type; is it a model's config.json?")
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    else:
        raise FileNotFoundError(f"CONFIG {args.config!r} is neither a folder nor a file")
    marks = None
    if positions is not None:
        bad = [i for i in positions if not 0 <= i < args.seq_len]
        if bad:
            raise ValueError(
                f"--global-positions {bad} lie outside 0..{args.seq_len - 1} (--seq-len {args.seq_len})"
            )
        marks = [int(i in positions) for i in range(args.seq_len)]
    fig = visualize.plot_pattern(
        config, args.seq_len, global_attention_mask=marks, max_tokens=args.max_tokens
    )
    return _save(fig, args.out)
