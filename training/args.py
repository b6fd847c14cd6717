"""The arguments of `swapformer train`: one dataclass, presets that fill what is left unset, and the
checks that run before any data is read or any model is built.

Every error names the command-line flag at fault (`--batch-size`, `--attn`, ...), since that is what
the user typed. Model options are any field of the chosen config class, given as `--config file.json`
or one `--set field=value` per field.

The config classes (and with them transformers) are imported on first use, not here:
`swapformer train --help` builds its parser from this module.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

ARCHS = ("decoder", "encoder", "encoder-decoder")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")

# Presets fill every argument left unset. `tiny` is the default: about 1.5 minutes on 2 idle CPU cores.
# Model fields go to the config; the rest are training arguments.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        model=dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512),
        vocab_size=4096,
        seq_len=128,
        batch_size=16,
        max_steps=250,
        lr=2e-3,
        warmup_steps=25,
        max_train_chars=2_000_000,
        max_val_chars=60_000,
        save_every=100,
        eval_every=100,
    ),
    "small": dict(
        model=dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1024),
        vocab_size=8192,
        seq_len=256,
        batch_size=32,
        max_steps=3000,
        lr=1e-3,
        warmup_steps=200,
        max_train_chars=0,
        max_val_chars=600_000,
        save_every=500,
        eval_every=500,
    ),
    "base": dict(
        model=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048),
        vocab_size=16384,
        seq_len=512,
        batch_size=32,
        max_steps=20000,
        lr=6e-4,
        warmup_steps=1000,
        max_train_chars=0,
        max_val_chars=0,
        save_every=1000,
        eval_every=1000,
    ),
}
# A Llama-like block for every preset; dropout off (short pretraining runs underfit, not overfit).
MODEL_DEFAULTS = dict(
    position_embedding_type="rope",
    norm_type="rmsnorm",
    mlp_type="gated",
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    hidden_dropout=0.0,
)
# Config fields the tokenizer decides.
TOKENIZER_FIELDS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
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
# Training arguments that may differ between a run and its resumption.
RESUME_FREE = frozenset({"resume", "overwrite", "stop_after", "progress", "push_to_hub", "hub_private"})


class TrainArgumentError(ValueError):
    """A wrong `swapformer train` argument, found before training starts."""


def __getattr__(name: str):
    if name == "CONFIG_CLASSES":  # {--arch: config class}, imported on first use (see the docstring)
        return config_classes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def config_classes() -> dict:
    """{--arch: its config class}."""
    from ..configuration import DecoderConfig, EncoderConfig, Seq2SeqConfig

    return {"decoder": DecoderConfig, "encoder": EncoderConfig, "encoder-decoder": Seq2SeqConfig}


@dataclass
class TrainArgs:
    """Arguments of one training run. `None` means "from the preset"."""

    arch: str = "decoder"
    preset: str = "tiny"
    output_dir: str = "swapformer-model"
    data: list[str] = field(default_factory=list)
    text_column: str = "text"
    tokenizer: str | None = None
    vocab_size: int | None = None
    config: str | None = None
    model_options: dict = field(default_factory=dict)
    attn: str = "sdpa"
    seq_len: int | None = None
    batch_size: int | None = None
    grad_accum: int = 1
    max_steps: int | None = None
    lr: float | None = None
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False
    packing: bool = False  # each document its own sequence within the blocks (no cross-document attention)
    seed: int = 0
    save_every: int | None = None
    keep_checkpoints: int = 2
    eval_every: int | None = None
    max_train_chars: int | None = None
    max_val_chars: int | None = None
    val_fraction: float = 0.05
    mlm_probability: float = 0.15
    noise_density: float = 0.15
    mean_span_length: float = 3.0
    resume: str | None = None
    overwrite: bool = False
    progress: bool = True
    push_to_hub: str | None = None  # a Hub repo id the finished folder is uploaded to
    hub_private: bool = False
    stop_after: int | None = None  # test hook: end as if killed after this step (no save)

    def resolved(self) -> TrainArgs:
        """A copy with every unset argument taken from the preset."""
        if self.preset not in PRESETS:
            raise TrainArgumentError(
                f"--preset {self.preset!r} is unknown; choose one of {', '.join(PRESETS)}"
            )
        preset = PRESETS[self.preset]
        out = dataclasses.replace(self, data=list(self.data), model_options=dict(self.model_options))
        for name, value in preset.items():
            if name != "model" and getattr(out, name) is None:
                setattr(out, name, value)
        if self.warmup_steps is None and self.max_steps is not None and isinstance(self.max_steps, int):
            # the preset's warm-up is a share of its length: a run of another length keeps the share
            out.warmup_steps = preset["warmup_steps"] * self.max_steps // preset["max_steps"]
        return out

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def differences(self, other: dict) -> list[str]:
        """Names of the arguments (other than resume-only ones) whose values differ from `other`. An
        argument added after `other` was saved counts as its default there (a run saved before
        `--packing` existed did not pack)."""
        mine = self.to_json()
        defaults = {
            f.name: f.default for f in dataclasses.fields(self) if f.default is not dataclasses.MISSING
        }
        other = {**defaults, **other}
        names = (set(mine) | set(other)) - RESUME_FREE
        return sorted(n for n in names if mine.get(n) != other.get(n))


def config_fields_of(cls: type) -> set[str]:
    """The fields a user may set on config class `cls` (its own and swapformer's shared ones)."""
    return {
        n for k in cls.__mro__ if k.__module__ == cls.__module__ for n in getattr(k, "__annotations__", {})
    }


def config_fields() -> set[str]:
    """Every config field a user may set, over the three architectures."""
    return set().union(*(config_fields_of(cls) for cls in config_classes().values()))


def parse_option(text: str) -> tuple[str, object]:
    """`field=value` -> (field, value); the value is read as JSON (numbers, true/false, null, lists,
    objects), else kept as a string. A value in brackets or braces must be JSON: a shell that ate its
    inner quotes turns `["a","b"]` into `[a,b]`, which is refused rather than taken as a string."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise TrainArgumentError(f"--set expects field=value, got {text!r}")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError as e:
        if raw.strip()[:1] in ("[", "{"):
            words = [w.strip().strip("'\"") for w in raw.strip()[1:-1].split(",") if w.strip()]
            example = json.dumps(words, separators=(",", ":")) if raw.strip()[0] == "[" else '{"key":"value"}'
            raise TrainArgumentError(
                f"--set {name}={raw}: a list or mapping must be JSON ({e.msg} at character {e.pos}); quote the "
                f"whole option so the shell keeps the inner quotes: --set '{name}={example}'"
            ) from e
    return name, {"True": True, "False": False, "None": None}.get(raw, raw)


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
    options.update(args.model_options)
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


def validate(args: TrainArgs) -> None:
    """Check everything that can be checked without data or a model; raise TrainArgumentError naming
    the flag."""
    if args.arch not in ARCHS:
        raise TrainArgumentError(f"--arch {args.arch!r} is unknown; choose one of {', '.join(ARCHS)}")
    from ..configuration.backends import check_backend_name, check_layer_backends

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
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(args.push_to_hub)
        except HFValidationError as e:
            raise TrainArgumentError(
                f"--push-to-hub {args.push_to_hub!r} is not a Hub repo id (user-or-org/name): {e}"
            ) from e
    positive = (
        "seq_len",
        "batch_size",
        "grad_accum",
        "max_steps",
        "save_every",
        "eval_every",
        "keep_checkpoints",
    )
    for name in positive:
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TrainArgumentError(f"{flag(name)} must be a positive integer, got {value!r}")
    for name in ("lr", "adam_eps", "max_grad_norm"):
        if not getattr(args, name) > 0:
            raise TrainArgumentError(f"{flag(name)} must be > 0, got {getattr(args, name)!r}")
    for name in ("weight_decay", "min_lr_ratio", "adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise TrainArgumentError(f"{flag(name)} must lie in [0, 1), got {getattr(args, name)!r}")
    for name in ("val_fraction", "mlm_probability", "noise_density"):
        if not 0 < getattr(args, name) < 1:
            raise TrainArgumentError(f"{flag(name)} must lie in (0, 1), got {getattr(args, name)!r}")
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
    if args.stop_after is not None and args.stop_after < 1:
        raise TrainArgumentError(f"--stop-after must be >= 1, got {args.stop_after}")
    if args.vocab_size is not None and args.tokenizer is None and args.vocab_size < 512:
        raise TrainArgumentError(
            f"--vocab-size must be >= 512 (256 bytes + special tokens), got {args.vocab_size}"
        )
    for path in args.data:
        if not os.path.exists(path):
            raise TrainArgumentError(f"--data {path!r}: no such file or folder")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise TrainArgumentError(f"--tokenizer {args.tokenizer!r}: no such folder (a saved tokenizer)")
    known = config_fields()
    own = config_fields_of(config_classes()[args.arch])
    for name in args.model_options:
        if name not in known:
            raise TrainArgumentError(f"--set {name}=...: {name!r} is not a config field")
        if name not in own:
            raise TrainArgumentError(f"--set {name}=...: {name!r} is not a field of --arch {args.arch}")
        if name in TOKENIZER_FIELDS:
            raise TrainArgumentError(
                f"--set {name}=...: the vocabulary and its special tokens come from the tokenizer "
                "(--vocab-size, --tokenizer)"
            )


def check_packing(args: TrainArgs) -> None:
    """--packing needs an objective whose inputs keep token order (not span corruption) and backends
    that keep packed sequences apart."""
    if args.arch == "encoder-decoder":
        raise TrainArgumentError(
            "--packing supports --arch decoder and encoder; span corruption (encoder-decoder) rewrites each "
            "block into an input and a target that no longer line up with its documents. Drop --packing"
        )
    from ..configuration.backends import BACKENDS  # here, so `swapformer --help` imports no transformers

    lacking = sorted(b for b in attn_backends(args.attn) if not BACKENDS[b].packing)
    if lacking:
        capable = [n for n, c in BACKENDS.items() if c.packing]
        raise TrainArgumentError(
            f"--packing: --attn {lacking[0]!r} cannot keep packed sequences apart; use one of "
            f"{', '.join(map(repr, capable))}"
        )


def attn_choice(attn: str) -> str | dict:
    """--attn as transformers takes it: a backend name, or a JSON {layer type: backend} mapping."""
    if not attn.lstrip().startswith("{"):
        return attn
    try:
        mapping = json.loads(attn)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{attn!r} is neither a backend name nor a JSON {{layer type: backend}} mapping: {e}"
        ) from e
    if not isinstance(mapping, dict):
        raise ValueError(f"{attn!r} must be a JSON object")
    return mapping


def attn_backends(attn: str) -> set[str]:
    """The backend names --attn uses."""
    choice = attn_choice(attn)
    return set(choice.values()) if isinstance(choice, dict) else {choice}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")
