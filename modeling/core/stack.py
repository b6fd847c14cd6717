"""A stack of blocks, from token ids to the last hidden state.

Shape legend: B batch, T new tokens, P cached tokens, S = P + T keys, E hidden size, H heads.

The base encoder and decoder models and both halves of the encoder-decoder are this one stack with
two switches (causal self-attention, cross-attention). It is a mixin so the base models keep their
parameters at HF-standard names (`embed_tokens`, `layers.0.self_attn.q_proj`) without a wrapper
level. A forward checks the inputs and finds their positions (inputs.py), embeds them,
makes the forward's plan (plan.py: patterns, backends, masks, cache geometry) and runs the blocks,
each with its layer type's `LayerPlan`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import Cache
from transformers.utils import logging

from ..attention.packing import PackedSequences
from ..caches.cache import CacheView
from ..variants.attention_choice import attention_class
from ..variants.cross_attention import CrossAttention
from ..variants.linformer import LinformerProjections
from .inputs import checked_positions
from .layers import Block, make_norm
from .plan import ForwardPlan
from .positions import RotaryEmbedding, pair_bias, sinusoidal_embedding

logger = logging.get_logger(__name__)


class StackMixin:
    """Mixed into an `nn.Module` whose `config` is a `SwapformerConfig`."""

    def init_stack(
        self,
        config,
        *,
        num_layers: int,
        causal: bool,
        cross_attention: bool,
        layer_types: list[str],
        embed_tokens: nn.Embedding | None = None,
        token_types: bool = False,
    ) -> None:
        self.causal = causal
        self.layer_types = list(layer_types)
        self.embed_tokens = (
            embed_tokens if embed_tokens is not None else nn.Embedding(config.vocab_size, config.hidden_size)
        )
        self.embed_scale = config.hidden_size**0.5 if config.scale_embeddings else 1.0
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size)
            if token_types and config.type_vocab_size > 0
            else None
        )
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned"
            else None
        )
        self.relative_attention_bias = (
            nn.Embedding(config.relative_attention_num_buckets, config.num_attention_heads)
            if config.position_embedding_type == "relative_bias"
            else None
        )
        self.embed_norm = make_norm(config) if config.embedding_norm else None
        p = config.hidden_dropout if config.embedding_dropout is None else config.embedding_dropout
        self.embed_dropout = nn.Dropout(p)
        self.layers = nn.ModuleList(
            [
                Block(
                    config,
                    i,
                    is_causal=causal,
                    cross_attention=CrossAttention if cross_attention else None,
                    layer_type=layer_types[i],
                    attention=attention_class(config, layer_types[i], causal),
                )
                for i in range(num_layers)
            ]
        )
        self.norm = make_norm(config) if config.pre_norm else None
        # the RoPE frequencies, where transformers' models keep them; the plan asks it for (cos, sin) once
        # per forward
        self.rotary_emb = RotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        # Linformer's E and F (the config allows linformer_k on bidirectional stacks only)
        self.linformer = (
            LinformerProjections(config, num_layers)
            if getattr(config, "linformer_k", None) is not None and not causal
            else None
        )

    # Embeddings and the position bias ---------------------------------------------------------

    def embed(self, input_ids, inputs_embeds, token_type_ids, position_ids) -> torch.Tensor:
        # Like transformers, user-given inputs_embeds replace the (scaled) token embedding.
        h = self.embed_tokens(input_ids) * self.embed_scale if inputs_embeds is None else inputs_embeds
        if token_type_ids is not None:
            if self.token_type_embeddings is None:
                if not torch.compiler.is_compiling() and bool(token_type_ids.any()):
                    raise ValueError(
                        "token_type_ids has non-zero entries but this model has no token type embeddings "
                        "(type_vocab_size=0); drop token_type_ids or build the model with type_vocab_size > 0"
                    )
            else:
                h = h + self.token_type_embeddings(token_type_ids)
        elif self.token_type_embeddings is not None:
            h = h + self.token_type_embeddings.weight[0]
        if self.embed_positions is not None:
            h = h + self.embed_positions(position_ids)
        elif self.config.position_embedding_type == "sinusoidal":
            h = h + sinusoidal_embedding(position_ids, self.config.hidden_size, h.dtype)
        if self.config.embedding_dropout_first:  # BigBird
            h = self.embed_dropout(h)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        return h if self.config.embedding_dropout_first else self.embed_dropout(h)

    def pair_bias(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Additive score bias (..., H) for broadcastable query and key positions (ALiBi, T5)."""
        return pair_bias(self.config, self.causal, self.relative_attention_bias, query_pos, key_pos)

    # Forward ------------------------------------------------------------------------------------

    def forward_stack(
        self,
        *,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        input_prefix: str = "",
        packing_inputs: dict | None = None,
        encoder_packing: PackedSequences | None = None,
    ):
        """Check the inputs, find their positions, embed them, make the forward's plan, run the blocks.

        Args:
            input_ids: (B, T) token ids, or `inputs_embeds` (B, T, E).
            attention_mask: (B, P + T), 1 for tokens and 0 for padding; or a 4D mask (B or 1, 1, T, P + T),
                bool (True = attend) or float (0 = attend, <= -1e4 = masked), as masks.py applies it.
            position_ids: (B, T) or (1, T); by default counted over non-padding tokens.
            global_attention_mask: (B, P + T), 1 for tokens that attend to all and are attended by
                all in `sliding_global_attention` and `bigbird_attention` layers.
            encoder_hidden_states: (B, S_enc, E) for cross-attention, with its padding mask
                `encoder_attention_mask` (B, S_enc).
            input_prefix: "decoder_" when this is the decoder half of a seq2seq (for error messages).
            packing_inputs: the forward's cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k and
                seq_idx (`packing.packing_kwargs`): packed-sequence boundaries as
                `DataCollatorWithFlattening` gives them, checked against `position_ids` (restarting
                `position_ids` alone mark packed sequences too).
            encoder_packing: the packed sequences of the encoder input, for cross-attention.
        Returns:
            (last hidden state, all hidden states, self- and cross-attention weights; None unless asked).
        """
        cache = CacheView.of(self.cache_unless_checkpointing(cache))
        positions, global_mask = checked_positions(
            self.config,
            cache,
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            global_attention_mask=global_attention_mask,
            packing_inputs=packing_inputs or {},
            prefix=input_prefix,
        )
        h = self.embed(input_ids, inputs_embeds, token_type_ids, positions.query)
        plan = ForwardPlan.build(
            self,
            positions,
            cache,
            h.dtype,
            global_mask=global_mask,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            encoder_packing=encoder_packing,
        )
        return self.run_layers(h, plan, encoder_hidden_states, output_attentions, output_hidden_states)

    def run_layers(
        self, h, plan: ForwardPlan, encoder_hidden_states, output_attentions, output_hidden_states
    ):
        """The blocks, the final norm; (last hidden state, all hidden states, self- and cross-attention
        weights), the last three None unless asked for."""
        all_hidden = [] if output_hidden_states else None
        self_attns = [] if output_attentions else None
        cross_attns = [] if output_attentions and encoder_hidden_states is not None else None
        for block in self.layers:
            if all_hidden is not None:
                all_hidden.append(h)
            lt = block.layer_type
            # The masks go positionally: a trained position bias (T5) is in them, and reentrant
            # activation checkpointing tracks the gradients of positional tensors only.
            h, self_w, cross_w = block(
                h,
                plan.masks[lt],
                encoder_hidden_states,
                plan.cross_masks.get(lt),
                plan=plan.layers[lt],
                cross_plan=plan.cross.get(lt),
                output_attentions=output_attentions,
            )
            if self_attns is not None:
                self_attns.append(self_w)
            if cross_attns is not None:
                cross_attns.append(cross_w)
        if self.norm is not None:
            h = self.norm(h)
        if self.config.final_dropout:  # T5 drops out the normed output of each stack
            h = nn.functional.dropout(h, self.config.hidden_dropout, self.training)
        if all_hidden is not None:
            all_hidden.append(h)
        as_tuple = lambda xs: tuple(xs) if xs is not None else None  # noqa: E731
        return h, as_tuple(all_hidden), as_tuple(self_attns), as_tuple(cross_attns)

    def cache_unless_checkpointing(self, cache: Cache | None) -> Cache | None:
        """`cache`, or None (with transformers' warning) while activation checkpointing trains: a
        recomputed block would write it twice. (transformers' `GradientCheckpointingLayer` drops a
        layer's `cache` argument for the same reason; blocks here reach the cache through their plan.)"""
        if cache is None or not (self.training and torch.is_grad_enabled()):
            return cache
        if not any(block.gradient_checkpointing for block in self.layers):
            return cache
        logger.warning_once(
            "Caching is incompatible with gradient checkpointing in Block. Setting `cache=None`."
        )
        return None


# What a stack's output becomes ---------------------------------------------------------------------


def model_output(config, output, return_dict: bool | None):
    """The ModelOutput, or its tuple (None fields dropped, loss first) when return_dict is False."""
    return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()


def keep_positions(h: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of h (B, T, E) that need logits, by transformers' rule (`slice_logits_to_keep`):
    an int N keeps the last N (0: all); a 1-D tensor indexes positions of every row; a 2-D integer
    tensor (B, N) positions per row; a 2-D bool mask (B, T) the True positions, flattened to (n, E)."""
    if isinstance(logits_to_keep, int):
        return h[:, -logits_to_keep:] if logits_to_keep else h
    if logits_to_keep.dim() == 2:
        if logits_to_keep.dtype == torch.bool:
            return h[logits_to_keep.to(h.device)]
        return torch.take_along_dim(h, logits_to_keep.to(h.device)[..., None], dim=1)
    return h[:, logits_to_keep]


class TaskHead:
    """Mixin of the task heads: `run_head` runs the base model and the head's `head_outputs`.

    A head sets `output_class` (transformers' ModelOutput of its task) and writes
    `head_outputs(self, out, ...) -> dict`: its own fields (loss, logits, ...) from the base model's
    output `out` and the head inputs its forward passes on. Every other field of `output_class`
    (cache, hidden states, attentions) is taken from `out`."""

    output_class: ClassVar[type]
    accepts_loss_kwargs: ClassVar[bool]

    def run_head(self, base_args: tuple, base_kwargs: dict, return_dict: bool | None, **head_inputs):
        """base_args, base_kwargs: the base model's inputs; head_inputs: `head_outputs`'s arguments."""
        count = base_kwargs.pop("num_items_in_batch", None)
        if count is not None:
            if not self.accepts_loss_kwargs:
                raise TypeError(
                    f"{type(self).__name__}.forward() got num_items_in_batch={count}, but its loss is a mean "
                    "over sequences (accepts_loss_kwargs=False): drop the argument"
                )
            head_inputs["num_items_in_batch"] = count
        out = self.model(*base_args, return_dict=True, **base_kwargs)
        fields = self.head_outputs(out, **head_inputs)
        carried = {
            k: v for k, v in out.items() if k in self.output_class.__dataclass_fields__ and k not in fields
        }
        return model_output(self.config, self.output_class(**carried, **fields), return_dict)
