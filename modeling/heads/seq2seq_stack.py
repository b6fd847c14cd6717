"""The two halves of the encoder-decoder (modeling_seq2seq.py), and the cross-attention cache rule."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Cache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions

from ...configuration.configuration_swapformer import Seq2SeqConfig
from ..attention.packing import PackedSequences
from ..core.stack import StackMixin
from .task_heads import model_output, stack_inputs


def check_cross_attention_cache(cache: EncoderDecoderCache) -> None:
    """Refuse a cross-attention cache with a window layer not yet filled: cross-attention reads every
    encoder key at every step, and transformers builds such layers when the cross-attention part is made
    from a config with sliding decoder layers (`DynamicCache(config=...)`); they would drop encoder keys.
    The caches swapformer builds (generate(), `use_cache=True`) never hold one; a user's is not rebuilt."""
    for i, layer in enumerate(cache.cross_attention_cache.layers):
        if getattr(layer, "is_sliding", False) and not cache.is_updated.get(i):
            raise ValueError(
                f"the cross-attention part of this EncoderDecoderCache has a window layer at layer {i} "
                f"({type(layer).__name__}), which would drop encoder keys that cross-attention reads at every "
                "step; build it without the config: EncoderDecoderCache(DynamicCache(config=model.config), "
                "DynamicCache()), or let the model make its cache (use_cache=True, or generate())"
            )


class Seq2SeqStack(StackMixin, nn.Module):
    """One half of the encoder-decoder. The encoder half is what `get_encoder()` returns."""

    main_input_name = "input_ids"

    def __init__(self, config: Seq2SeqConfig, *, decoder: bool, embed_tokens: nn.Embedding | None):
        super().__init__()
        self.config = config
        self.is_decoder = decoder
        self.init_stack(
            config,
            num_layers=config.decoder_layers if decoder else config.num_hidden_layers,
            causal=decoder,
            cross_attention=decoder,
            layer_types=config.decoder_layer_types if decoder else config.layer_types,
            embed_tokens=embed_tokens,
        )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        return_dict: bool | None = None,
        encoder_packing: PackedSequences | None = None,
        *,
        global_attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
    ):
        """Every input is a named parameter (no `**kwargs`): generate() hands the encoder half the
        model keywords its signature names (all of them, labels too, to a forward with `**kwargs`).
        global_attention_mask, output flags, cu_seq_lens_q, ..., seq_idx: as `BaseModelKwargs`; the
        packed sequences describe this half's input.
        encoder_packing (decoder half): pairs each packed decoder sequence with its encoder sequence."""
        inputs = dict(output_attentions=output_attentions, output_hidden_states=output_hidden_states)
        inputs.update(cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k, seq_idx=seq_idx)
        inputs.update(max_length_q=max_length_q, max_length_k=max_length_k)
        if self.is_decoder and encoder_hidden_states is None:
            raise ValueError("The decoder needs encoder_hidden_states (the encoder's last hidden state)")
        h, hidden, attns, cross = self.forward_stack(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            input_prefix="decoder_" if self.is_decoder else "",
            encoder_packing=encoder_packing,
            **stack_inputs(self, global_attention_mask, inputs),
        )
        if self.is_decoder:
            out = BaseModelOutputWithPastAndCrossAttentions(
                last_hidden_state=h,
                cache=cache,
                hidden_states=hidden,
                attentions=attns,
                cross_attentions=cross,
            )
        else:
            out = BaseModelOutput(last_hidden_state=h, hidden_states=hidden, attentions=attns)
        return model_output(self.config, out, return_dict)


__all__ = ["Seq2SeqStack", "check_cross_attention_cache"]
