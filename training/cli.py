"""`swapformer train`: the command-line face of training/loop.py."""

from __future__ import annotations

import argparse
import contextlib
import sys

from .args import ARCHS, MIXED_PRECISION, PRESETS, TrainArgs, flag, parse_option

EPILOG = """examples:
  swapformer train                                   # tiny decoder on the Python stdlib, ~70 s on 2 idle CPU cores
  swapformer train --arch encoder --attn eager       # masked LM
  swapformer train --arch encoder-decoder --preset small --data my_texts/
  swapformer train --set num_key_value_heads=2 --set position_embedding_type=alibi
  swapformer train --resume                          # continue the run in --output-dir exactly
  swapformer train --streaming --data 'corpus/*.jsonl'   # read as a stream, tokenized as read: no shards
  accelerate launch --multi_gpu --num_processes 2 -m swapformer train   # data parallel (DDP, also on CPU); see docs/training.md
"""


DEFAULTS = TrainArgs()


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        description="Pretrain a swapformer model (tokenizer, training, evaluation, model card).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _what_to_train(p.add_argument_group("what to train"))
    _data(p.add_argument_group("data"))
    _optimisation(p.add_argument_group("optimisation"))
    _run(p.add_argument_group("run"))
    p.set_defaults(func=_train)


def _option(group, name: str, help: str | None = None, **kwargs) -> None:
    """--name, typed and defaulted as TrainArgs' field `name`."""
    default = getattr(DEFAULTS, name)
    group.add_argument(flag(name), type=type(default), default=default, help=help, **kwargs)


def _preset_option(group, name: str, kind: type, help: str) -> None:
    """--name, left unset (None) for the preset to fill."""
    group.add_argument(flag(name), type=kind, help=f"{help} (preset default)")


def _appended(group, name: str, metavar: str, help: str) -> None:
    """A repeatable --name, collected in a list."""
    group.add_argument(flag(name), action="append", default=[], metavar=metavar, help=help)


def _what_to_train(group) -> None:
    arch_help = "decoder: causal LM; encoder: masked LM; encoder-decoder: span corruption"
    _option(group, "arch", arch_help, choices=ARCHS)
    _option(group, "preset", "model size and training length (default: %(default)s)", choices=tuple(PRESETS))
    attn_help = (
        "attention backend: eager, sdpa, sparse, ..., auto (the fastest here per layer type, measured and cached), "
        "or a JSON {layer type: backend} mapping such as "
        '\'{"sliding_attention": "sparse", "full_attention": "sdpa"}\' (default: %(default)s)'
    )
    _option(group, "attn", attn_help)
    group.add_argument("--config", help="JSON file of config fields (a saved config.json works)")
    set_help = "one config field (any field of the architecture's config), e.g. --set num_key_value_heads=2; repeatable"
    _appended(group, "set", "FIELD=VALUE", set_help)


def _data(group) -> None:
    data_help = (
        "text file, folder of text files, jsonl/json/parquet file (rows of --text-column), glob of such files "
        "(quoted), or a `datasets` dataset saved with save_to_disk; repeatable (default: the Python stdlib)"
    )
    _appended(group, "data", "PATH", data_help)
    _option(
        group, "text_column", "column of a `datasets` dataset or jsonl/parquet file (default: %(default)s)"
    )
    group.add_argument(
        "--tokenizer", help="a saved tokenizer folder to reuse instead of training a byte-level BPE"
    )
    _preset_option(group, "vocab_size", int, "size of the BPE trained")
    _preset_option(group, "seq_len", int, "tokens per block")
    packing_help = "each document of a block is its own sequence: no attention across documents"
    group.add_argument("--packing", action="store_true", help=packing_help)
    _preset_option(group, "max_train_chars", int, "character budget of the training split, 0 for all")
    _preset_option(group, "max_val_chars", int, "character budget of the validation split, 0 for all")
    _option(group, "val_fraction", "share of documents held out (default: %(default)s)")
    proc_help = "processes that tokenize (default: one per 50 M characters of a split, at most the CPUs)"
    group.add_argument("--num-proc", type=int, help=proc_help)
    cache_help = (
        "where documents and token shards are cached for the next run (default: $SWAPFORMER_CACHE_DIR/tokens, "
        "else beside `datasets`' cache)"
    )
    group.add_argument("--cache-dir", help=cache_help)
    streaming_help = (
        "read the training documents as a `datasets` stream, tokenized as read: no token shards, no copy of the "
        "corpus; --data then also takes a folder `datasets` loads or a dataset name (docs/training.md)"
    )
    group.add_argument("--streaming", action="store_true", help=streaming_help)
    _option(group, "mlm_probability", "masked LM: share of tokens chosen")
    _option(group, "noise_density", "span corruption: share of tokens hidden")
    _option(group, "mean_span_length", "span corruption: mean span length")


def _optimisation(group) -> None:
    _preset_option(group, "batch_size", int, "sequences per process per micro-batch")
    _option(group, "grad_accum", "micro-batches per optimizer step (default: %(default)s)")
    _preset_option(group, "max_steps", int, "optimizer steps")
    _preset_option(group, "lr", float, "peak learning rate")
    warmup_help = "linear warm-up steps before the cosine decay (default: the preset's share of --max-steps)"
    group.add_argument("--warmup-steps", type=int, help=warmup_help)
    _option(group, "min_lr_ratio", "final lr / peak lr (default: %(default)s)")
    _option(group, "weight_decay", "AdamW decay of matrices; none on norms and biases (default: %(default)s)")
    for name in ("adam_beta1", "adam_beta2", "adam_eps"):
        _option(group, name)
    _option(group, "max_grad_norm", "gradient clipping (default: %(default)s)")
    precision_help = (
        "passed to Accelerate; refused where this machine cannot run it (default: %(default)s, fp32)"
    )
    _option(group, "mixed_precision", precision_help, choices=MIXED_PRECISION)
    checkpointing_help = "recompute activations in backward to save memory"
    group.add_argument("--gradient-checkpointing", action="store_true", help=checkpointing_help)
    _option(group, "seed")


def _run(group) -> None:
    _option(group, "output_dir", "the Hub-ready folder written (default: %(default)s)")
    _preset_option(group, "save_every", int, "checkpoint every N steps")
    _option(group, "keep_checkpoints", "checkpoints kept (default: %(default)s)")
    _preset_option(group, "eval_every", int, "validation every N steps")
    resume_help = (
        "continue the run in --output-dir from its latest checkpoint (or from the checkpoint folder given)"
    )
    group.add_argument("--resume", nargs="?", const="latest", help=resume_help)
    group.add_argument("--overwrite", action="store_true", help="replace a previous run in --output-dir")
    quiet_help = "no progress bar, and no line per stage (reading the documents, tokenizer, evaluation)"
    group.add_argument("--no-progress", action="store_true", help=quiet_help)
    push_help = "upload the finished folder to this Hub repo (created if missing; checkpoints/ left out)"
    group.add_argument("--push-to-hub", metavar="REPO_ID", help=push_help)
    group.add_argument("--hub-private", action="store_true", help="create the --push-to-hub repo private")
    group.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)  # test hook: end as if killed


def _train(ns: argparse.Namespace) -> int:
    """Errors a user can fix (TrainArgumentError, a ValueError) reach `swapformer.cli.main`, which
    prints them as one line with exit code 2."""
    values = {k: v for k, v in vars(ns).items() if k not in ("func", "command", "debug")}
    values["set"] = dict(parse_option(o) for o in values["set"])
    args = TrainArgs(**values)

    import pathlib

    from .checkpointing import latest_checkpoint
    from .hub import HubPushError
    from .loop import train
    from .notices import shown_on_stderr
    from .step import TrainingDiverged

    try:
        with contextlib.nullcontext() if args.no_progress else shown_on_stderr():
            metrics = train(args)
    except (TrainingDiverged, HubPushError) as e:
        print(f"swapformer train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        out = pathlib.Path(args.output_dir)
        if out.is_dir() and latest_checkpoint(out) is not None:
            hint = f"continue from the last checkpoint with the same arguments and --resume (output: {out})"
        else:
            hint = f"it stopped before its first checkpoint and kept nothing in {out}: run the same command again"
        print(f"swapformer train: interrupted; {hint}", file=sys.stderr)
        return 130
    _report(metrics, pathlib.Path(args.output_dir))
    return 0


def _report(metrics: dict, out) -> None:
    """The closing lines of a run (metrics are empty outside the main process)."""
    from .notices import finished_message

    if "stopped_at" in metrics:
        print(f"stopped after step {metrics['stopped_at']} (--stop-after)")
    elif metrics.get("already_finished"):
        print(finished_message(out, metrics))
    elif metrics:
        print(
            f"validation perplexity {metrics['val_perplexity']:.2f} (unigram baseline "
            f"{metrics['unigram_perplexity']:.2f}) after {metrics['steps']} steps, "
            f"{metrics['train_seconds']:.0f} s of training, {metrics['total_seconds']:.0f} s in all; "
            f"model in {out}"
        )
        if "test_perplexity" in metrics:
            print(
                f"test perplexity {metrics['test_perplexity']:.2f} (unigram baseline "
                f"{metrics['test_unigram_perplexity']:.2f}) on {metrics['test_tokens']} tokens of the test split"
            )
    if "hub_url" in metrics:
        print(f"uploaded to {metrics['hub_url']}")
