"""The generate() calls refused before the first step: a prompt or a length that runs past a learned
position table (which would fail part-way, after the steps that fit), and a cache that already holds more
tokens than the inputs (which transformers slices to nothing, or silently to the wrong tokens).

generate() counts a decoder's positions over real tokens (left padding takes none), and never feeds
back the last token it generates, so a call needs `max_cache_length` positions (the number transformers
computes from the prompt and max_new_tokens or max_length and hands to `_prepare_cache_for_generation`),
less the padding of the least padded row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..caches.int8_cache import Int8Cache

OTHER_POSITIONS = "or use a model with rope/alibi/relative_bias positions"


class PastTheTable(ValueError):
    """A length refused inside transformers' generate(); swapformer's generate() raises its message again
    as a ValueError from its own frame (transformers' frames would say nothing more)."""


@dataclass(frozen=True)
class Prompt:
    """The tokens the decoder starts from, as generate() receives them."""

    name: str  # input_ids, inputs_embeds or decoder_input_ids
    width: int  # columns of the tensor
    longest: int  # real tokens of the longest row, by its attention mask
    mask_width: int  # columns of that mask (width when none is given)


def prompt_of(config, args: tuple, kwargs: dict) -> Prompt | None:
    """The decoder's prompt of `generate(*args, **kwargs)`, or None when it is not a batch of tensors."""
    if config.is_encoder_decoder:
        name, tokens, mask = (
            "decoder_input_ids",
            kwargs.get("decoder_input_ids"),
            kwargs.get("decoder_attention_mask"),
        )
        if tokens is None:
            return Prompt(name, 1, 1, 1)  # generate() starts from decoder_start_token_id
    else:
        name = "inputs_embeds" if kwargs.get("inputs_embeds") is not None else "input_ids"
        tokens = args[0] if args else kwargs.get("inputs", kwargs.get(name))
        mask = kwargs.get("attention_mask")
    if not torch.is_tensor(tokens) or tokens.dim() < 2:
        return None
    width = tokens.shape[1]
    if torch.is_tensor(mask) and mask.dim() == 2:
        return Prompt(name, width, int(mask.sum(-1).max()), mask.shape[1])
    return Prompt(name, width, width, width)


def refuse_filled_cache(cache, prompt: Prompt | None) -> None:
    """transformers reads the inputs given with a filled cache as the whole sequence, the cached tokens
    first, and feeds only the columns after them (unless the mask is wider than the inputs: then the
    inputs are the new tokens). Inputs no longer than the cache leave nothing, or the wrong tokens."""
    if cache is None or prompt is None or prompt.mask_width != prompt.width:
        return
    held = int(cache.get_seq_length())
    if held == 0 or prompt.width > held:
        return
    kind = type(cache).__name__
    raise ValueError(
        f"The {kind} passed to generate() already holds {held} tokens (a cache keeps the sequence it was filled "
        f"with), but {prompt.name} has {prompt.width}; generate() reads {prompt.name} as that whole sequence "
        f"followed by new tokens. To continue it, pass it whole (the earlier output with the new tokens "
        f"appended); to start a new sequence, pass a new cache ({_new_cache(cache)}) or none"
    )


def _new_cache(cache) -> str:
    inner = getattr(cache, "self_attention_cache", None)
    if isinstance(cache, Int8Cache):
        return "Int8Cache(model.config)"
    if isinstance(inner, Int8Cache):
        return "int8_cache(model.config)"
    if isinstance(cache, DynamicCache):
        return "DynamicCache(config=model.config)"
    return f"a new {type(cache).__name__}"


def refuse_prompt_past_table(config, prompt: Prompt | None, new_tokens: int | None) -> None:
    """A prompt longer than the learned position table, before generate() resolves any length (with its
    default max_length, transformers would advise raising max_length). `new_tokens`: max_new_tokens
    when the call names it."""
    table = config.max_position_embeddings
    if config.position_embedding_type != "learned" or prompt is None or prompt.longest <= table:
        return
    subject = "The prompt" if prompt.name != "decoder_input_ids" else "decoder_input_ids"
    keep = (
        f"n = {table} - (max_new_tokens - 1)"
        if new_tokens is None
        else f"n = {max(table - new_tokens + 1, 1)}"
    )
    raise ValueError(
        f"{subject} has {prompt.longest} tokens but the learned position table holds max_position_embeddings="
        f"{table}, and each new token after the first takes one more position; keep at most its last {keep} "
        f"tokens ({prompt.name}[:, -n:], or the tokenizer's truncation=True, max_length=n), {OTHER_POSITIONS}"
    )


def refuse_length_past_table(config, generation_config, model_kwargs: dict, max_cache_length: int) -> None:
    """The prompt and max_new_tokens (or max_length) together past the learned position table."""
    table = config.max_position_embeddings
    if config.position_embedding_type != "learned":
        return
    mask = model_kwargs.get("decoder_attention_mask" if config.is_encoder_decoder else "attention_mask")
    spare = int((mask.shape[1] - mask.sum(-1)).min()) if torch.is_tensor(mask) and mask.dim() == 2 else 0
    needed = max_cache_length - spare
    if needed <= table:
        return
    over = needed - table
    new_tokens = generation_config.max_new_tokens
    if new_tokens is None:
        asked = f"max_length={generation_config.max_length} (from the call or the model's generation_config)"
        fixes = f"pass at most max_length={generation_config.max_length - over}"
    else:
        prompt = needed + 1 - new_tokens
        name = "decoder_input_ids" if config.is_encoder_decoder else "a prompt"
        asked = f"{name} of {prompt} token{'s' * (prompt != 1)} and max_new_tokens={new_tokens}"
        fixes = f"ask for at most max_new_tokens={new_tokens - over}, shorten the prompt by {over} tokens"
    raise PastTheTable(
        f"generate() with {asked} needs {needed} positions (the last new token is never fed back), but the "
        f"learned position table holds max_position_embeddings={table}; {fixes}, {OTHER_POSITIONS}"
    )
