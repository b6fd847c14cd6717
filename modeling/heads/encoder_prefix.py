"""A key/value prefix for the bidirectional encoder: what BertModel does with the cache PEFT's prefix
tuning hands it (`past_key_values`), where every layer's tokens also attend to P learned keys and
values placed before them (their positions start at P, as BERT's do).

The prefix is read, never extended: BertModel appends the tokens' keys to the cache it is given, so a
second forward with the same object would silently see the first one's tokens as prefix. Here the
forward reads each layer's keys and values into a new cache that only it holds.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Cache, DynamicCache


def key_value_prefix(model: nn.Module, cache: Cache | None) -> DynamicCache | None:
    """A new cache holding `cache`'s keys and values, for one forward of the encoder `model`; None
    without a prefix. Refuses a prefix the encoder cannot read, naming what was found."""
    if cache is None:
        return None
    if not isinstance(cache, Cache):
        raise TypeError(
            f"{type(model).__name__}.forward() takes a key/value prefix as a transformers Cache (e.g. "
            f"DynamicCache), got {type(cache).__name__}; build one with DynamicCache() and cache.update(k, v, i)"
        )
    layers = getattr(cache, "self_attention_cache", cache).layers
    config = model.config
    if len(layers) != config.num_hidden_layers or not all(layer.is_initialized for layer in layers):
        filled = sum(layer.is_initialized for layer in layers)
        raise ValueError(
            f"The key/value prefix fills {filled} of {len(layers)} cache layers, but this encoder has "
            f"num_hidden_layers={config.num_hidden_layers}: give keys and values for every layer"
        )
    prefix = DynamicCache()
    for i, layer in enumerate(layers):
        check_prefix_shape(config, i, layer.keys, layer.values)
        prefix.update(layer.keys, layer.values, i)
    return prefix


def check_prefix_shape(config, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    want = (config.num_key_value_heads, config.head_dim)
    for name, x in (("keys", keys), ("values", values)):
        if x.dim() != 4 or (x.shape[1], x.shape[3]) != want or x.shape[:3] != keys.shape[:3]:
            raise ValueError(
                f"Layer {index} of the key/value prefix has {name} of shape {tuple(x.shape)}; this encoder needs "
                f"(batch, num_key_value_heads={want[0]}, prefix length, head_dim={want[1]}) for keys and values "
                "alike (PrefixTuningConfig infers num_attention_heads and token_dim from the model's config)"
            )
