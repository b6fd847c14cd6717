"""Cross-attention: the decoder's queries over the encoder's output, for the decoder half of an
encoder-decoder (chosen by the stack when it is built, `stack.init_stack(cross_attention=True)`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import EncoderDecoderCache

from ..core.layers import Attention, project

if TYPE_CHECKING:
    from ..core.plan import LayerPlan


class CrossAttention(Attention):
    """Attention of the decoder's queries over the encoder's output (kept in the cache once made)."""

    is_cross_attention = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask,
        *,
        plan: LayerPlan,
        key_value_states: torch.Tensor,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `Attention.forward`, keys and values from `key_value_states` (B, S, E), no positions."""
        b, t, _ = hidden_states.shape
        q = self.heads(self.q_proj, hidden_states)  # (B, H, T, D)
        k, v = self.encoder_keys_values(plan.cache.cache, key_value_states)
        out, weights = self.attend(hidden_states, q, k, v, attention_mask, plan, output_attentions)
        out = project(self.o_proj, out.reshape(b, t, -1))  # (B, T, E)
        return out, (weights if output_attentions else None)

    def encoder_keys_values(self, cache, key_value_states: torch.Tensor):
        """This layer's keys and values of the encoder output: projected once, then kept in `cache` (an
        `EncoderDecoderCache`, or None) and reused at every decoding step."""
        if cache is None:
            return self.project_kv(key_value_states)
        part = cache.cross_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        if cache.is_updated.get(self.layer_idx):
            return part.layers[self.layer_idx].keys, part.layers[self.layer_idx].values
        key, value = part.update(*self.project_kv(key_value_states), self.layer_idx)
        cache.is_updated[self.layer_idx] = True
        return key, value
