"""A key/value cache that stores keys and values as int8: `Int8Cache`.

Shape legend: B batch, K kv heads, S stored tokens, T new tokens, D head dim.

Each cached key (and value) vector of one token and one head gets its own scale: symmetric absmax
quantisation, `x ~= q * scale` with `q` in [-127, 127] and `scale = max|x| / 127` (float32, one per
(B, K, S)). The error of an element is at most `scale / 2 = max|x| / 254`. A token's scale depends on
nothing else, so new tokens are quantised once when appended, the stored ones are never re-quantised,
and a window can drop any token. The new tokens of a forward reach attention at full precision (only
what is read back from the cache is dequantised), so a prompt's forward gives exactly the logits it
gives without a cache. Storage per token and head is D + 4 bytes against 4 D in float32.

transformers' own `QuantizedCache` does not fit (measured with transformers 5.24, optimum-quanto 0.2.7):
its quanto backend accepts only 2 or 4 bits, its HQQ backend needs the `hqq` package, it refuses any
layer type but `full_attention` (swapformer's window and window + global layers included), and
`generate(cache_implementation="quantized")` refuses encoder-decoder models. Its KIVI-style per-channel
groups of tokens also need a full-precision residual of up to `residual_length` tokens, which a
window that drops one token per step cannot use.

Each layer class here is the swapformer or transformers layer class of its layer type with the
storage replaced (`Int8Storage`), so windows, global prefixes and masks behave the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache

from ..compat.hf_compat import DynamicSlidingWindowLayer
from .cache_layers import GlobalWindowLayer, SlidingWindowLayer

QMAX = 127


@dataclass(frozen=True)
class Int8Rows:
    """Keys or values (B, K, S, D) as int8 `data` and one float32 `scale` per vector (B, K, S, 1).
    Before the first update both are empty 1-D tensors (as transformers' `DynamicLayer` starts), which
    `torch.cat` skips."""

    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, x: torch.Tensor) -> Int8Rows:
        if x.dim() != 4:
            if x.numel():
                raise ValueError(
                    f"Int8Rows holds (batch, heads, tokens, head_dim) tensors, got shape {tuple(x.shape)}"
                )
            return cls(torch.empty(0, dtype=torch.int8, device=x.device), torch.empty(0, device=x.device))
        x = x.float()
        # an all-zero vector keeps a non-zero scale (its q is 0 either way)
        scale = x.abs().amax(dim=-1, keepdim=True).div_(QMAX).clamp_(min=torch.finfo(torch.float32).tiny)
        return cls(torch.div(x, scale).round_().clamp_(-QMAX, QMAX).to(torch.int8), scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.data.dim() != 4:
            return torch.empty(0, dtype=dtype, device=self.data.device)
        return (self.data * self.scale).to(dtype)  # int8 * float32 -> float32 in one kernel

    def dequantize_before(self, new: torch.Tensor) -> torch.Tensor:
        """The stored rows dequantised, followed by `new` (B, K, T, D) as given: (B, K, S + T, D)."""
        if self.data.dim() != 4:
            return new
        stored = self.data.shape[-2]
        out = new.new_empty(*new.shape[:-2], stored + new.shape[-2], new.shape[-1])
        if new.dtype == torch.float32:
            torch.mul(self.data, self.scale, out=out[..., :stored, :])
        else:
            out[..., :stored, :] = self.data * self.scale
        out[..., stored:, :] = new
        return out

    @property
    def length(self) -> int:
        return self.data.shape[-2] if self.data.dim() == 4 else 0

    def cat(self, other: Int8Rows) -> Int8Rows:
        return Int8Rows(
            torch.cat([self.data, other.data], dim=-2), torch.cat([self.scale, other.scale], dim=-2)
        )

    def keep(self, prefix: int, start: int) -> Int8Rows:
        """Rows [0, prefix) and [start, S)."""
        if prefix == 0:
            return Int8Rows(self.data[..., start:, :], self.scale[..., start:, :])
        return Int8Rows(
            torch.cat([self.data[..., :prefix, :], self.data[..., start:, :]], dim=-2),
            torch.cat([self.scale[..., :prefix, :], self.scale[..., start:, :]], dim=-2),
        )

    def apply(self, fn) -> Int8Rows:
        """`fn` applied to data and scale alike (batch or token indexing: both share those axes)."""
        return Int8Rows(fn(self.data), fn(self.scale)) if self.data.dim() == 4 else self

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


def _dequantized_view(attribute: str):
    """Getter and setter of a full-precision view of the `Int8Rows` held in `attribute`: reading
    dequantises to the layer's dtype, assigning quantises."""

    def read(layer):
        rows = getattr(layer, attribute)
        return None if rows is None else rows.dequantize(layer.dtype)

    def write(layer, tensor):
        setattr(layer, attribute, None if tensor is None else Int8Rows.quantize(tensor))

    return read, write


class Int8Storage:
    """Mixin over a cache layer class: keys and values are kept as `Int8Rows`.

    `update`, the window bookkeeping and the window layers' `crop` go through `_append` / `_keep` /
    `_stored` (cache_layers.py: StoredRows), which work on the int8 rows directly, so a crop never re-quantises.
    `keys` and `values` stay readable and assignable as full-precision tensors (a read dequantises, an
    assignment quantises), so the base classes' rarer operations (offloading) work unchanged; beam
    reordering and batch selection index the int8 rows."""

    _qkeys: Int8Rows | None = None
    _qvalues: Int8Rows | None = None

    keys = property(*_dequantized_view("_qkeys"))
    values = property(*_dequantized_view("_qvalues"))

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype = key_states.dtype
        super().lazy_initialization(key_states, value_states)

    def _append(self, key_states, value_states):
        """Store the new rows; return every stored row dequantised followed by the new ones as given."""
        keys, values = (
            self._qkeys.dequantize_before(key_states),
            self._qvalues.dequantize_before(value_states),
        )
        self._qkeys = self._qkeys.cat(Int8Rows.quantize(key_states))
        self._qvalues = self._qvalues.cat(Int8Rows.quantize(value_states))
        return keys, values

    def _keep(self, prefix: int, start: int) -> None:
        self._qkeys, self._qvalues = self._qkeys.keep(prefix, start), self._qvalues.keep(prefix, start)

    def _stored(self) -> int:
        return self._qkeys.length if self.is_initialized and self._qkeys is not None else 0

    def _apply(self, fn) -> None:
        if self.is_initialized:
            self._qkeys, self._qvalues = self._qkeys.apply(fn), self._qvalues.apply(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices, ...])

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored keys and values (int8 data and float32 scales)."""
        return sum(rows.nbytes for rows in (self._qkeys, self._qvalues) if rows is not None)


class Int8Layer(Int8Storage, DynamicLayer):
    """`full_attention` and `bigbird_attention` layers: every token is kept."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._append(key_states, value_states)

    def get_seq_length(self) -> int:
        return self._stored()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (assisted decoding), from the int8 rows directly."""
        if tokens_to_remove > 0:
            return super().crop(tokens_to_remove)  # transformers' error for the legacy positive form
        if tokens_to_remove < 0:
            self._apply(lambda t: t[..., :tokens_to_remove, :])


class Int8SlidingWindowLayer(Int8Storage, SlidingWindowLayer):
    """`sliding_attention` layers: the last `sliding_window - 1` tokens are kept (none for a window of 1,
    as `SlidingWindowLayer` does), as transformers' `DynamicSlidingWindowLayer` keeps them; `crop` is
    `SlidingWindowLayer`'s, on the int8 rows."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys, values = self._append(key_states, value_states)
        if self.record_past:  # assisted decoding: kept until `crop`, handed over as transformers does
            visible = self.sliding_window - 1 + key_states.shape[-2]
            return keys[..., -visible:, :], values[..., -visible:, :]
        self._keep(0, max(self._stored() - (self.sliding_window - 1), 0))
        return keys, values


class Int8GlobalWindowLayer(Int8Storage, GlobalWindowLayer):
    """`sliding_global_attention` layers: the leading tokens holding every global token and the window."""


class Int8Cache(Cache):
    """A dynamic cache holding int8 keys and values, one cache layer per decoder layer of `config`.

    Pass it to `generate(..., cache=Int8Cache(model.config))` or to a forward (`cache=`, with
    `use_cache=True`). For an encoder-decoder model use `int8_cache(model.config)`, which pairs one for
    self-attention with one for cross-attention (the encoder's keys and values, also int8). A cache keeps
    the sequence it was filled with: pass a new one to each generate() that starts a new sequence.

    Args:
        config: a swapformer config (or any transformers config with `layer_types`).
        cross_attention: one full layer per decoder layer, for the keys of the encoder's output.

    Raises:
        ValueError: a layer whose fp32 cache layer has no int8 counterpart here.
    """

    def __init__(self, config, *, cross_attention: bool = False):
        # The layer classes of the fp32 cache generate() would build, each swapped for its int8 class
        # (so both always agree on layer types and windows).
        template = DynamicCache(config=config).layers
        if cross_attention:
            layers = [Int8Layer() for _ in template]
        else:
            layers = [self._int8_layer(i, layer) for i, layer in enumerate(template)]
        super().__init__(layers=layers)

    @staticmethod
    def _int8_layer(idx: int, layer):
        # most derived first: swapformer's layers subclass transformers' ones
        if isinstance(layer, GlobalWindowLayer):
            return Int8GlobalWindowLayer()
        if isinstance(layer, DynamicSlidingWindowLayer):
            return Int8SlidingWindowLayer(sliding_window=layer.sliding_window)
        if type(layer) is DynamicLayer:
            return Int8Layer()
        raise ValueError(
            f"Int8Cache has no int8 cache layer for layer {idx}, whose fp32 cache layer is {type(layer).__name__} "
            "(it has them for DynamicLayer, DynamicSlidingWindowLayer and GlobalWindowLayer: full, BigBird, "
            "sliding-window and window + global layers); use a DynamicCache for this model"
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's int8 keys, values and scales."""
        return sum(layer.nbytes for layer in self.layers)


def int8_cache(config) -> Cache:
    """The int8 cache to decode a model of `config` with: an `Int8Cache`, or for an encoder-decoder
    model an `EncoderDecoderCache` of two (self-attention, cross-attention)."""
    if getattr(config, "is_encoder_decoder", False):
        return EncoderDecoderCache(Int8Cache(config), Int8Cache(config, cross_attention=True))
    return Int8Cache(config)
