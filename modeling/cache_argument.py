"""The cache argument of every forward: its deprecated names, the `cache_position` check, and
`use_cache` under gradient checkpointing."""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache argument to `cache` and deprecates the old names with
# `deprecate_kwarg(old, "5.40.0", new_name="cache")` (Llama, BART: past_key_values; Mamba:
# cache_params); the warning below is that decorator's text.
OLD_CACHE_NAMES = ("past_key_values", "cache_params")
CACHE_NAMES_REMOVED_IN = "5.40.0"


def cache_argument(forward):
    """Decorates a forward whose cache parameter is `cache`: `past_key_values=` and `cache_params=`
    are taken with transformers' FutureWarning (shown once per call site, as Python shows it),
    two names for the cache at once raise, and `cache_position` (which transformers 5.24's models
    take and no longer need) is checked against the cache instead of being silently ignored."""
    signature = inspect.signature(forward)
    names = list(signature.parameters)
    cache_at = names.index("cache")  # position in (self, *args)
    # the tokens the cache grows by: the decoder's, for an encoder-decoder
    new_tokens = (
        ("decoder_input_ids", "decoder_inputs_embeds", "labels")
        if "decoder_input_ids" in names
        else ("input_ids", "inputs_embeds")
    )

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        given = [n for n in OLD_CACHE_NAMES if kwargs.get(n) is not None]
        for n in OLD_CACHE_NAMES:
            if kwargs.get(n) is None:
                kwargs.pop(n, None)
        if given:
            positional = args[cache_at - 1] if len(args) >= cache_at else None
            if kwargs.get("cache") is not None or positional is not None:
                given.insert(0, "cache")
            if len(given) > 1:
                raise ValueError(
                    f"Both `{given[0]}` and `{given[1]}` are set for `{type(self).__name__}.forward`: pass the "
                    "cache once, as `cache=`, not both (`past_key_values` and `cache_params` are its deprecated names)"
                )
            if not torch.compiler.is_compiling():
                warnings.warn(
                    f"`{given[0]}` is deprecated and will be removed in version {CACHE_NAMES_REMOVED_IN} for "
                    f"`{type(self).__name__}.forward`. Use `cache` instead.",
                    FutureWarning,
                    stacklevel=2,
                )
            if len(args) >= cache_at:
                args = (*args[: cache_at - 1], kwargs.pop(given[0]), *args[cache_at:])
            else:
                kwargs["cache"] = kwargs.pop(given[0])
        cache_position = kwargs.pop("cache_position", None)
        if cache_position is not None and not torch.compiler.is_compiling():
            check_cache_position(cache_position, signature.bind(self, *args, **kwargs).arguments, new_tokens)
        return forward(self, *args, **kwargs)

    return wrapper


def check_cache_position(cache_position: torch.Tensor, arguments: dict, new_tokens: tuple[str, ...]) -> None:
    """New tokens always follow the cached ones (as in transformers 5.24, where `cache_position` is
    no longer read); a `cache_position` saying otherwise is an error rather than silently ignored."""
    cache = arguments.get("cache")
    past = cache.get_seq_length() if cache is not None else 0
    for name in new_tokens:
        if arguments.get(name) is not None:
            length = arguments[name].shape[1]
            break
    else:
        return
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


__all__ = ["cache_argument", "check_cache_position", "use_cache_unless_checkpointing"]
