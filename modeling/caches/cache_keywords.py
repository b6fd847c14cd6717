"""The cache argument's other names: transformers' deprecated `past_key_values=` / `cache_params=` and
`cache_position=`, read only when a forward is given one of them (`cache.cache_argument` checks)."""

from __future__ import annotations

import inspect
import os
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import Cache

# transformers 5.24 renamed the cache argument to `cache` and deprecates the old names with
# `deprecate_kwarg(old, "5.40.0", new_name="cache")` (Llama, BART: past_key_values; Mamba:
# cache_params); the warning below is that decorator's text.
OLD_CACHE_NAMES = ("past_key_values", "cache_params")
CACHE_NAMES_REMOVED_IN = "5.40.0"


def read_cache_keywords(
    model: nn.Module, cache: Cache | None, kwargs: dict, new_tokens: torch.Tensor | None
) -> Cache | None:
    """The cache a forward was given, when its `kwargs` name the cache otherwise (`cache.cache_argument`
    checked that they do). Takes the deprecated names (`past_key_values=`, `cache_params=`)
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
                stacklevel=_callers_level(),
            )
    cache_position = kwargs.pop("cache_position", None)
    if cache_position is not None and new_tokens is not None and not torch.compiler.is_compiling():
        check_cache_position(cache_position, cache, new_tokens.shape[1])
    return cache


# the folders whose frames sit between a model's caller and the warning: swapformer's modeling package (or a
# remote-code folder's parent) and torch.nn's modules (Module.__call__)
_INSIDE = tuple(
    os.path.join(folder, "")
    for folder in (Path(__file__).resolve().parents[1], Path(nn.modules.__file__).resolve().parent)
)


def _callers_level() -> int:
    """`warnings.warn`'s stacklevel for the first frame outside `_INSIDE`: the line that called the model,
    however many forwards and heads are in between. (LlamaForCausalLM's warning points into torch's
    module.py, so Python's once-per-location filter shows it once per process rather than once per line.)"""
    frame, level = inspect.currentframe().f_back, 1  # level 1: the function that calls warnings.warn
    while frame.f_back is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


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
