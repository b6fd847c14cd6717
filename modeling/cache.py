"""The key/value cache as swapformer reads it: transformers' `Cache` plus two layer classes of its own,
and `CacheView`, the one value the per-forward plan (plan.py) asks about the cache.

Shape legend: B batch, T new tokens, P cached tokens, S keys handed to attention.

A cache layer may keep fewer keys than it has seen (a window drops old ones; a window + global layer
keeps its leading global tokens ahead of the window), so the keys it hands to attention cover absolute
indices `[0, key_prefix) + [key_offset, key_offset + S - key_prefix)`. `CacheView.key_geometry` says
which, per layer, before the layer runs; `append` is how a layer adds its new keys.

Assisted and prompt-lookup decoding verify drafted tokens in one forward, then `crop` the rejected ones
off every layer. A layer that drops keys keeps them all while `record_past` is set (generate() sets it
through `activate_past_recording`), and a crop trims it back to what the next query can see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    Cache,
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from .hf_compat import DynamicSlidingWindowLayer, register_cache_layers

# Set on a transformers Cache filled from packed rows, so a later step cannot extend it silently.
PACKED_CACHE_FLAG = "_swapformer_packed_rows"


def tokens_to_crop(tokens_to_remove: int) -> int:
    """How many tokens `crop(tokens_to_remove)` removes: transformers 5.24 takes a negative count (the
    positive form, a length to crop to, is refused as transformers' own layers refuse it)."""
    if tokens_to_remove > 0:
        raise ValueError(
            f"crop({tokens_to_remove}): pass minus the number of tokens to remove, e.g. "
            f"crop(-{tokens_to_remove}) (transformers 5.24 refuses the old positive form, a length to crop)"
        )
    return -tokens_to_remove


def refuse_crop(layer, remove: int, total: int, dropped: str) -> None:
    raise ValueError(
        f"Cannot crop {remove} token(s) off a {type(layer).__name__} holding {total}: it already dropped "
        f"{dropped}, which the cropped cache would need. Call cache.activate_past_recording() before the "
        "forward whose tokens may be cropped (generate() does so for assisted and prompt-lookup decoding)"
    )


class StoredRows:
    """Storage hooks of the layers that drop keys, so that their int8 versions (int8_cache.py) keep the
    same bookkeeping over int8 rows."""

    __slots__ = ()  # no state of its own

    def _append(self, key_states, value_states):
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def _keep(self, prefix: int, start: int) -> None:
        """Keep stored rows [0, prefix) and [start, end)."""
        self.keys = torch.cat([self.keys[..., :prefix, :], self.keys[..., start:, :]], dim=-2)
        self.values = torch.cat([self.values[..., :prefix, :], self.values[..., start:, :]], dim=-2)

    def _stored(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0


class SlidingWindowLayer(DynamicSlidingWindowLayer, StoredRows):
    """transformers' windowed cache (`sliding_attention`), which keeps the last `sliding_window - 1`
    tokens as `[-sliding_window + 1:]`: for a window of 1 that is `[-0:]`, every token, so the keys it
    hands over disagree with its `get_mask_sizes` (also after `crop`). Here a window of 1 keeps none. Not
    registered (that would replace transformers' class for every model in the process): the caches
    swapformer builds get it (`fresh_cache`); transformers' layer in a cache a user built is read as it
    is (`CacheView.key_geometry`)."""

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.sliding_window == 1 and not self.record_past:
            self.keys, self.values = self.keys[..., :0, :], self.values[..., :0, :]
        return keys, values

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens and trim back to the last `sliding_window - 1`.
        Possible while the tokens the cropped cache needs are stored (always while `record_past`)."""
        remove, stored = tokens_to_crop(tokens_to_remove), self._stored()
        if not self.is_initialized:
            return
        total = self.cumulative_length - remove
        if remove > stored or stored - remove < min(total, self.sliding_window - 1):
            refuse_crop(self, remove, self.cumulative_length, f"all but the last {stored} tokens")
        self._keep(stored - remove, stored)
        self.cumulative_length = total
        self._keep(0, max(stored - remove - (self.sliding_window - 1), 0))


class GlobalWindowLayer(DynamicLayer, StoredRows):
    """The dynamic cache of a window + global layer (`sliding_global_attention`).

    Later queries can see only global tokens and the last `window - 1` tokens, so this layer keeps
    the leading tokens up to the last global one (a prefix, since global tokens are the first
    `global_tokens` real tokens of each row, plus any the prompt's `global_attention_mask` marks) and
    a window-sized tail: memory stops growing at prefix + window. The plan `plan`s each forward
    (window, prefix length) before the layer is read; until every row has all its global tokens the
    layer keeps everything. Stored keys cover absolute indices [0, prefix) + [tail_start, length).
    While `record_past` is set (assisted decoding) nothing is dropped until `crop`, as transformers'
    window layer does. Registered for its layer type (`hf_compat.register_cache_layers`), so
    `DynamicCache(config=...)` (what generate() builds) uses it.
    """

    is_croppable = True

    def __init__(self, **kwargs):
        super().__init__()
        self.cumulative_length = 0
        self.prefix = 0  # stored leading tokens when keys were dropped after them (else 0)
        self.tail_start = 0  # absolute index of the first stored key after the prefix
        self.window: int | None = None
        self.keep: int | None = None  # leading tokens that must stay; None: keep everything
        self.record_past = False

    def activate_past_recording(self) -> None:
        """Keep every token until the next `crop` (transformers calls this for assisted decoding)."""
        self.record_past = True

    def plan(self, window: int, keep: int | None, layer_idx: int) -> None:
        """Set the window and the leading tokens holding every global token, before a forward."""
        if keep is not None and self.tail_start > self.prefix and keep > self.prefix:
            raise ValueError(
                f"Layer {layer_idx} (sliding_global_attention) has a global token at index {keep - 1}, but its "
                f"window + global cache already dropped tokens {self.prefix}..{self.tail_start - 1}, which kept only "
                f"the first {self.prefix}; mark global tokens within the prompt (`global_tokens`, or the prompt's "
                "`global_attention_mask`), not in generated steps"
            )
        self.window, self.keep = window, keep

    @property
    def key_prefix(self) -> int:
        """Leading stored keys that are the first tokens, ahead of the tail (0 when contiguous)."""
        return self.prefix if self.tail_start > self.prefix else 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._append(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if not self.record_past:
            self._drop_unreachable()
        return keys, values

    def _drop_unreachable(self) -> None:
        if self.window is None or self.keep is None:
            return
        total, contiguous = self.cumulative_length, self.tail_start <= self.prefix
        prefix = min(self.keep, total) if contiguous else self.prefix
        tail_start = max(self.tail_start, prefix, total - self.window + 1)
        if tail_start <= prefix:
            return
        local_tail = tail_start if contiguous else self.prefix + tail_start - self.tail_start
        self._keep(prefix, local_tail)
        self.prefix, self.tail_start = prefix, tail_start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self._stored()
        # The first stored key after the prefix is at `tail_start` once keys were dropped, also with no
        # prefix (no global token: the stored keys are then one range starting there).
        return stored + query_length, (self.tail_start if self.tail_start > self.prefix else 0)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.prefix = self.tail_start = 0
        self.keep = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens, then drop what no later query can see. Possible
        while the cropped cache's window is stored: always while `record_past`, else until keys were
        dropped."""
        remove = tokens_to_crop(tokens_to_remove)
        if not self.is_initialized:
            return
        total, stored = self.cumulative_length - remove, self._stored()
        dropped = self.tail_start > self.prefix  # then the window is known, and must still be stored
        if remove > stored or (dropped and self.tail_start > total - self.window + 1):
            refuse_crop(self, remove, self.cumulative_length, f"tokens {self.prefix}..{self.tail_start - 1}")
        self._keep(stored - remove, stored)
        self.cumulative_length = total
        self._drop_unreachable()


class StaticWindowLayer(StaticLayer):
    """The static (compileable) cache of a `sliding_attention` layer, whose keys move every step inside
    one compiled graph.

    transformers' `StaticSlidingWindowLayer` decides with a Python count whether its window is full, so
    a compiled decoding step is specialised on it (one graph per step, until torch's recompile limit);
    and its keys cannot be read as a static cache's slots. This layer keeps the last `slots` tokens
    right-aligned: before a forward its slots hold absolute indices [P - slots, P) (negative ones are
    empty) and it hands attention the slots then the new keys, [P - slots, P + T), from a count held in a
    tensor. Outside torch.compile it hands over only the slots that hold tokens. `key_slots` is the
    length of the whole generation (the full layers' slots), which the attention mask spans. Not
    registered (that would change every model in the process): the static caches swapformer builds get it
    (`fresh_cache`); transformers' layer in a static cache a user built is read as it is.
    """

    is_sliding = True

    def __init__(self, slots: int, key_slots: int):
        super().__init__(max_cache_len=slots)
        self.key_slots = key_slots

    @property
    def is_croppable(self) -> bool:
        """Only a layer that never drops a token can be cropped (as transformers' static window layer)."""
        return self.max_cache_len >= self.key_slots

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        empty = self._empty_slots()
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        # copied into the same tensors: a compiled graph keeps their static addresses
        self.keys.copy_(keys[..., -self.max_cache_len :, :])
        self.values.copy_(values[..., -self.max_cache_len :, :])
        self.cumulative_length.add_(key_states.shape[-2])
        return keys[..., empty:, :], values[..., empty:, :]

    def _empty_slots(self) -> int:
        """Leading slots handed over that hold no token: none outside torch.compile, where the count
        can be read; under it, every slot is handed over (one shape per step) and the mask drops the
        empty ones."""
        if torch.compiler.is_compiling():
            return 0
        return max(self.max_cache_len - int(self.cumulative_length), 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        empty = self._empty_slots()
        offset = self.cumulative_length - self.max_cache_len + empty  # a tensor under compile: no recompiles
        if not torch.compiler.is_compiling():
            offset = int(offset)
        return self.max_cache_len - empty + query_length, offset

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens: possible while no token was dropped."""
        remove, total = tokens_to_crop(tokens_to_remove), int(self.cumulative_length)
        if remove == 0 or not self.is_initialized:
            return
        if total > self.max_cache_len or remove > total:
            refuse_crop(self, remove, total, f"all but the last {self.max_cache_len} tokens")
        # right-aligned: the kept tokens move to the last slots, the slots before them are empty
        for stored in (self.keys, self.values):
            stored.copy_(stored.roll(remove, dims=-2))
        self.cumulative_length.sub_(remove)


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


# BigBird layers keep every key (random blocks make any earlier block visible to a later query); window +
# global layers have their own class. Registering makes `DynamicCache(config=...)` accept the layer types.
register_cache_layers(global_window_layer=GlobalWindowLayer)


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


def cache_layer(cache: Cache, idx: int):
    """The self-attention cache layer `idx` (of an EncoderDecoderCache's decoder part), or None."""
    layers = getattr(cache, "self_attention_cache", cache).layers
    return layers[idx] if idx < len(layers) else None


def leading_tokens_to_keep(is_global: torch.Tensor, key_valid: torch.Tensor | None, global_tokens: int):
    """How many leading tokens hold every global token (B, S) of every row, or None while some row
    has fewer than `global_tokens` real tokens (its next tokens will be global too)."""
    real = (
        key_valid.sum(-1) if key_valid is not None else torch.full((is_global.shape[0],), is_global.shape[1])
    )
    if int(real.min()) < global_tokens:
        return None
    index = torch.arange(1, is_global.shape[1] + 1, device=is_global.device)
    return int((is_global * index).max()) if is_global.numel() else 0


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

    def key_geometry(self, layer_idx: int, new_tokens: int) -> KeyGeometry:
        """The keys self-attention layer `layer_idx` will hand over once it appended `new_tokens`."""
        if self.cache is None:
            return KeyGeometry(self.past + new_tokens)
        layer = cache_layer(self.cache, layer_idx)
        if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window == 1 and not layer.record_past:
            # transformers' window of 1 keeps every key (`[-0:]`) and hands them all over, unlike what its
            # get_mask_sizes says: read what it holds (swapformer's own caches use SlidingWindowLayer)
            stored = layer.keys.shape[-2] if layer.is_initialized else 0
            return KeyGeometry(stored + new_tokens, layer.cumulative_length - stored)
        length, offset = self.cache.get_mask_sizes(new_tokens, layer_idx)
        return KeyGeometry(length, offset, getattr(layer, "key_prefix", 0))

    def plan_global_window(
        self, layer_indices, window: int, global_tokens: int, is_global, key_valid
    ) -> None:
        """Tell the window + global cache layers among `layer_indices` which leading tokens to keep:
        those holding every global token `is_global` (B, S) marks. Under compile they keep everything
        (`keep=None`): dropping keys is a data-dependent decision, and keeping them is always correct."""
        if self.cache is None:
            return
        found = ((i, cache_layer(self.cache, i)) for i in layer_indices)
        layers = [(i, layer) for i, layer in found if isinstance(layer, GlobalWindowLayer)]
        if not layers:
            return
        keep = None
        if not torch.compiler.is_compiling():
            keep = leading_tokens_to_keep(is_global, key_valid, global_tokens)
        for i, layer in layers:
            layer.plan(window, keep, i)

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

    def cross_keys_values(self, layer_idx: int, project: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
        """Cross-attention layer `layer_idx`'s keys and values: `project()`ed from the encoder output
        once, then kept in the cache and reused at every decoding step."""
        cache = self.cache
        if cache is None:
            return project()
        part = cache.cross_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        if cache.is_updated.get(layer_idx):
            return part.layers[layer_idx].keys, part.layers[layer_idx].values
        key, value = part.update(*project(), layer_idx)
        cache.is_updated[layer_idx] = True
        return key, value
