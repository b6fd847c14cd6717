"""Positions: where each token sits, and the position encodings computed from that.

Shape legend: B batch, T new tokens, P cached tokens, S = P + T keys (or a static cache's slots),
E hidden size, H heads, D head dim.

`Positions.of` finds, once per forward, the query positions (B, T), the key positions (B, S) and the
packed sequences (packing.py); the encodings below turn positions into RoPE angles, sinusoidal
features, ALiBi slopes or T5 buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .checks import refuse_packing_with_custom_mask
from .masks import custom_allowed
from .packing import PackedSequences, find_packed_sequences

# Token positions of a forward ------------------------------------------------------------------------


def positions_from_mask(key_valid: torch.Tensor | None, batch: int, total: int, device) -> torch.Tensor:
    """Integer positions of all S keys, (B, S): counted over non-padding tokens when a padding mask
    is given, so a left-padded row gets the positions of the same row unpadded."""
    if key_valid is None:
        return torch.arange(total, device=device)[None].expand(batch, -1)
    return (key_valid.long().cumsum(-1) - 1).clamp(min=0)


def new_columns(x: torch.Tensor, past, t: int) -> torch.Tensor:
    """Columns past .. past + t - 1 of (B, S) `x`. `past` is a 0-d tensor when a static cache counts
    its tokens under torch.compile; an index keeps that graph free of data-dependent slicing."""
    if isinstance(past, int):
        return x[:, past : past + t]
    return x.index_select(1, past + torch.arange(t, device=x.device))


@dataclass(frozen=True)
class Positions:
    """The positions of one forward of `batch` rows of `length` new tokens after `past` cached ones.

    Attributes:
        span: absolute key indices the per-token inputs cover (past + length, or a static cache's slots).
        key_valid: (B, span) False for padding, or None.
        query: (B, T) position of each new token (the `position_ids`).
        keys: (B, span) position of each key; packed rows restart them per sequence.
        packing: the packed sequences of the new tokens, or None when each row holds one.
        custom: (B, T, span) bool, a 4D attention_mask (True where a new token may attend a key), or None.
            With one there is no padding mask and no packing: the mask says which keys each query sees,
            and positions default to past .. past + T - 1, as LlamaModel's do.
    """

    batch: int
    length: int
    past: int | torch.Tensor
    span: int
    device: torch.device
    key_valid: torch.Tensor | None
    query: torch.Tensor
    keys: torch.Tensor
    packing: PackedSequences | None
    custom: torch.Tensor | None = None

    @classmethod
    def of(cls, *, batch, length, past, span, device, attention_mask, position_ids, packing_inputs, prefix):
        """Packed rows restart their positions, for keys too (ALiBi and T5 distances, global tokens).

        Under torch.compile every row with `position_ids` counts as packed (whether it is would depend
        on the data); generate() passes position_ids at every step of a compiled model."""
        custom = None
        if attention_mask is not None and attention_mask.dim() == 4:
            refuse_packing_with_custom_mask(packing_inputs, prefix)
            custom, attention_mask = custom_allowed(attention_mask, batch), None
        key_valid = attention_mask.bool() if attention_mask is not None else None
        packing = None
        if custom is None:
            packing = find_packed_sequences(
                batch=batch,
                length=length,
                device=device,
                key_valid=new_columns(key_valid, past, length) if key_valid is not None else None,
                position_ids=position_ids,
                past=past,
                prefix=prefix,
                **packing_inputs,
            )
        key_pos = positions_from_mask(key_valid, batch, span, device)  # (B, S)
        if position_ids is None:
            position_ids = (
                new_columns(key_pos, past, length) if packing is None else packing.positions(key_valid)
            )
        else:
            position_ids = position_ids.view(-1, length).expand(batch, length).to(device)
        if (key_valid is None and isinstance(past, int) and past == 0) or packing is not None:
            key_pos = position_ids
        return cls(batch, length, past, span, device, key_valid, position_ids, key_pos, packing, custom)

    @property
    def total(self):
        """Tokens seen after this forward, P + T (a 0-d tensor when `past` is one)."""
        return self.past + self.length


# Rotary (RoPE) ---------------------------------------------------------------------------------------


def rope_frequencies(config, positions: torch.Tensor) -> tuple[torch.Tensor, float | torch.Tensor]:
    """(D/2,) inverse frequencies of `config.rope_parameters`, and the factor cos and sin are scaled by.

    The scaled kinds come from transformers' own `ROPE_INIT_FUNCTIONS`, so they are Llama's, bit for bit.
    "dynamic" (NTK) takes the longest position of this forward (integer positions (B, T)), as Llama's
    rotary embedding does while a sequence grows; it keeps no state between calls, so a batch shorter
    than an earlier one gets its own frequencies back (Llama keeps the longer ones until the length falls
    under `max_position_embeddings`). Computed per forward: no buffer to lose when loading.
    """
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        d = config.head_dim
        exponents = torch.arange(0, d, 2, device=positions.device, dtype=torch.float) / d
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    seq_len = positions.max() + 1 if rope_type == "dynamic" else None
    return ROPE_INIT_FUNCTIONS[rope_type](config, positions.device, seq_len=seq_len)


def rope_cos_sin(positions: torch.Tensor, config, dtype: torch.dtype):
    """cos, sin of shape (B, T, D) for integer positions (B, T); the halves layout of Llama."""
    inv_freq, scale = rope_frequencies(config, positions)
    angles = positions[..., None].float() * inv_freq.float()  # (B, T, D/2)
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, D) by the angles of (B, T, D)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# Absolute (sinusoidal) -------------------------------------------------------------------------------


def sinusoidal_embedding(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Fixed sin/cos position features (Vaswani et al. 2017), (B, T) -> (B, T, E).

    Laid out as [sin | cos] halves (the fairseq/Marian layout), computed on the fly so there is no
    buffer to lose when loading.
    """
    half = dim // 2
    freq = torch.exp(
        torch.arange(half, device=positions.device, dtype=torch.float)
        * -(math.log(10000.0) / max(half - 1, 1))
    )
    angles = positions[..., None].float() * freq
    emb = torch.cat((angles.sin(), angles.cos()), dim=-1)
    if dim % 2:
        emb = nn.functional.pad(emb, (0, 1))
    return emb.to(dtype)


# Score biases (ALiBi, T5) ----------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Head slopes of ALiBi (https://arxiv.org/abs/2108.12409): a geometric sequence starting at
    2^(-8/n) for n a power of two; otherwise the power of two below, then every other slope of the
    next power of two."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    low = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(low)
    if low < num_heads:
        slopes += geometric(2 * low)[0::2][: num_heads - low]
    return torch.tensor(slopes, dtype=torch.float)


def alibi_bias(query_pos: torch.Tensor, key_pos: torch.Tensor, num_heads: int, causal: bool) -> torch.Tensor:
    """Broadcastable query and key positions -> (..., H): -slope * distance (|q - k| when bidirectional)."""
    distance = (query_pos - key_pos).float()
    distance = distance.clamp(min=0) if causal else distance.abs()
    return -distance[..., None] * alibi_slopes(num_heads).to(distance.device)


def relative_position_bucket(
    relative: torch.Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
):
    """T5's bucketing of key - query offsets (https://arxiv.org/abs/1910.10683, section 2.1).

    Offsets below `num_buckets // 2` (per direction) get a bucket each; larger ones share
    logarithmically wider buckets up to `max_distance`, beyond which all share the last bucket.
    Bidirectional attention spends half the buckets on keys after the query.
    """
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)
