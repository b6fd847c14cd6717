"""The arguments of `swapformer train`: one dataclass, the presets that fill what is left unset, and
the parsing of `--set field=value` and `--attn`.

Every error names the command-line flag at fault (`--batch-size`, `--attn`, ...), since that is what
the user typed. The checks of the values live in preflight.py (arguments, paths, output folder),
model.py (config fields) and launch.py (machine and launcher).

This module imports neither torch nor transformers: `swapformer train --help` builds its parser from it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

ARCHS = ("decoder", "encoder", "encoder-decoder")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")

# Presets fill every argument left unset. `tiny` is the default: about 1.5 minutes on 2 idle CPU cores.
# One row per preset: its model (config fields), then the training arguments it sets.
PRESET_MODEL = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# fmt: off
PRESET_RUN = ("vocab_size", "seq_len", "batch_size", "max_steps", "lr", "warmup_steps", "max_train_chars",
              "max_val_chars", "save_every", "eval_every")
PRESET_TABLE = {
    #         hidden layers heads  MLP | vocab   seq batch  steps    lr   warm-up train chars  val chars save eval
    "tiny":  ((192,    4,     4,  512), (4096,  128,  16,    250, 2e-3,     25, 2_000_000,    60_000, 100, 100)),
    "small": ((384,    6,     6, 1024), (8192,  256,  32,   3000, 1e-3,    200,         0,   600_000, 500, 500)),
    "base":  ((768,   12,    12, 2048), (16384, 512,  32,  20000, 6e-4,   1000,         0,         0, 1000, 1000)),
}
# fmt: on
PRESETS: dict[str, dict] = {
    name: dict(model=dict(zip(PRESET_MODEL, model)), **dict(zip(PRESET_RUN, run)))
    for name, (model, run) in PRESET_TABLE.items()
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
# Training arguments that may differ between a run and its resumption.
RESUME_FREE = frozenset(
    {
        "resume",
        "overwrite",
        "stop_after",
        "no_progress",
        "push_to_hub",
        "hub_private",
        "num_proc",
        "cache_dir",
    }
)
# Names a training_args.json written before the fields took their flags' names (issue 28) may hold.
OLD_NAMES = {"model_options": "set"}


class TrainArgumentError(ValueError):
    """A wrong `swapformer train` argument, found before training starts."""


@dataclass
class TrainArgs:
    """Arguments of one training run, each named as its flag (`no_progress` is `--no-progress`, `set` the
    `--set` options as a dict of config fields). `None` means "from the preset"."""

    arch: str = "decoder"
    preset: str = "tiny"
    output_dir: str = "swapformer-model"
    data: list[str] = field(default_factory=list)
    text_column: str = "text"
    tokenizer: str | None = None
    vocab_size: int | None = None
    config: str | None = None
    set: dict = field(default_factory=dict)  # config fields, e.g. {"num_key_value_heads": 2}
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
    num_proc: int | None = None  # tokenizing processes (None: one per 50 M characters, at most the CPUs)
    cache_dir: str | None = None  # documents and token shards (None: shards.cache_dir's default)
    streaming: bool = (
        False  # training documents read as a `datasets` stream, tokenized as read (streaming.py)
    )
    mlm_probability: float = 0.15
    noise_density: float = 0.15
    mean_span_length: float = 3.0
    resume: str | None = None
    overwrite: bool = False
    no_progress: bool = False
    push_to_hub: str | None = None  # a Hub repo id the finished folder is uploaded to
    hub_private: bool = False
    stop_after: int | None = None  # test hook: end as if killed after this step (no save)

    def resolved(self) -> TrainArgs:
        """A copy with every unset argument taken from the preset."""
        if self.preset not in PRESETS:
            raise TrainArgumentError(
                f"--preset {self.preset!r} is unknown; choose one of {', '.join(PRESETS)}"
            )
        if not isinstance(self.set, dict):
            raise TrainArgumentError(
                f"set must be a dict of config fields such as {{'num_key_value_heads': 2}} (the command line's "
                f"--set num_key_value_heads=2), got {self.set!r}"
            )
        preset = PRESETS[self.preset]
        out = dataclasses.replace(self, data=list(self.data), set=dict(self.set))
        for name, value in preset.items():
            if name != "model" and getattr(out, name) is None:
                setattr(out, name, value)
        if self.warmup_steps is None and self.max_steps is not None and isinstance(self.max_steps, int):
            # the preset's warm-up is a share of its length: a run of another length keeps the share
            out.warmup_steps = preset["warmup_steps"] * self.max_steps // preset["max_steps"]
        return out

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, saved: dict) -> TrainArgs:
        """The arguments a training_args.json holds, also one written under the old names."""
        return cls(**current_names(saved))

    def differences(self, other: dict) -> list[str]:
        """Names of the arguments (other than resume-only ones) whose values differ from `other`. An
        argument added after `other` was saved counts as its default there (a run saved before
        `--packing` existed did not pack)."""
        mine = self.to_json()
        defaults = {
            f.name: f.default for f in dataclasses.fields(self) if f.default is not dataclasses.MISSING
        }
        other = {**defaults, **current_names(other)}
        names = (set(mine) | set(other)) - RESUME_FREE
        return sorted(n for n in names if mine.get(n) != other.get(n))


def current_names(saved: dict) -> dict:
    """A saved training_args.json under today's names (`model_options` -> `set`, `progress` ->
    `no_progress`)."""
    out = {OLD_NAMES.get(name, name): value for name, value in saved.items() if name != "progress"}
    if "progress" in saved:
        out["no_progress"] = not saved["progress"]
    return out


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
    """The backend names --attn uses ("auto" included)."""
    choice = attn_choice(attn)
    return set(choice.values()) if isinstance(choice, dict) else {choice}


def named_backends(attn: str) -> set[str]:
    """The backends --attn names itself, whose rows the launch checks: "auto" chooses per forward among the
    backends that run the batch (trainable here, packing where asked), so it needs no check of its own."""
    return attn_backends(attn) - {"auto"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")
