"""The key/value cache as one forward reads it: `CacheView` (the tokens cached, the keys each layer will
hand to attention, appending new keys) and the caches swapformer builds (`dynamic_cache`,
`static_cache`, `fresh_cache`). The layer classes of swapformer's own are in cache_layers.py (window of
one, window + global, static window; what generate() and these builders put in a cache); this module
re-exports them.

Shape legend: B batch, T new tokens, P cached tokens, S keys handed to attention.

A cache layer may keep fewer keys than it has seen (a window drops old ones; a window + global layer
keeps its leading global tokens ahead of the window), so the keys it hands to attention cover absolute
indices `[0, key_prefix) + [key_offset, key_offset + S - key_prefix)`. `CacheView.key_geometry` says
which, per layer, before the layer runs; `append` is how a layer adds its new keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import (
    Cache,
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.utils import logging

from ..compat.hf_compat import DynamicSlidingWindowLayer
from .cache_keywords import read_cache_keywords
from .cache_layers import GlobalWindowLayer, SlidingWindowLayer, StaticWindowLayer

logger = logging.get_logger(__name__)

# Set on a transformers Cache filled from packed rows, so a later step cannot extend it silently.
PACKED_CACHE_FLAG = "_swapformer_packed_rows"


# The keywords that name the cache otherwise: its names before transformers 5.24 and `cache_position`.
CACHE_KEYWORDS = frozenset({"past_key_values", "cache_params", "cache_position"})


def cache_argument(model, cache: Cache | None, kwargs: dict, new_tokens: torch.Tensor | None) -> Cache | None:
    """The cache a forward was given: `cache`, or what one of `CACHE_KEYWORDS` in its `kwargs` says
    (cache_keywords.py takes them out, with transformers' warning for the deprecated names). Called first
    in every forward that takes a cache; `new_tokens` (B, T, ...) are the tokens the cache grows by."""
    if CACHE_KEYWORDS.isdisjoint(kwargs):
        return cache
    return read_cache_keywords(model, cache, kwargs, new_tokens)


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


def fresh_cache(cache: Cache) -> Cache:
    """`cache`, just built by swapformer or by generate() for a swapformer model and not used yet, with
    swapformer's layer objects where transformers' would serve worse: a dynamic window of 1 keeps no key
    (`SlidingWindowLayer`), and the window layers of a static cache whose other layers tell the
    generation's length keep one compiled shape (`StaticWindowLayer`). New objects are put in the new
    cache's layer lists; no object a user holds is changed (a user's cache is read as it is)."""
    self_attention = getattr(cache, "self_attention_cache", cache)
    layers = self_attention.layers
    for i, layer in enumerate(layers):
        if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window == 1:
            layers[i] = SlidingWindowLayer(sliding_window=1)
            layers[i].record_past = layer.record_past  # generate() may have set it already
    cross = getattr(cache, "cross_attention_cache", None)
    if cross is not None:  # transformers built it from the decoder's layer types: cross-attention reads
        # every encoder key at every step, so no window layer may drop one
        cross.layers[:] = [
            DynamicLayer() if getattr(layer, "is_sliding", False) and not layer.is_initialized else layer
            for layer in cross.layers
        ]
    windows = [i for i, layer in enumerate(layers) if type(layer) is StaticSlidingWindowLayer]
    spans = [layer.max_cache_len for layer in layers if type(layer) is StaticLayer]
    # a cache of window layers only stays as it is (compiled, one graph per step), as does one that
    # generate() initialised early for a compiled prefill
    if windows and spans and not any(layers[i].is_initialized for i in windows):
        for i in windows:
            layers[i] = StaticWindowLayer(layers[i].max_cache_len, max(spans))
    return cache


def dynamic_cache(config) -> DynamicCache:
    """The dynamic cache a swapformer model of `config` decodes with (what generate() uses)."""
    return fresh_cache(DynamicCache(config=config))


def static_cache(config, max_cache_len: int) -> StaticCache:
    """The static (compileable) cache a swapformer model of `config` decodes with, holding
    `max_cache_len` tokens (what `generate(cache_implementation="static")` uses)."""
    return fresh_cache(StaticCache(config=config, max_cache_len=max_cache_len))


def static_key_slots(cache: Cache | None) -> int | None:
    """Key slots of a static (compileable) cache whose layers all keep every token or are
    `StaticWindowLayer`s: masks may then span all its slots (`create_masks_for_generate` pads them so),
    and a compiled decoding step keeps one shape. None for any other cache."""
    if cache is None or not cache.is_compileable:
        return None
    layers = getattr(cache, "self_attention_cache", cache).layers
    moving = [
        getattr(layer, "is_sliding", False) and not isinstance(layer, StaticWindowLayer) for layer in layers
    ]
    if any(moving):
        return None
    return max(getattr(layer, "key_slots", layer.max_cache_len) for layer in layers)


@dataclass(frozen=True)
class KeyGeometry:
    """Which absolute key indices the S keys a cache layer hands to attention hold: keys j < `prefix`
    are the first tokens (index j), the rest start at index `offset`."""

    length: int
    offset: int = 0
    prefix: int = 0


@dataclass(frozen=True)
class CacheView:
    """What one forward needs to know of a transformers `Cache` (or of no cache).

    Attributes:
        cache: the cache, or None.
        past: tokens it holds before this forward (P); a 0-d tensor when a static cache counts them
            under torch.compile.
        key_slots: the key slots of a static cache whose layers keep every token, else None.
    """

    cache: Cache | None
    past: int | torch.Tensor = 0
    key_slots: int | None = None

    @classmethod
    def of(cls, cache: Cache | None) -> CacheView:
        if cache is None:
            return cls(None)
        past = cache.get_seq_length()
        if torch.is_tensor(past) and not torch.compiler.is_compiling():
            past = int(past)  # a static cache counts in a tensor; outside compile, read it once
        return cls(cache, past, static_key_slots(cache))

    def layer(self, idx: int):
        """The self-attention cache layer `idx` (of an EncoderDecoderCache's decoder part), or None."""
        layers = getattr(self.cache, "self_attention_cache", self.cache).layers
        return layers[idx] if idx < len(layers) else None

    def key_geometry(self, layer_idx: int, new_tokens: int) -> KeyGeometry:
        """The keys self-attention layer `layer_idx` will hand over once it appended `new_tokens`."""
        if self.cache is None:
            return KeyGeometry(self.past + new_tokens)
        layer = self.layer(layer_idx)
        if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window == 1 and not layer.record_past:
            # transformers' window of 1 keeps every key (`[-0:]`) and hands them all over, unlike what its
            # get_mask_sizes says: read what it holds (swapformer's own caches use SlidingWindowLayer)
            stored = layer.keys.shape[-2] if layer.is_initialized else 0
            return KeyGeometry(stored + new_tokens, layer.cumulative_length - stored)
        length, offset = self.cache.get_mask_sizes(new_tokens, layer_idx)
        return KeyGeometry(length, offset, getattr(layer, "key_prefix", 0))

    def refuse_if_packed(self, prefix: str = "") -> None:
        """A cache filled from packed rows cannot be extended (no new token knows its sequence).
        Under torch.compile this is not checked (README: packed sequences)."""
        if self.cache is None or torch.compiler.is_compiling():
            return
        if getattr(self.cache, PACKED_CACHE_FLAG, False) and (
            not isinstance(self.past, int) or self.past > 0
        ):
            raise ValueError(
                f"This cache was filled from packed rows (several sequences per row, marked by {prefix}position_ids "
                "or cu_seq_lens); it cannot be extended. For cached decoding and generate(), give one sequence per "
                "row (pad them) instead of packing them"
            )

    def mark_packed(self) -> None:
        """Record that packed rows fill this cache (not under torch.compile, where every row with
        position_ids counts as packed)."""
        if self.cache is not None and not torch.compiler.is_compiling():
            setattr(self.cache, PACKED_CACHE_FLAG, True)

    def append(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int):
        """Add self-attention layer `layer_idx`'s new keys and values (B, K, T, D); return the keys and
        values it hands to attention (B, K, S, D)."""
        if self.cache is None:
            return key, value
        part = self.cache.self_attention_cache if isinstance(self.cache, EncoderDecoderCache) else self.cache
        return part.update(key, value, layer_idx)


__all__ = [
    "CacheView",
    "cache_argument",
    "use_cache_unless_checkpointing",
    "GlobalWindowLayer",
    "KeyGeometry",
    "SlidingWindowLayer",
    "StaticWindowLayer",
    "dynamic_cache",
    "fresh_cache",
    "static_cache",
    "static_key_slots",
]
