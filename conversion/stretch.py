"""Dense to long: an encoder with a longer learned position table and windowed attention layers.

Longformer's recipe (Beltagy et al. 2020, https://arxiv.org/abs/2004.05150, section 5): a model
trained on 512 positions gets a 4096-row table made of copies of its learned 512 rows (the
attention of a pretrained model is mostly local, so each copy keeps that local structure), and its
layers attend within a window plus a few global tokens. Up to the window's length, a query sees every
key, and the first copy of the table is the source's own: the long model then computes exactly
what the source computes. Longer inputs read the later copies; Longformer continued masked-LM
pretraining from there, and so should anyone who needs quality beyond the source's length.

RoBERTa's table starts at row padding_idx + 1 = 2 (transformers counts positions from there); the
conversion has already set those two rows aside (`unused_source_weights.safetensors`), so the table
copied here starts at the first position a real token reads, as Longformer copied rows 2..513.

`stretch(model_or_path, max_length=4096, layer_types="sliding_global_attention", window=512,
global_tokens=1)` works in memory; `convert(src, out, max_length=..., ...)` (the `swapformer convert`
flags `--max-length`, `--layer-types`, `--window`, `--global-tokens`) writes a verified folder.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass

import torch

from ..configuration.configuration_swapformer import LAYER_TYPES
from .engine import from_hf_model
from .family import FAMILIES, family_for
from .rules import ConversionError

PATTERNED = ("sliding_global_attention", "bigbird_attention")  # layer types that read global tokens


def _arg(name: str, value) -> str:
    """How a setting reads in a message: the command-line flag and the Python keyword."""
    return f"--{name.replace('_', '-')} {value if not isinstance(value, list) else json.dumps(value)} ({name}={value!r})"


@dataclass(frozen=True)
class LongSettings:
    """What `--max-length`, `--layer-types`, `--window` and `--global-tokens` ask for; None: keep the
    source's value. `layer_types` is one name for every layer or a list with one per layer."""

    max_length: int | None = None
    layer_types: str | list[str] | tuple[str, ...] | None = None
    window: int | None = None
    global_tokens: int | None = None

    def given(self) -> bool:
        return any(v is not None for v in vars(self).values())

    def flags(self) -> str:
        return " ".join(f"--{k.replace('_', '-')}" for k, v in vars(self).items() if v is not None)


def check_source(model_type: str | None, config=None) -> None:
    """Refuse a source whose positions cannot be stretched, saying what to do instead (`config`: a
    swapformer encoder's, whose position type decides). A family says whether it stretches
    (`Family.stretchable`, `Family.long_refusal`)."""
    family = FAMILIES.get(model_type)
    if family is not None and family.stretchable:
        return
    stretchable = ", ".join(sorted(name for name, f in FAMILIES.items() if f.stretchable))
    if model_type == "swapformer_encoder" and config is not None:
        if config.position_embedding_type == "learned":
            return
        reason = (
            f"this encoder has position_embedding_type={config.position_embedding_type!r}; only learned "
            "position tables are copied"
        )
    elif model_type in ("swapformer_decoder", "swapformer_seq2seq"):
        reason = f"{model_type} is not an encoder; only encoders with learned positions stretch"
    elif family is not None and family.long_refusal is not None:
        reason = family.long_refusal
    else:
        reason = f"model_type={model_type!r} has no long-model recipe (supported encoders: {stretchable})"
    raise ConversionError(
        f"Cannot make a long model from this source: {reason}. The long-model settings (max_length, "
        "layer_types, window, global_tokens) apply to BERT and RoBERTa checkpoints; convert without them"
    )


def _int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConversionError(f"{_arg(name, value)} must be an integer >= {minimum}")


def _layer_types(config, settings: LongSettings) -> list[str]:
    """The layer types `settings` ask for (one per layer), checked."""
    n = config.num_hidden_layers
    layer_types = settings.layer_types
    if layer_types is None:
        layer_types = list(config.layer_types)
    elif isinstance(layer_types, str):
        layer_types = [layer_types] * n
    else:
        layer_types = list(layer_types)
        if len(layer_types) != n:
            raise ConversionError(
                f"{_arg('layer_types', layer_types)} lists {len(layer_types)} layer types but the model has "
                f"{n} layers; give one name for all of them or a list of {n}"
            )
    for name in layer_types:
        if name not in LAYER_TYPES:
            raise ConversionError(
                f"{_arg('layer_types', settings.layer_types)}: {name!r} is not a layer type; choose from "
                f"{', '.join(LAYER_TYPES)}"
            )
    return layer_types


def _check_global_tokens(global_tokens: int, layer_types: list[str], max_length: int) -> None:
    """`--global-tokens` against the layers that would read them and the long model's length."""
    _int("global_tokens", global_tokens, 0)
    if global_tokens and not any(t in PATTERNED for t in layer_types):
        raise ConversionError(
            f"{_arg('global_tokens', global_tokens)} has no layer to apply to: only "
            f"{' and '.join(PATTERNED)} layers read global tokens; pass --layer-types "
            "sliding_global_attention (layer_types='sliding_global_attention') or drop --global-tokens"
        )
    if global_tokens >= max_length:
        raise ConversionError(
            f"{_arg('global_tokens', global_tokens)} must be smaller than the {max_length} "
            "positions of the model (Longformer makes the first token, [CLS], global: 1)"
        )


def long_config_values(config, settings: LongSettings) -> dict:
    """The swapformer config fields `settings` set on an encoder `config` (its learned table has
    `config.max_position_embeddings` rows), checked with messages that name the flags.

    Returns {max_position_embeddings, layer_types, sliding_window, global_tokens}.
    Raises:
        ConversionError (a ValueError): a value out of range, or settings that contradict each other.
    """
    source_length = config.max_position_embeddings
    max_length = source_length if settings.max_length is None else settings.max_length
    if settings.max_length is not None:
        _int("max_length", settings.max_length, 1)
        if max_length < source_length:
            raise ConversionError(
                f"{_arg('max_length', max_length)} is shorter than the source's {source_length} learned positions; "
                f"pass at least {source_length} (Longformer: 4096 from 512), or leave it out to keep {source_length}"
            )
    layer_types = _layer_types(config, settings)
    windowed = [t for t in layer_types if t != "full_attention"]
    window = settings.window if settings.window is not None else config.sliding_window
    if settings.window is not None:
        _int("window", settings.window, 1)
        if not windowed:
            raise ConversionError(
                f"{_arg('window', settings.window)} has no layer to apply to: every layer is full_attention; add "
                "--layer-types sliding_global_attention (layer_types='sliding_global_attention') or drop the window"
            )
    if windowed and window is None:
        raise ConversionError(
            f"layer_types {windowed[0]!r} needs a window width: pass --window (window=), e.g. --window 512"
        )
    if windowed and window >= max_length:
        raise ConversionError(
            f"{_arg('window', window)} is not smaller than the {max_length} positions of the long model, so "
            f"the window never cuts anything; pass a smaller window or a larger --max-length (max_length=)"
        )
    global_tokens = settings.global_tokens if settings.global_tokens is not None else config.global_tokens
    if settings.global_tokens is not None:
        _check_global_tokens(settings.global_tokens, layer_types, max_length)
    return {
        "max_position_embeddings": max_length,
        "layer_types": layer_types,
        "sliding_window": window if windowed else config.sliding_window,
        "global_tokens": global_tokens,
    }


def copied_table(table: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows` rows made of copies of `table` (N, E) one after another (row i is table[i % N])."""
    return table.repeat(math.ceil(rows / table.shape[0]), 1)[:rows].contiguous()


def stretch_model(model, settings: LongSettings, *, share: bool = False):
    """A new swapformer encoder of the class of `model` with the config values of `settings` and its
    position table copied up to `max_length` rows; the other tensors are `model`'s (cloned unless
    `share`, which the conversion uses for tensors it writes and drops at once)."""
    check_source(model.config.model_type, model.config)
    values = long_config_values(model.config, settings)
    config = copy.deepcopy(model.config)
    for name, value in values.items():
        setattr(config, name, value)
    config._validate()
    state = model.state_dict()
    key = model.base_model_prefix + ".embed_positions.weight"
    key = key if key in state else "embed_positions.weight"
    if not share:
        state = {k: v.detach().clone() for k, v in state.items()}
    state[key] = copied_table(state[key].detach(), values["max_position_embeddings"])
    with torch.device("meta"):
        long = type(model)(config)
    result = long.load_state_dict(state, strict=False, assign=True)
    if set(result.missing_keys) - set(long.all_tied_weights_keys) or result.unexpected_keys:
        raise ConversionError(f"The long model's keys disagree with the source's: {result}")
    long.tie_weights()
    return long.train(model.training)


def stretch_converted(model, settings: LongSettings, log) -> tuple:
    """The long model `convert` writes (when `settings` ask for one), the values to report, and the
    longest input on which it must compute what the source computes (None: `model` as it was)."""
    if not settings.given():
        return model, {}, None
    source_positions = model.config.max_position_embeddings
    model = stretch_model(model, settings, share=True)
    config = model.config
    names = ("max_position_embeddings", "layer_types", "sliding_window", "global_tokens")
    values = {"source_positions": source_positions, **{k: getattr(config, k) for k in names}}
    windowed = any(t != "full_attention" for t in config.layer_types)
    length = min(source_positions, config.sliding_window) if windowed else source_positions
    log(
        f"long model: positions {source_positions} -> {config.max_position_embeddings} (copied), "
        f"layer types {', '.join(sorted(set(config.layer_types)))}, sliding_window {config.sliding_window}, "
        f"global_tokens {config.global_tokens}; verifying on {length} tokens"
    )
    return model, values, length


def _load_any(path: str | os.PathLike, settings: LongSettings):
    """A swapformer encoder from a folder: a swapformer folder as it is, a BERT/RoBERTa folder converted
    in memory. `settings` are checked against the folder's config before any weight is read."""
    import transformers

    from .. import modeling, register

    register()
    config = transformers.AutoConfig.from_pretrained(path)
    check_source(config.model_type, config)
    arch = (config.architectures or [None])[0]
    if config.model_type == "swapformer_encoder":
        long_config_values(config, settings)
        return getattr(modeling, arch or "EncoderModel").from_pretrained(path)
    family = family_for(config.model_type)
    long_config_values(family.config_from_hf(config), settings)
    arch = arch or next(iter(family.classes(config)))
    target = family.architecture(arch, config)
    hf_model = getattr(transformers, arch).from_pretrained(path)
    return from_hf_model(hf_model, getattr(modeling, target.target))


def stretch(
    model_or_path,
    *,
    max_length: int | None = None,
    layer_types: str | list[str] | None = None,
    window: int | None = None,
    global_tokens: int | None = None,
):
    """A long swapformer encoder made from a BERT, RoBERTa or swapformer encoder (see the module docstring).

    Args:
        model_or_path: a swapformer encoder model, a transformers BERT/RoBERTa model (any of the heads
            that convert), or a folder holding either.
        max_length: rows of the new position table (the longest input); at least the source's.
        layer_types: one layer type for every layer (`"sliding_global_attention"`) or a list per layer.
        window: `sliding_window` of the windowed layers.
        global_tokens: how many leading tokens are global (Longformer: 1, the [CLS] token).
    Returns:
        A new model (the source is not changed): on inputs no longer than `window` (and the source's
        positions) it computes what the source computes.
    Raises:
        ConversionError (a ValueError): a source that cannot stretch (decoders, T5, RoPE), or settings
            out of range or contradicting each other, naming the values and the fix.
    """
    settings = LongSettings(max_length, layer_types, window, global_tokens)
    if isinstance(model_or_path, (str, os.PathLike)):
        return stretch_model(_load_any(model_or_path, settings), settings, share=True)
    config = getattr(model_or_path, "config", None)
    if config is None:
        raise TypeError(f"stretch() takes a model or a folder path, got {type(model_or_path).__name__}")
    if config.model_type.startswith("swapformer"):
        return stretch_model(model_or_path, settings)
    check_source(config.model_type, config)
    from .. import modeling

    target = family_for(config.model_type).architecture(type(model_or_path).__name__, config)
    converted = from_hf_model(model_or_path, getattr(modeling, target.target))
    return stretch_model(converted, settings, share=True)
