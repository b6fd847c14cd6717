"""Multi-head latent attention (MLA: DeepSeek-V2, https://arxiv.org/abs/2405.04434, and V3), the
self-attention of a `DecoderConfig` with `kv_lora_rank` set.

Shape legend: B batch, H heads, T new tokens, S keys, E hidden size, R `kv_lora_rank`, N
`qk_nope_head_dim`, P `qk_rope_head_dim`, V `v_head_dim`.

Each token's keys and values come from one latent c (B, T, R), RMS-normed, plus one RoPE key (B, T, P)
shared by every head: head h's key is [W_uk[h] c, k_rope] and its value W_uv[h] c (`kv_b_proj` holds
W_uk and W_uv). The cache keeps c and k_rope only, as a one-head key (B, 1, S, R) and value
(B, 1, S, P) of transformers' cache layers (the layout of transformers' DeepseekV3 too): R + P numbers
per token and layer, against 2 * K * D for MHA/GQA.

Two ways to attend over the cached latents, equal up to rounding:
- decompressed (prefill, and `mla_decode="decompressed"`): up-project every cached latent to per-head
  keys (N + P wide) and values (V wide) and call the layer's backend like any attention;
- absorbed (decoding with a cache): q_nope . W_uk[h] c = (W_uk[h]^T q_nope) . c, so the query is moved
  into the latent space once and scored against c directly; the weighted sum of the c's is
  up-projected by W_uv[h] once per query. A step reads the latent cache only, never per-head keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..core.layers import AttentionBase, RMSNorm, project
from ..core.positions import apply_rope

if TYPE_CHECKING:
    from ..core.plan import LayerPlan

# DeepSeek's RMSNorms on the latents use this epsilon whatever the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE on (B, heads, T, P). Interleaved pairs (x0, x1), (x2, x3), ... are first laid out as halves
    [x0, x2, ... | x1, x3, ...]; queries and keys get the same layout, so their products are unchanged."""
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rope(x, cos, sin)


class LatentAttention(AttentionBase):
    """MLA self-attention; the parameter names are those of transformers' DeepseekV3Attention."""

    is_cross_attention = False

    def __init__(self, config, layer_idx: int, *, is_causal: bool, layer_type: str = "full_attention"):
        super().__init__(config, layer_idx, is_causal=is_causal, layer_type=layer_type, windowed=False)
        h, e = config.num_attention_heads, config.hidden_size
        # the backends see per-head keys and values (decompressed): no grouping
        self.num_key_value_heads, self.num_key_value_groups = h, 1
        self.rank, self.nope, self.rope_dim = (
            config.kv_lora_rank,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
        )
        self.v_dim = config.v_head_dim
        self.head_dim = self.nope + self.rope_dim
        bias = config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(e, h * self.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(e, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(e, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, e, bias=bias)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.q_lora_rank is None:
            q = project(self.q_proj, x)
        else:
            q = project(self.q_b_proj, self.q_a_layernorm(project(self.q_a_proj, x)))
        b, t, _ = x.shape
        return q.view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, N + P)

    def latents(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached form of tokens `x` (B, T, E): latents (B, 1, T, R) and rotated RoPE keys (B, 1, T, P)."""
        latent, k_rope = project(self.kv_a_proj_with_mqa, x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]
        return latent, rotate(k_rope[:, None], *rope, self.config.rope_interleave)

    def decompress(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys (B, H, S, N + P) and values (B, H, S, V) of cached latents (B, 1, S, R), (B, 1, S, P)."""
        b, _, s, _ = latent.shape
        kv = project(self.kv_b_proj, latent[:, 0]).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        return k, v

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk (H, N, R) and W_uv (H, V, R), the views of `kv_b_proj` the absorbed form multiplies by."""
        w = self.kv_b_proj.weight.view(-1, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def absorbed(self, q, latent, k_rope, pattern, dropout: float):
        """Attention straight from the latent cache. q (B, H, T, N + P) rotated; latent (B, 1, S, R),
        k_rope (B, 1, S, P). Returns out (B, T, H, V) and probabilities (B, H, T, S)."""
        b, h, t, _ = q.shape
        w_uk, w_uv = self.up_weights()
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # the key up-projection, folded in
        # heads and queries as rows of one matrix, against the S latents and RoPE keys: (B, H*T, S)
        scores = q_latent.reshape(b, h * t, -1) @ latent[:, 0].transpose(1, 2)
        scores = scores + q_rope.reshape(b, h * t, -1) @ k_rope[:, 0].transpose(1, 2)
        scores = scores.view(b, h, t, -1).float() * self.scaling + pattern.additive(torch.float32)
        finite = torch.finfo(torch.float32).min
        has_key = scores.amax(dim=-1, keepdim=True) > finite  # fully masked rows give zeros
        probs = (torch.softmax(scores.clamp(min=finite), dim=-1) * has_key).to(q.dtype)
        mixed = nn.functional.dropout(probs, p=dropout, training=self.training)
        out_latent = (mixed.view(b, h * t, -1) @ latent[:, 0]).view(b, h, t, -1)  # (B, H, T, R)
        out = torch.einsum("bhtr,hvr->bthv", out_latent, w_uv)  # the value up-projection, folded out
        return out, probs

    def uses_absorbed(self, plan: LayerPlan) -> bool:
        """Absorbed when decoding after cached tokens (`mla_decode="absorbed"`); prefill decompresses."""
        cache = plan.cache
        if self.config.mla_decode != "absorbed" or cache.cache is None:
            return False
        return not isinstance(cache.past, int) or cache.past > 0

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask,
        *,
        plan: LayerPlan,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `Attention.forward` (layers.py); self-attention only."""
        b, t, _ = hidden_states.shape
        q = self._query(hidden_states)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q = torch.cat((q_nope, rotate(q_rope, *plan.rope, self.config.rope_interleave)), dim=-1)
        latent, k_rope = self.latents(hidden_states, plan.rope)
        latent, k_rope = plan.cache.append(latent, k_rope, self.layer_idx)
        dropout = self.attention_dropout if self.training else 0.0
        if self.uses_absorbed(plan):
            out, weights = self.absorbed(q, latent, k_rope, plan.pattern, dropout)
        else:
            k, v = self.decompress(latent, k_rope)
            out, weights = super().attend(hidden_states, q, k, v, attention_mask, plan, output_attentions)
        out = project(self.o_proj, out.reshape(b, t, -1))  # (B, T, E)
        return out, (weights if output_attentions else None)
