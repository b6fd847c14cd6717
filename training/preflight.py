"""The first stage: every argument, path, the model and the output folder checked before anything is
created or written.

`preflight(args)` resolves the preset and raises TrainArgumentError, naming the flag at fault, for
anything wrong: a value out of range, a missing --data path or --tokenizer folder, a config field
that does not exist, a model the options cannot build (built once on the meta device), a backend or
precision this machine cannot train with, a launch that would train something else, or an output
folder holding something that --overwrite or --resume was not given for. What only the data can tell
(an unreadable file, a split shorter than one block, a tokenizer folder that does not load) is found
by data.prepare_data, still before a fresh run's folder is created.
"""

from __future__ import annotations

import json
import os
import pathlib

from ..configuration.backends import BACKENDS, check_backend_name, check_layer_backends
from .args import ARCHS, MIXED_PRECISION, TrainArgs, TrainArgumentError, attn_choice, flag, named_backends
from .checkpointing import RUN_FILE, STATE_FILE, latest_checkpoint
from .data_files import is_pattern, matches
from .launch import check_backward, check_launch, check_precision
from .model import check_model, check_set_fields, model_options
from .stream_source import stream_source

# arguments that must be integers >= 1
POSITIVE = (
    "seq_len",
    "batch_size",
    "grad_accum",
    "max_steps",
    "save_every",
    "eval_every",
    "keep_checkpoints",
)


def preflight(args: TrainArgs) -> tuple[TrainArgs, dict, pathlib.Path | None]:
    """(resolved arguments, config options, checkpoint to resume from or None for a fresh run)."""
    args, options = check_run(args)
    check_launch(args)
    return args, options, check_output_dir(args)


def check_run(args: TrainArgs) -> tuple[TrainArgs, dict]:
    """Resolve the preset and validate the arguments and the model options; return (args, config
    options). Raises TrainArgumentError naming the flag at fault."""
    args = args.resolved()
    validate(args)
    options = model_options(args)
    check_model(args, options)
    check_precision(args.mixed_precision)
    check_backward(args.attn)
    return args, options


def validate(args: TrainArgs) -> None:
    """Check everything that can be checked without data or a model; raise TrainArgumentError naming
    the flag."""
    check_choices(args)
    check_numbers(args)
    if args.streaming:
        check_streaming(args)
    for path in [] if args.streaming else args.data:
        if is_pattern(path):
            matches(path)  # refuses a pattern that matches nothing
        elif not os.path.exists(path):
            raise TrainArgumentError(f"--data {path!r}: no such file or folder")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise TrainArgumentError(f"--tokenizer {args.tokenizer!r}: no such folder (a saved tokenizer)")
    check_set_fields(args)


def check_choices(args: TrainArgs) -> None:
    """--arch, --attn, --packing and --push-to-hub name things that exist and go together."""
    if args.arch not in ARCHS:
        raise TrainArgumentError(f"--arch {args.arch!r} is unknown; choose one of {', '.join(ARCHS)}")
    try:
        choice = attn_choice(args.attn)
        if isinstance(choice, dict):
            check_layer_backends(choice, None)
        else:
            check_backend_name(choice)
    except ValueError as e:
        raise TrainArgumentError(f"--attn: {e}") from e
    if args.packing:
        check_packing(args)
    if args.push_to_hub is not None:
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(args.push_to_hub)
        except HFValidationError as e:
            raise TrainArgumentError(
                f"--push-to-hub {args.push_to_hub!r} is not a Hub repo id (user-or-org/name): {e}"
            ) from e


def check_numbers(args: TrainArgs) -> None:
    """Counts, rates and sizes lie in their ranges."""
    for name in POSITIVE:
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TrainArgumentError(f"{flag(name)} must be a positive integer, got {value!r}")
    for names, inside, text in (
        (("lr", "adam_eps", "max_grad_norm"), lambda v: v > 0, "must be > 0"),
        (
            ("weight_decay", "min_lr_ratio", "adam_beta1", "adam_beta2"),
            lambda v: 0 <= v < 1,
            "must lie in [0, 1)",
        ),
        (("val_fraction", "mlm_probability", "noise_density"), lambda v: 0 < v < 1, "must lie in (0, 1)"),
    ):
        for name in names:
            if not inside(getattr(args, name)):
                raise TrainArgumentError(f"{flag(name)} {text}, got {getattr(args, name)!r}")
    if args.mean_span_length < 1:
        raise TrainArgumentError(f"--mean-span-length must be >= 1, got {args.mean_span_length}")
    if args.warmup_steps < 0 or args.warmup_steps >= args.max_steps:
        raise TrainArgumentError(
            f"--warmup-steps must lie in [0, --max-steps={args.max_steps}), got {args.warmup_steps}"
        )
    for name in ("max_train_chars", "max_val_chars"):
        if getattr(args, name) < 0:
            raise TrainArgumentError(f"{flag(name)} must be >= 0 (0: no limit), got {getattr(args, name)}")
    if args.mixed_precision not in MIXED_PRECISION:
        raise TrainArgumentError(
            f"--mixed-precision {args.mixed_precision!r} is unknown; choose one of {', '.join(MIXED_PRECISION)}"
        )
    if args.num_proc is not None and (not isinstance(args.num_proc, int) or args.num_proc < 1):
        raise TrainArgumentError(f"--num-proc must be a positive integer, got {args.num_proc!r}")
    if args.stop_after is not None and args.stop_after < 1:
        raise TrainArgumentError(f"--stop-after must be >= 1, got {args.stop_after}")
    if args.vocab_size is not None and args.tokenizer is None and args.vocab_size < 512:
        raise TrainArgumentError(
            f"--vocab-size must be >= 512 (256 bytes + special tokens), got {args.vocab_size}"
        )


def check_streaming(args: TrainArgs) -> None:
    """--streaming reads an input `datasets` can stream (stream_source), and no flag asks what it cannot do:
    hold every validation document (--max-val-chars 0), or tokenize ahead (--num-proc) into a cache (--cache-dir)."""
    if not args.max_val_chars:
        raise TrainArgumentError(
            "--streaming reads the validation documents from the stream and holds them, so it needs a budget: "
            "--max-val-chars 0 (all) would read the whole stream first; give --max-val-chars, e.g. 600000"
        )
    for name in ("num_proc", "cache_dir"):
        if getattr(args, name) is not None:
            raise TrainArgumentError(
                f"{flag(name)} {getattr(args, name)!r} sets how token shards are written, and --streaming writes "
                f"none (it tokenizes each document as it reads it): drop {flag(name)} or --streaming"
            )
    stream_source(args.data, args.text_column)


def check_packing(args: TrainArgs) -> None:
    """--packing needs an objective whose inputs keep token order (not span corruption) and backends
    that keep packed sequences apart."""
    if args.arch == "encoder-decoder":
        raise TrainArgumentError(
            "--packing supports --arch decoder and encoder; span corruption (encoder-decoder) rewrites each "
            "block into an input and a target that no longer line up with its documents. Drop --packing"
        )
    lacking = sorted(b for b in named_backends(args.attn) if not BACKENDS[b].packing)
    if lacking:
        capable = [n for n, c in BACKENDS.items() if c.packing]
        raise TrainArgumentError(
            f"--packing: --attn {lacking[0]!r} cannot keep packed sequences apart; use one of "
            f"{', '.join(map(repr, capable))}"
        )


def check_output_dir(args: TrainArgs) -> pathlib.Path | None:
    """The checkpoint to resume from (None for a fresh run); refuses to overwrite a different run."""
    out = pathlib.Path(args.output_dir)
    run_file = out / RUN_FILE
    if args.resume is not None:
        if not run_file.is_file():
            raise TrainArgumentError(
                f"--resume: --output-dir {str(out)!r} holds no run ({RUN_FILE}) to resume"
            )
        differ = args.differences(json.loads(run_file.read_text()))
        if differ:
            raise TrainArgumentError(
                f"--resume: these arguments differ from the run in {str(out)!r}: {', '.join(differ)}; "
                "a resumed run must repeat them to continue exactly"
            )
        ckpt = latest_checkpoint(out) if args.resume == "latest" else pathlib.Path(args.resume)
        if ckpt is None or not (ckpt / STATE_FILE).is_file():
            raise TrainArgumentError(
                f"--resume: no complete checkpoint {'under ' + str(out / 'checkpoints') if ckpt is None else str(ckpt)}; "
                "start again with --overwrite"
            )
        return ckpt
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not run_file.is_file():
            raise TrainArgumentError(
                f"--output-dir {str(out)!r} exists and holds no swapformer run; choose a new or empty folder"
            )
        if not args.overwrite and latest_checkpoint(out) is None and not (out / "config.json").exists():
            raise TrainArgumentError(
                f"--output-dir {str(out)!r} holds a run that stopped before its first checkpoint (killed, or "
                "it diverged): nothing to resume. Pass --overwrite to start it again, or choose another folder"
            )
        if not args.overwrite:
            raise TrainArgumentError(
                f"--output-dir {str(out)!r} already holds a run ({RUN_FILE}); pass --overwrite to replace it "
                "or --resume to continue it"
            )
    return None
