"""The blocks every swapformer architecture is made of.

Shape legend: B batch, T query length, S key length, E hidden size, H query heads, K key/value
heads, D head dim.

The encoder, the decoder and both halves of the encoder-decoder are the same `Stack` of the same
`Block`s with two switches: causal self-attention, and cross-attention. A stack computes positions
and masks once per forward; a block projects, applies positions, updates the cache and calls the
attention function registered for `config._attn_implementation`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..configuration.backends import LAYER_TYPE_PATTERN
from ..configuration.configuration_swapformer import GLOBAL_KINDS
from .attention import (
    attention_probabilities,
    attention_weights,
    call_attention,
    eager_attention_forward,
    repeat_kv,
)
from .hf_compat import ACT2FN, ALL_ATTENTION_FUNCTIONS
from .masks import AttentionPattern, KernelMask

# Norms ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm (https://arxiv.org/abs/1910.07467), computed in fp32 like Llama and T5."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(config) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return RMSNorm(config.hidden_size, config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


# MLP -----------------------------------------------------------------------------------------------


# In-place forms of activations whose output may overwrite their input when no gradient is taken.
_IN_PLACE = {
    "gelu": torch.ops.aten.gelu_,
    "relu": torch.relu_,
    "silu": lambda x: nn.functional.silu(x, inplace=True),
}

# Without gradients the MLP runs this many bytes of intermediate activations at a time: glibc hands
# larger blocks out as fresh mappings, so a whole (T, intermediate) activation page-faults and is
# zero-filled by the kernel on every layer (measured: about as long as the GELU itself, and not spread
# over threads); chunks of rows are reused from the heap instead. A model with forward hooks on its
# projections runs the MLP in one plain pass, so hooks see one call with the whole output.
MLP_CHUNK_BYTES = 16 * 2**20


class MLP(nn.Module):
    """up -> act -> down, or act(gate) * up -> down when `mlp_type="gated"` (SwiGLU, GeGLU:
    https://arxiv.org/abs/2002.05202)."""

    def __init__(self, config):
        super().__init__()
        e, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(e, f, bias=bias) if config.mlp_type == "gated" else None
        self.up_proj = nn.Linear(e, f, bias=bias)
        self.down_proj = nn.Linear(f, e, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]
        self.act_in_place = _IN_PLACE.get(config.hidden_act)
        self.dropout = nn.Dropout(config.activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            torch.is_grad_enabled()
            or type(x) is not torch.Tensor
            or torch.compiler.is_compiling()
            or self._hooked()
        ):
            return self._forward(x, self.act_fn)
        act = self.act_in_place or self.act_fn
        rows, width = x.numel() // x.shape[-1], self.up_proj.out_features
        step = max(1, MLP_CHUNK_BYTES // (width * x.element_size()))
        if rows <= step:
            return self._forward(x, act)
        flat = x.reshape(rows, x.shape[-1])
        out = None
        for i in range(0, rows, step):
            part = self._forward(flat[i : i + step], act)
            if out is None:
                out = part.new_empty(rows, part.shape[-1])
            out[i : i + step] = part
        return out.view(*x.shape[:-1], out.shape[-1])

    def _hooked(self) -> bool:
        """Whether a forward hook watches a projection (it might keep an output the in-place activation
        would overwrite, and expects one call per forward): then the MLP runs as one plain pass."""
        hooks = nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        return bool(hooks) or any(
            p is not None and (p._forward_hooks or p._forward_pre_hooks) for p in projections
        )

    def _forward(self, x: torch.Tensor, act) -> torch.Tensor:
        if self.gate_proj is None:
            h = act(self.up_proj(x))
        else:
            h = act(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(self.dropout(h))


# Positions -----------------------------------------------------------------------------------------


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


# Attention -----------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head attention with MHA/GQA/MQA, optional RoPE, KV cache and cross-attention."""

    def __init__(
        self,
        config,
        layer_idx: int,
        *,
        is_causal: bool,
        layer_type: str = "full_attention",
        is_cross_attention: bool = False,
    ):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.is_cross_attention = is_cross_attention
        # The layer type picks the backend under a per-layer mapping; cross-attention follows its block.
        self.layer_type = layer_type
        windowed = layer_type != "full_attention" and not is_cross_attention
        self.sliding_window = config.sliding_window if windowed else None
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = config.effective_attention_scale
        self.attention_dropout = config.attention_dropout
        e, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(e, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)
        self.v_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, e, bias=bias)
        # Longformer's query_global/key_global/value_global: the global tokens' own projections
        # (config.global_projections; bidirectional layers with global tokens only, checked by the config)
        self.global_projections = (
            config.global_projections
            and LAYER_TYPE_PATTERN[layer_type] in GLOBAL_KINDS
            and not is_cross_attention
            and not is_causal
        )
        if self.global_projections:
            self.q_global_proj = nn.Linear(e, self.num_heads * d, bias=bias)
            self.k_global_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)
            self.v_global_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)

    def _project_kv(self, x: torch.Tensor):
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism (config.base_model_tp_plan) each rank holds a share of them
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (B, K, S, D)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        return k, v

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask,
        *,
        pattern: AttentionPattern | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_value_states: torch.Tensor | None = None,
        cache: Cache | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states: (B, T, E).
            attention_mask: the mask lowered for this layer's backend (see masks.py).
            pattern: the pattern it was lowered from, to recompute weights for `output_attentions`.
            rope: (cos, sin), each (B, T, D).
            key_value_states: (B, S, E) encoder output, for cross-attention.
        """
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)

        layer_cache = cache
        if isinstance(cache, EncoderDecoderCache):
            layer_cache = (
                cache.cross_attention_cache if self.is_cross_attention else cache.self_attention_cache
            )
        if self.is_cross_attention:
            # Encoder keys/values are computed once and reused at every decoding step.
            if cache is not None and cache.is_updated.get(self.layer_idx):
                k, v = layer_cache.layers[self.layer_idx].keys, layer_cache.layers[self.layer_idx].values
            else:
                k, v = self._project_kv(key_value_states)
                if cache is not None:
                    k, v = layer_cache.update(k, v, self.layer_idx)
                    cache.is_updated[self.layer_idx] = True
        else:
            k, v = self._project_kv(hidden_states)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if layer_cache is not None:
                k, v = layer_cache.update(k, v, self.layer_idx)

        attention_fn: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        kernel_kwargs = {}
        if isinstance(attention_mask, KernelMask):  # e.g. flash's varlen boundaries of packed rows
            attention_mask, kernel_kwargs = attention_mask.mask, attention_mask.kwargs
        out, weights = call_attention(
            attention_fn,
            self.config.backend_for(self.layer_type),
            pattern.kind if pattern is not None else "full",
            self,
            q,
            k,
            v,
            attention_mask,
            scaling=self.scaling,
            dropout=self.attention_dropout if self.training else 0.0,
            sliding_window=self.sliding_window,
            **kernel_kwargs,
        )
        if output_attentions and weights is None:
            # Fast kernels do not return probabilities: recompute them for this layer only.
            weights = attention_weights(self, q, k, pattern, self.scaling).to(q.dtype)
        if self.global_projections and pattern is not None and pattern.global_queries is not None:
            out, weights = self._global_rows(hidden_states, out, weights, pattern, rope)
        out = self.o_proj(out.reshape(b, t, -1))  # (B, T, E)
        return out, (weights if output_attentions else None)

    def _global_rows(self, hidden_states, out, weights, pattern: AttentionPattern, rope):
        """Replace the rows of the global queries in `out` (B, T, H, D), and in `weights` (B, H, T, S)
        when given, by attention through the global projections (Longformer's global attention).

        Computed here, outside the backend, as a small dense attention of the R gathered global rows
        over all S keys (O(R * S)), with eager's math: the same on every backend. The backend got a
        mask without global query rows (the stack lowers one without them), so it pays nothing for
        rows that are replaced. Under torch.compile every row is computed (R = T): how many rows are
        global depends on the data.
        """
        flags = pattern.global_queries  # (B, T)
        b, t, e = hidden_states.shape
        if torch.compiler.is_compiling():
            rows = torch.arange(t, device=flags.device).expand(b, t)
        else:
            if not bool(flags.any()):
                return out, weights
            count = int(flags.sum(-1).max())
            rows = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True)[:, :count]  # (B, R)
        present = torch.gather(flags, 1, rows)  # (B, R) False where a row has fewer global tokens
        r = rows.shape[1]
        picked = torch.gather(hidden_states, 1, rows[..., None].expand(b, r, e))
        q = self.q_global_proj(picked).view(b, r, -1, self.head_dim).transpose(1, 2)  # (B, H, R, D)
        k = self.k_global_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, K, S, D)
        v = self.v_global_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            pick = lambda x: torch.gather(x, 1, rows[..., None].expand(b, r, x.shape[-1]))  # noqa: E731
            q, k = apply_rope(q, pick(cos), pick(sin)), apply_rope(k, cos, sin)
        mask = pattern.rows_additive(rows, torch.float32)
        mask = mask.masked_fill(~present[:, None, :, None], float("-inf"))  # (B, 1 or H, R, S)
        probs = attention_probabilities(self, q, k, mask, self.scaling).to(q.dtype)  # (B, H, R, S)
        dropped = nn.functional.dropout(probs, p=self.attention_dropout, training=self.training)
        rows_out = torch.matmul(dropped, repeat_kv(v, self.num_key_value_groups))  # (B, H, R, D)
        rows_out = rows_out.transpose(1, 2)
        index = rows[:, :, None, None].expand(b, r, *out.shape[2:])
        keep = present[:, :, None, None]
        out = out.scatter(1, index, torch.where(keep, rows_out, torch.gather(out, 1, index)))
        if weights is not None:
            index = rows[:, None, :, None].expand(b, weights.shape[1], r, weights.shape[-1])
            new = torch.where(keep.transpose(1, 2), probs.to(weights.dtype), torch.gather(weights, 2, index))
            weights = weights.scatter(2, index, new)
        return out, weights


# Block ---------------------------------------------------------------------------------------------


class Block(GradientCheckpointingLayer):
    """Self-attention, optional cross-attention, MLP; each a residual branch, pre- or post-norm."""

    def __init__(
        self,
        config,
        layer_idx: int,
        *,
        is_causal: bool,
        cross_attention: bool,
        layer_type: str = "full_attention",
    ):
        super().__init__()
        self.pre_norm = config.pre_norm
        self.layer_type = layer_type
        self.self_attn = Attention(config, layer_idx, is_causal=is_causal, layer_type=layer_type)
        self.self_attn_norm = make_norm(config)
        self.cross_attn = (
            Attention(config, layer_idx, is_causal=False, layer_type=layer_type, is_cross_attention=True)
            if cross_attention
            else None
        )
        self.cross_attn_norm = make_norm(config) if cross_attention else None
        self.mlp = MLP(config)
        self.mlp_norm = make_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def _residual(self, h, norm, branch):
        """h + branch(norm(h)) when pre-norm, norm(h + branch(h)) when post-norm."""
        if self.pre_norm:
            out, weights = branch(norm(h))
            return h + self.dropout(out), weights
        out, weights = branch(h)
        return norm(h + self.dropout(out)), weights

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask=None,
        pattern: AttentionPattern | None = None,
        cross_pattern: AttentionPattern | None = None,
        cache: Cache | None = None,
        output_attentions: bool = False,
    ):
        h, self_weights = self._residual(
            hidden_states,
            self.self_attn_norm,
            lambda x: self.self_attn(
                x,
                attention_mask,
                pattern=pattern,
                rope=rope,
                cache=cache,
                output_attentions=output_attentions,
            ),
        )
        cross_weights = None
        if self.cross_attn is not None:
            h, cross_weights = self._residual(
                h,
                self.cross_attn_norm,
                lambda x: self.cross_attn(
                    x,
                    encoder_attention_mask,
                    pattern=cross_pattern,
                    key_value_states=encoder_hidden_states,
                    cache=cache,
                    output_attentions=output_attentions,
                ),
            )
        h, _ = self._residual(h, self.mlp_norm, lambda x: (self.mlp(x), None))
        return h, self_weights, cross_weights
