"""What the base models and their task heads share: the inputs passed through to the stack, the cache
argument, and `TaskHead`.

A head's `forward` is written as transformers writes its heads (Llama, BERT, BART): the positional
prefix and the head's own inputs are explicit parameters, swapformer's own input
`global_attention_mask` is a keyword-only one (Trainer keeps only dataset columns that forward names,
generate() only keywords it names or knows), and the standard inputs of every transformers model pass
as `**kwargs: Unpack[HeadKwargs]`. The forward then calls `TaskHead.run_head`: the base model
(`self.model`), then the head's own `head_outputs` (logits and loss). Forwards that take a cache read
it with `cache_argument`, first thing, as transformers' `deprecate_kwarg` reads it for Llama."""

from __future__ import annotations

import warnings
from typing import ClassVar, TypedDict

import torch
from torch import nn
from transformers import Cache
from transformers.utils import logging

logger = logging.get_logger(__name__)

PACKING_INPUTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class BaseModelKwargs(TypedDict, total=False):
    """The inputs of every base model that pass as `**kwargs` (all of them names of transformers'
    `TransformersKwargs`, which generate() accepts without finding them in a signature).

    Args:
        output_attentions, output_hidden_states: return every layer's attention map / hidden state
            (default: the config's).
        cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx: packed sequences as
            `DataCollatorWithFlattening` marks them (restarting `position_ids` alone do too); each
            sequence then attends only to itself (modeling/attention/packing.py). Of the encoder input, for an
            encoder-decoder.

    transformers' models ignore a keyword they do not know; here a name outside these is a TypeError
    (`check_base_inputs`), as a misspelt keyword argument of a plain function is.
    """

    output_attentions: bool | None
    output_hidden_states: bool | None
    cu_seq_lens_q: torch.Tensor | None
    cu_seq_lens_k: torch.Tensor | None
    max_length_q: int | None
    max_length_k: int | None
    seq_idx: torch.Tensor | None


class HeadKwargs(BaseModelKwargs, total=False):
    """A task head's `**kwargs`: the base-model inputs and Trainer's count of labelled tokens in the
    whole accumulated batch (`num_items_in_batch`, for heads with `accepts_loss_kwargs`)."""

    num_items_in_batch: int | torch.Tensor | None


def check_base_inputs(module: nn.Module, kwargs: dict) -> None:
    """A keyword argument that is neither a parameter of the forward that got it (a head's or the base
    model's) nor a `BaseModelKwargs` name is a TypeError, as for any plain function."""
    unknown = sorted(set(kwargs) - BaseModelKwargs.__optional_keys__)
    if unknown:
        raise TypeError(
            f"{type(module).__name__}.forward() (or the task head that called it) got unexpected keyword "
            f"argument(s) {unknown}: neither its parameters nor a BaseModelKwargs input "
            f"{sorted(BaseModelKwargs.__optional_keys__)}; check the spelling"
        )


def stack_inputs(module: nn.Module, global_attention_mask: torch.Tensor | None, kwargs: dict) -> dict:
    """`forward_stack`'s keyword arguments for a base model's `global_attention_mask` and
    `BaseModelKwargs` (output flags defaulting to the config's); any other name is a TypeError."""
    check_base_inputs(module, kwargs)
    config = module.config

    def flag(name):
        value = kwargs.get(name)
        return getattr(config, name) if value is None else value

    return dict(
        global_attention_mask=global_attention_mask,
        output_attentions=flag("output_attentions"),
        output_hidden_states=flag("output_hidden_states"),
        packing_inputs={name: kwargs.get(name) for name in PACKING_INPUTS},
    )


def model_output(config, output, return_dict: bool | None):
    """The ModelOutput, or its tuple (None fields dropped, loss first) when return_dict is False."""
    return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()


def keep_positions(h: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of h (B, T, E) that need logits, by transformers' rule (`slice_logits_to_keep`):
    an int N keeps the last N (0: all); a 1-D tensor indexes positions of every row; a 2-D integer
    tensor (B, N) positions per row; a 2-D bool mask (B, T) the True positions, flattened to (n, E)."""
    if isinstance(logits_to_keep, int):
        return h[:, -logits_to_keep:] if logits_to_keep else h
    if logits_to_keep.dim() == 2:
        if logits_to_keep.dtype == torch.bool:
            return h[logits_to_keep.to(h.device)]
        return torch.take_along_dim(h, logits_to_keep.to(h.device)[..., None], dim=1)
    return h[:, logits_to_keep]


class TaskHead:
    """Mixin of the task heads: `run_head` runs the base model and the head's `head_outputs`.

    A head sets `output_class` (transformers' ModelOutput of its task) and writes
    `head_outputs(self, out, ...) -> dict`: its own fields (loss, logits, ...) from the base model's
    output `out` and the head inputs its forward passes on. Every other field of `output_class`
    (cache, hidden states, attentions) is taken from `out`."""

    output_class: ClassVar[type]
    accepts_loss_kwargs: ClassVar[bool]

    def run_head(self, base_args: tuple, base_kwargs: dict, return_dict: bool | None, **head_inputs):
        """base_args, base_kwargs: the base model's inputs; head_inputs: `head_outputs`'s arguments."""
        count = base_kwargs.pop("num_items_in_batch", None)
        if count is not None:
            if not self.accepts_loss_kwargs:
                raise TypeError(
                    f"{type(self).__name__}.forward() got num_items_in_batch={count}, but its loss is a mean "
                    "over sequences (accepts_loss_kwargs=False): drop the argument"
                )
            head_inputs["num_items_in_batch"] = count
        out = self.model(*base_args, return_dict=True, **base_kwargs)
        fields = self.head_outputs(out, **head_inputs)
        carried = {
            k: v for k, v in out.items() if k in self.output_class.__dataclass_fields__ and k not in fields
        }
        return model_output(self.config, self.output_class(**carried, **fields), return_dict)


# The cache argument ------------------------------------------------------------------------------

# transformers 5.24 renamed the cache argument to `cache` and deprecates the old names with
# `deprecate_kwarg(old, "5.40.0", new_name="cache")` (Llama, BART: past_key_values; Mamba:
# cache_params); the warning below is that decorator's text.
OLD_CACHE_NAMES = ("past_key_values", "cache_params")
CACHE_NAMES_REMOVED_IN = "5.40.0"


def cache_argument(
    model: nn.Module, cache: Cache | None, kwargs: dict, new_tokens: torch.Tensor | None
) -> Cache | None:
    """The cache a forward was given. Takes the deprecated names (`past_key_values=`, `cache_params=`)
    out of its `kwargs` with transformers' FutureWarning, refuses two names for the cache at once, and
    checks `cache_position` (which transformers 5.24's models take and no longer need) against the
    cache instead of silently ignoring it.

    Args:
        kwargs: the forward's `**kwargs`, from which those three names are removed.
        new_tokens: (B, T, ...) the tokens the cache grows by (the decoder's, for an encoder-decoder).
    """
    old = {name: kwargs.pop(name, None) for name in OLD_CACHE_NAMES}
    given = [name for name, value in old.items() if value is not None]
    if given and cache is not None:
        given.insert(0, "cache")
    if len(given) > 1:
        raise ValueError(
            f"Both `{given[0]}` and `{given[1]}` are set for `{type(model).__name__}.forward`: pass the "
            "cache once, as `cache=`, not both (`past_key_values` and `cache_params` are its deprecated names)"
        )
    if given and given[0] != "cache":
        cache = old[given[0]]
        if not torch.compiler.is_compiling():
            warnings.warn(
                f"`{given[0]}` is deprecated and will be removed in version {CACHE_NAMES_REMOVED_IN} for "
                f"`{type(model).__name__}.forward`. Use `cache` instead.",
                FutureWarning,
                stacklevel=3,
            )
    cache_position = kwargs.pop("cache_position", None)
    if cache_position is not None and new_tokens is not None and not torch.compiler.is_compiling():
        check_cache_position(cache_position, cache, new_tokens.shape[1])
    return cache


def check_cache_position(cache_position: torch.Tensor, cache: Cache | None, length: int) -> None:
    """New tokens always follow the cached ones (as in transformers 5.24, where `cache_position` is
    no longer read); a `cache_position` saying otherwise is an error rather than silently ignored."""
    past = cache.get_seq_length() if cache is not None else 0
    expected = torch.arange(past, past + length, device=cache_position.device)
    if cache_position.shape[-1:] != (length,) or not bool((cache_position == expected).all()):
        shown = cache_position.flatten()[:8].tolist()
        raise ValueError(
            f"cache_position={shown}{'...' if cache_position.numel() > 8 else ''} disagrees with the inputs: "
            f"{length} new token(s) after {past} cached ones sit at positions {past}..{past + length - 1}. New "
            "tokens always follow the cache; drop cache_position, or crop the cache (cache.crop(n)) to rewrite it"
        )


def use_cache_unless_checkpointing(module: nn.Module, use_cache: bool | None) -> bool:
    """`use_cache` (default: the config's), switched off with transformers' warning while gradient
    checkpointing trains: recomputed layers would write the cache twice."""
    use_cache = module.config.use_cache if use_cache is None else use_cache
    if use_cache and module.gradient_checkpointing and module.training and torch.is_grad_enabled():
        # Llama's text (transformers.utils.generic.merge_with_config_defaults)
        logger.warning_once(
            "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`."
        )
        return False
    return bool(use_cache)


__all__ = [
    "BaseModelKwargs",
    "HeadKwargs",
    "TaskHead",
    "cache_argument",
    "check_base_inputs",
    "keep_positions",
    "model_output",
    "stack_inputs",
    "use_cache_unless_checkpointing",
]
