"""`swapformer train`: the command-line face of training/loop.py."""

from __future__ import annotations

import argparse
import sys

from .args import ARCHS, MIXED_PRECISION, PRESETS, TrainArgs, parse_option

EPILOG = """examples:
  swapformer train                                   # tiny decoder on the Python stdlib, ~70 s on 2 idle CPU cores
  swapformer train --arch encoder --attn eager       # masked LM
  swapformer train --arch encoder-decoder --preset small --data my_texts/
  swapformer train --set num_key_value_heads=2 --set position_embedding_type=alibi
  swapformer train --resume                          # continue the run in --output-dir exactly
  accelerate launch --multi_gpu --num_processes 2 -m swapformer train   # data parallel (DDP, also on CPU); see README
"""


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        description="Pretrain a swapformer model (tokenizer, training, evaluation, model card).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = TrainArgs()
    what = p.add_argument_group("what to train")
    what.add_argument(
        "--arch",
        choices=ARCHS,
        default=d.arch,
        help="decoder: causal LM; encoder: masked LM; encoder-decoder: span corruption",
    )
    what.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default=d.preset,
        help="model size and training length (default: %(default)s)",
    )
    what.add_argument(
        "--attn",
        default=d.attn,
        help='attention backend: eager, sdpa, sparse, ..., or a JSON {layer type: backend} mapping such as \'{"sliding_attention": "sparse", "full_attention": "sdpa"}\' (default: %(default)s)',
    )
    what.add_argument("--config", help="JSON file of config fields (a saved config.json works)")
    what.add_argument(
        "--set",
        dest="model_options",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="one config field (any field of the architecture's config), e.g. --set num_key_value_heads=2; repeatable",
    )
    data = p.add_argument_group("data")
    data.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="PATH",
        help="text file, folder of text files, or a `datasets` dataset saved with save_to_disk; repeatable (default: the Python stdlib)",
    )
    data.add_argument(
        "--text-column", default=d.text_column, help="column of a `datasets` dataset (default: %(default)s)"
    )
    data.add_argument(
        "--tokenizer", help="a saved tokenizer folder to reuse instead of training a byte-level BPE"
    )
    data.add_argument("--vocab-size", type=int, help="size of the BPE trained (preset default)")
    data.add_argument("--seq-len", type=int, help="tokens per block (preset default)")
    data.add_argument(
        "--packing",
        action="store_true",
        help="each document of a block is its own sequence: no attention across documents",
    )
    data.add_argument(
        "--max-train-chars",
        type=int,
        help="character budget of the training split, 0 for all (preset default)",
    )
    data.add_argument(
        "--max-val-chars",
        type=int,
        help="character budget of the validation split, 0 for all (preset default)",
    )
    data.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="share of documents held out (default: %(default)s)",
    )
    data.add_argument(
        "--mlm-probability", type=float, default=d.mlm_probability, help="masked LM: share of tokens chosen"
    )
    data.add_argument(
        "--noise-density", type=float, default=d.noise_density, help="span corruption: share of tokens hidden"
    )
    data.add_argument(
        "--mean-span-length", type=float, default=d.mean_span_length, help="span corruption: mean span length"
    )
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--batch-size", type=int, help="sequences per process per micro-batch (preset default)")
    opt.add_argument(
        "--grad-accum",
        type=int,
        default=d.grad_accum,
        help="micro-batches per optimizer step (default: %(default)s)",
    )
    opt.add_argument("--max-steps", type=int, help="optimizer steps (preset default)")
    opt.add_argument("--lr", type=float, help="peak learning rate (preset default)")
    opt.add_argument(
        "--warmup-steps",
        type=int,
        help="linear warm-up steps before the cosine decay (default: the preset's share of --max-steps)",
    )
    opt.add_argument(
        "--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr (default: %(default)s)"
    )
    opt.add_argument(
        "--weight-decay",
        type=float,
        default=d.weight_decay,
        help="AdamW decay of matrices; none on norms and biases (default: %(default)s)",
    )
    opt.add_argument("--adam-beta1", type=float, default=d.adam_beta1)
    opt.add_argument("--adam-beta2", type=float, default=d.adam_beta2)
    opt.add_argument("--adam-eps", type=float, default=d.adam_eps)
    opt.add_argument(
        "--max-grad-norm",
        type=float,
        default=d.max_grad_norm,
        help="gradient clipping (default: %(default)s)",
    )
    opt.add_argument(
        "--mixed-precision",
        choices=MIXED_PRECISION,
        default=d.mixed_precision,
        help="passed to Accelerate; refused where this machine cannot run it (default: %(default)s, fp32)",
    )
    opt.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in backward to save memory",
    )
    opt.add_argument("--seed", type=int, default=d.seed)
    run = p.add_argument_group("run")
    run.add_argument(
        "--output-dir", default=d.output_dir, help="the Hub-ready folder written (default: %(default)s)"
    )
    run.add_argument("--save-every", type=int, help="checkpoint every N steps (preset default)")
    run.add_argument(
        "--keep-checkpoints",
        type=int,
        default=d.keep_checkpoints,
        help="checkpoints kept (default: %(default)s)",
    )
    run.add_argument("--eval-every", type=int, help="validation every N steps (preset default)")
    run.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        help="continue the run in --output-dir from its latest checkpoint (or from the checkpoint folder given)",
    )
    run.add_argument("--overwrite", action="store_true", help="replace a previous run in --output-dir")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    run.add_argument(
        "--push-to-hub",
        metavar="REPO_ID",
        help="upload the finished folder to this Hub repo (created if missing; checkpoints/ left out)",
    )
    run.add_argument("--hub-private", action="store_true", help="create the --push-to-hub repo private")
    run.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)  # test hook: end as if killed
    p.set_defaults(func=_train)


def _train(ns: argparse.Namespace) -> int:
    """Errors a user can fix (TrainArgumentError, a ValueError) reach `swapformer.cli.main`, which
    prints them as one line with exit code 2."""
    values = {k: v for k, v in vars(ns).items() if k not in ("func", "command", "debug")}
    values["model_options"] = dict(parse_option(o) for o in values["model_options"])
    args = TrainArgs(**values)

    import pathlib

    from .checkpointing import latest_checkpoint
    from .hub import HubPushError
    from .loop import train
    from .step import TrainingDiverged

    try:
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
    if "stopped_at" in metrics:
        print(f"stopped after step {metrics['stopped_at']} (--stop-after)")
    elif metrics:  # the main process reports
        print(
            f"validation perplexity {metrics['val_perplexity']:.2f} (unigram baseline "
            f"{metrics['unigram_perplexity']:.2f}) after {metrics['steps']} steps, "
            f"{metrics['train_seconds']:.0f} s of training, {metrics['total_seconds']:.0f} s in all; "
            f"model in {args.output_dir}"
        )
        if "test_perplexity" in metrics:
            print(
                f"test perplexity {metrics['test_perplexity']:.2f} (unigram baseline "
                f"{metrics['test_unigram_perplexity']:.2f}) on {metrics['test_tokens']} tokens of the test split"
            )
        if "hub_url" in metrics:
            print(f"uploaded to {metrics['hub_url']}")
    return 0
