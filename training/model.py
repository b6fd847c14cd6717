"""The model a run trains: its config fields (model defaults, preset, --config file, --set), the checks
of those fields, and the model itself.

Model options are any field of the chosen config class, given as `--config file.json` or one
`--set field=value` per field. preflight.check_run checks them all (and builds the model once on the
meta device) before anything is written; loop.py builds the real model once the tokenizer is known.
"""

from __future__ import annotations

import json
import os

import torch

from ..modeling import DecoderForCausalLM, EncoderForMaskedLM, Seq2SeqForConditionalGeneration
from .args import MODEL_DEFAULTS, PRESETS, TOKENIZER_FIELDS, TrainArgs, TrainArgumentError, attn_choice
from .objectives import SpanCorruption

MODEL_CLASSES = {
    "decoder": DecoderForCausalLM,
    "encoder": EncoderForMaskedLM,
    "encoder-decoder": Seq2SeqForConditionalGeneration,
}
# Keys a saved config.json carries besides the fields: transformers' bookkeeping and swapformer's own.
CONFIG_FILE_EXTRAS = frozenset(
    {
        "model_type",
        "transformers_version",
        "architectures",
        "auto_map",
        "converted_from",
        "_name_or_path",
        "dtype",
    }
)


def config_classes() -> dict:
    """{--arch: its config class}."""
    from ..configuration import DecoderConfig, EncoderConfig, Seq2SeqConfig

    return {"decoder": DecoderConfig, "encoder": EncoderConfig, "encoder-decoder": Seq2SeqConfig}


def config_fields_of(cls: type) -> set[str]:
    """The fields a user may set on config class `cls` (its own and swapformer's shared ones)."""
    from ..configuration import SwapformerConfig

    return {
        n
        for k in cls.__mro__
        if isinstance(k, type) and issubclass(k, SwapformerConfig)
        for n in vars(k).get("__annotations__", {})
    }


def model_options(args: TrainArgs) -> dict:
    """The config fields of this run: model defaults, preset, --config file, then --set, in that order."""
    options = dict(MODEL_DEFAULTS)
    options.update(PRESETS[args.preset]["model"])
    if args.arch == "encoder-decoder":  # the preset's layers split between encoder and decoder: same compute
        half = max(1, options["num_hidden_layers"] // 2)
        options.update(num_hidden_layers=half, decoder_layers=half)
    if args.config is not None:
        if not os.path.isfile(args.config):
            raise TrainArgumentError(f"--config {args.config!r}: no such file")
        try:
            with open(args.config) as f:
                loaded = json.load(f)
        except json.JSONDecodeError as e:
            raise TrainArgumentError(f"--config {args.config!r} is not valid JSON: {e}") from e
        if not isinstance(loaded, dict):
            raise TrainArgumentError(f"--config {args.config!r} must hold a JSON object of config fields")
        # a config.json written by save_pretrained carries bookkeeping keys and the vocabulary of its
        # tokenizer: keep only config fields, and leave the vocabulary to this run's tokenizer
        check_config_file(args, loaded)
        own = config_fields_of(config_classes()[args.arch]) - set(TOKENIZER_FIELDS)
        options.update({k: v for k, v in loaded.items() if k in own})
    options.update(args.set)
    return options


def check_config_file(args: TrainArgs, loaded: dict) -> None:
    """A --config file must be of --arch's architecture and hold only fields of its config class (a
    misspelt field would otherwise be dropped without a word)."""
    from transformers import PreTrainedConfig

    classes = config_classes()
    arch_of = {cls.model_type: arch for arch, cls in classes.items()}
    model_type = loaded.get("model_type")
    if model_type is not None and arch_of.get(model_type) != args.arch:
        if model_type in arch_of:
            fix = f"pass --arch {arch_of[model_type]}, or a config of --arch {args.arch}"
        else:
            fix = "use a swapformer config (convert a checkpoint first: swapformer convert), or a JSON of fields"
        raise TrainArgumentError(
            f"--config {args.config!r} is a {model_type!r} config, but --arch {args.arch} trains "
            f"{classes[args.arch].model_type!r}; {fix}"
        )
    own = config_fields_of(classes[args.arch])
    extras = CONFIG_FILE_EXTRAS | set(TOKENIZER_FIELDS) | set(PreTrainedConfig().to_dict())
    unknown = sorted(k for k in loaded if k not in own and k not in extras)
    if unknown:
        raise TrainArgumentError(
            f"--config {args.config!r}: {', '.join(unknown)} {'is not a field' if len(unknown) == 1 else 'are not fields'} "
            f"of --arch {args.arch}'s config ({classes[args.arch].__name__}); fix or remove "
            f"{'it' if len(unknown) == 1 else 'them'}"
        )


def check_set_fields(args: TrainArgs) -> None:
    """Every --set names a field of --arch's config that the tokenizer does not decide."""
    classes = config_classes()
    known = set().union(*(config_fields_of(cls) for cls in classes.values()))
    own = config_fields_of(classes[args.arch])
    for name in args.set:
        if name not in known:
            raise TrainArgumentError(f"--set {name}=...: {name!r} is not a config field")
        if name not in own:
            raise TrainArgumentError(f"--set {name}=...: {name!r} is not a field of --arch {args.arch}")
        if name in TOKENIZER_FIELDS:
            raise TrainArgumentError(
                f"--set {name}=...: the vocabulary and its special tokens come from the tokenizer "
                "(--vocab-size, --tokenizer)"
            )


def check_model(args: TrainArgs, options: dict) -> None:
    """Size max_position_embeddings to --seq-len (in `options`, unless set) and build the model once on
    the meta device: that checks every option, the backend and its package, and writes nothing."""
    lengths = SpanCorruption.lengths_for(args) if args.arch == "encoder-decoder" else {"input": args.seq_len}
    needed = max(lengths.values())
    positions = options.setdefault("max_position_embeddings", needed)
    if needed > positions:
        detail = ", ".join(f"{k} {v}" for k, v in lengths.items())
        raise TrainArgumentError(
            f"--seq-len {args.seq_len} needs {needed} positions ({detail}) but the model has "
            f"max_position_embeddings={positions}; lower --seq-len or raise max_position_embeddings (--set)"
        )
    try:
        config = config_classes()[args.arch](**options, vocab_size=args.vocab_size or 32000)
        with torch.device("meta"):
            MODEL_CLASSES[args.arch]._from_config(config, attn_implementation=attn_choice(args.attn))
    except (TypeError, ValueError, ImportError) as e:
        raise TrainArgumentError(f"model options (--config/--set/--attn): {e}") from e


def build_model(args: TrainArgs, options: dict, tokenizer):
    """The model to train, its vocabulary and special tokens from `tokenizer`, seeded by --seed."""
    config = config_classes()[args.arch](
        **options,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **({"decoder_start_token_id": tokenizer.bos_token_id} if args.arch == "encoder-decoder" else {}),
    )
    torch.manual_seed(args.seed)
    model = MODEL_CLASSES[args.arch]._from_config(config, attn_implementation=attn_choice(args.attn))
    if args.gradient_checkpointing:
        # non-reentrant: the variant that works under DDP and with inputs that need no gradient
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()
