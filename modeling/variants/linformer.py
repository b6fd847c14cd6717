"""Linformer: keys and values projected along the sequence axis (Wang et al. 2020,
https://arxiv.org/abs/2006.04768).

Shape legend: B batch, T tokens (= keys: encoders only), K key/value heads, D head dim,
N max_position_embeddings, R linformer_k projected rows, L layers.

K' = E K and V' = F V with E, F of shape (R, N); a sequence of T <= N tokens uses the first T columns
of E and F. The attention function of the layer's backend then runs dense over the R projected rows
without a mask: softmax(Q K'^T * scale) V' costs O(T * R) time and memory instead of O(T^2).

Padding: padded keys and values are zeroed before the projection, so they add nothing to K' and V'. A
right-padded row therefore gives what the row alone gives; a left-padded row's tokens meet later columns
of E and F (they sit at later indices), as in Linformer's fixed-length formulation.

The projections of a stack live in one parameter (`LinformerProjections.weight`, (sets, R, N)), reached
by each layer through its `LayerPlan`; which set a layer reads for keys and for values is
`config.linformer_sharing`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.functions import attention_probabilities
from ..compat.hf_compat import init
from ..core.layers import Attention


class LinformerProjections(nn.Module):
    """Every E and F of a stack: (1, R, N) "layerwise", (L, R, N) "key_value", (2L, R, N) "headwise"
    (rows 2i and 2i + 1 are layer i's E and F)."""

    def __init__(self, config, num_layers: int):
        super().__init__()
        sets = {"layerwise": 1, "key_value": num_layers, "headwise": 2 * num_layers}[config.linformer_sharing]
        self.sharing = config.linformer_sharing
        self.weight = nn.Parameter(torch.empty(sets, config.linformer_k, config.max_position_embeddings))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # std N ** -0.5: a projected row of a full-length sequence has the variance of one key (the
        # paper leaves the initialisation open; fairseq's Linformer uses a scaled Xavier init)
        init.normal_(self.weight, mean=0.0, std=self.weight.shape[-1] ** -0.5)

    def matrices(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s (E, F), each (R, N)."""
        if self.sharing == "layerwise":
            return self.weight[0], self.weight[0]
        if self.sharing == "key_value":
            return self.weight[layer_idx], self.weight[layer_idx]
        return self.weight[2 * layer_idx], self.weight[2 * layer_idx + 1]

    def project(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, pattern):
        """(B, K, T, D) keys and values -> (B, K, R, D) projected ones.

        Args:
            pattern: the layer's `AttentionPattern`: its `key_valid` (B, T) marks real tokens (None: no
                padding); packed rows are refused (E and F would mix their sequences).

        Raises:
            ValueError: T > N, or packed sequences in the batch.
        """
        t, n = key.shape[2], self.weight.shape[-1]
        if t > n:
            raise ValueError(
                f"Linformer projects at most max_position_embeddings={n} tokens (E and F have {n} columns), got "
                f"{t}; shorten the input, or build the model with a larger max_position_embeddings"
            )
        if pattern.query_packing is not None:
            raise ValueError(
                "Linformer cannot keep packed sequences apart: E and F mix every position of a row into each "
                "projected key and value. Give one sequence per row (train without --packing, no restarting "
                "position_ids or cu_seq_lens_*), or use linformer_k=None"
            )
        if pattern.key_valid is not None:
            keep = pattern.key_valid[:, None, :, None].to(key.dtype)  # (B, 1, T, 1)
            key, value = key * keep, value * keep
        e, f = self.matrices(layer_idx)
        e, f = e[:, :t].to(key.dtype), f[:, :t].to(value.dtype)
        return torch.matmul(e, key), torch.matmul(f, value)  # (R, T) @ (B, K, T, D) -> (B, K, R, D)


class LinformerAttention(Attention):
    """Self-attention over keys and values projected by the stack's E and F (`plan.linformer`), after
    the cache and before the backend, which attends to the projected rows without a mask."""

    def attend(self, hidden_states, q, k, v, attention_mask, plan, output_attentions: bool):
        k, v = plan.linformer.project(self.layer_idx, k, v, plan.pattern)  # (B, K, linformer_k, D)
        out, weights = super().attend(hidden_states, q, k, v, attention_mask, plan, False)
        if output_attentions and weights is None:  # over the projected rows
            weights = attention_probabilities(self, q, k, None, self.scaling).to(q.dtype)
        return out, weights
