"""swapformer's own cache layers, which the caches it builds and generate() hold (cache.py:
`fresh_cache`), and the window + global layers' planning before a forward.

Shape legend: B batch, T new tokens, P cached tokens, S keys handed to attention.

Assisted and prompt-lookup decoding verify drafted tokens in one forward, then `crop` the rejected ones
off every layer. A layer that drops keys keeps them all while `record_past` is set (generate() sets it
through `activate_past_recording`), and a crop trims it back to what the next query can see.
"""

from __future__ import annotations

import torch
from transformers import DynamicLayer, StaticLayer

from ..compat.hf_compat import DynamicSlidingWindowLayer, register_cache_layers


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
    swapformer builds get it (cache.fresh_cache); transformers' layer in a cache a user built is read as it
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

    def activate_past_recording(self, **kwargs) -> None:
        """Keep every token until the next `crop` (transformers calls this for assisted decoding). Keywords
        are for other layer kinds (transformers 5.25 passes `recurrent_states_to_keep`, which concerns
        recurrent states; this layer holds keys and values only)."""
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
    (cache.fresh_cache); transformers' layer in a static cache a user built is read as it is.
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


# BigBird layers keep every key (random blocks make any earlier block visible to a later query); window +
# global layers have their own class. Registering makes `DynamicCache(config=...)` accept the layer types.
register_cache_layers(global_window_layer=GlobalWindowLayer)


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


def plan_global_window(view, layer_indices, window: int, global_tokens: int, is_global, key_valid) -> None:
    """Tell the window + global cache layers among `layer_indices` of a forward's cache (a
    `cache.CacheView`) which leading tokens to keep:
    those holding every global token `is_global` (B, S) marks. Under compile they keep everything
    (`keep=None`): dropping keys is a data-dependent decision, and keeping them is always correct."""
    if view.cache is None:
        return
    found = ((i, view.layer(i)) for i in layer_indices)
    layers = [(i, layer) for i, layer in found if isinstance(layer, GlobalWindowLayer)]
    if not layers:
        return
    keep = None
    if not torch.compiler.is_compiling():
        keep = leading_tokens_to_keep(is_global, key_valid, global_tokens)
    for i, layer in layers:
        layer.plan(window, keep, i)
