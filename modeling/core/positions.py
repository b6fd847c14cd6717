"""Position encodings: RoPE angles, sinusoidal features, ALiBi slopes and T5 buckets, computed from
the positions a forward's inputs have (inputs.py: `Positions`).

Shape legend: B batch, T new tokens, S keys, E hidden size, H heads, D head dim, R rotated dims.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Rotary (RoPE) ---------------------------------------------------------------------------------------


def rotary_dim(config) -> int:
    """R, the dims of each head that rotate: int(head_dim * partial_rotary_factor), as transformers
    counts them (StableLM, Phi, GPT-NeoX rotate a part; the config checks that R is even and > 0)."""
    return int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))


class RotaryEmbedding(nn.Module):
    """The RoPE frequencies of `config.rope_parameters` and the (cos, sin) pair of a forward's positions,
    laid out as transformers' rotary embeddings (`LlamaRotaryEmbedding`): one module per stack
    (`rotary_emb`), non-persistent buffers `inv_freq` (R/2,) and `original_inv_freq`, `attention_scaling`.
    The scaled kinds come from transformers' `ROPE_INIT_FUNCTIONS`, so they are Llama's bit for bit.

    Dynamic NTK follows transformers' `dynamic_rope_update`: the frequencies of the longest forward since
    the last reset, which a forward under `max_position_embeddings` brings back to the original ones. The
    longest length is a tensor buffer (`max_seq_len_cached`) so a compiled forward updates it in place.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        self.original_max_seq_len = config.max_position_embeddings
        # resolved once here: the dynamic update calls it inside the forward, where torch.compile traces
        self.init_fn = self._init_function()
        inv_freq, self.attention_scaling = self.init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.register_buffer("max_seq_len_cached", torch.tensor(self.original_max_seq_len), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, device=None, seq_len=None) -> tuple[torch.Tensor, float]:
        """Unscaled RoPE (transformers' models define it themselves, as here): theta^(-2i/R), i < R/2."""
        dim = rotary_dim(config)
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
        return 1.0 / (config.rope_parameters["rope_theta"] ** exponents), 1.0

    def _init_function(self):
        if self.rope_type == "default":
            return self.compute_default_rope_parameters
        # imported here: hf_compat imports the attention functions, which import this module
        from ..compat.hf_compat import rope_init_functions

        return rope_init_functions()[self.rope_type]

    @torch.no_grad()
    def reset_frequencies(self) -> None:
        """Fill the buffers from the config: loading leaves non-persistent buffers uninitialised
        (`_init_weights` calls this), and a cast to another dtype would round them (`_apply`)."""
        device = self.inv_freq.device
        self.inv_freq = self.init_fn(self.config, device)[0]
        self.original_inv_freq = self.inv_freq.clone()
        self.max_seq_len_cached = torch.tensor(self.original_max_seq_len, device=device)

    def _apply(self, fn, recurse=True):
        # `model.half()` / `.to(torch.bfloat16)` cast floating buffers: positions times rounded frequencies
        # drift by whole turns on long inputs, so the frequencies are computed again in fp32 instead.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.reset_frequencies()
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, T, R) in `dtype` for integer positions (B, T), Llama's halves layout. Takes the
        dtype rather than Llama's `x`: the forward's plan is built from the embedded inputs' dtype."""
        if self.rope_type == "dynamic":
            self._dynamic_update(position_ids)
        angles = self.angles(position_ids)
        scale = self.attention_scaling
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)

    def angles(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The rotation angles (..., R) of integer positions (...), without `attention_scaling`."""
        inv_freq = self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        angles = position_ids[..., None].float() * inv_freq
        return torch.cat((angles, angles), dim=-1)

    @torch.no_grad()
    def _dynamic_update(self, position_ids: torch.Tensor) -> None:
        """transformers' rule without its branches on tensors: grow to a longer forward, keep the longest for
        a shorter one, back to max_position_embeddings (the original frequencies) for a forward under it."""
        seq_len = position_ids.max() + 1
        longest = torch.where(
            seq_len < self.original_max_seq_len,
            self.original_max_seq_len,
            torch.maximum(self.max_seq_len_cached.to(seq_len.device), seq_len),
        )
        inv_freq, _ = self.init_fn(self.config, position_ids.device, seq_len=longest)
        self.inv_freq.copy_(inv_freq)
        self.max_seq_len_cached.copy_(longest)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, D) by the angles of (B, T, R): the first R dims of each head in Llama's halves
    layout, the other D - R unchanged (partial rotary, StableLM's layout)."""
    cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    part = x[..., :r]
    rotated = torch.cat((-part[..., r // 2 :], part[..., : r // 2]), dim=-1)
    out = part * cos + rotated * sin
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)


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


def pair_bias(config, causal: bool, relative_attention_bias, query_pos, key_pos) -> torch.Tensor:
    """Additive score bias (..., H) for broadcastable query and key positions: ALiBi's, or T5's trained
    bias per bucket (`relative_attention_bias`, an embedding of buckets x heads)."""
    if config.position_embedding_type == "alibi":
        return alibi_bias(query_pos, key_pos, config.num_attention_heads, causal)
    buckets = relative_position_bucket(
        key_pos - query_pos,
        bidirectional=not causal,
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
    )
    return relative_attention_bias(buckets)
