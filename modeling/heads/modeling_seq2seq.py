"""The encoder-decoder (T5, BART-like): a bidirectional encoder stack and a causal decoder stack with
cross-attention, sharing one token embedding by default."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput
from typing_extensions import Unpack

from ...configuration.configuration_swapformer import Seq2SeqConfig
from ..attention.packing import find_packed_sequences
from ..caches.cache import dynamic_cache
from ..compat.hf_compat import init
from ..core.layers import project
from .generation import SwapformerGenerationMixin
from .losses import check_label_ids, token_cross_entropy
from .modeling_base import SwapformerPreTrainedModel
from .seq2seq_stack import Seq2SeqStack, check_cross_attention_cache
from .task_heads import (
    PACKING_INPUTS,
    BaseModelKwargs,
    HeadKwargs,
    TaskHead,
    cache_argument,
    check_base_inputs,
    keep_positions,
    model_output,
    use_cache_unless_checkpointing,
)


def shift_tokens_right(
    labels: torch.Tensor, pad_token_id: int | None, decoder_start_token_id: int | None
) -> torch.Tensor:
    """Decoder inputs from labels: [start, y0, ..., y_{n-2}], with -100 replaced by the pad id."""
    if decoder_start_token_id is None or pad_token_id is None:
        raise ValueError(
            f"Making decoder inputs from labels needs decoder_start_token_id and pad_token_id in the config, got "
            f"decoder_start_token_id={decoder_start_token_id}, pad_token_id={pad_token_id}; set them or pass decoder_input_ids"
        )
    shifted = labels.new_full(labels.shape, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad_token_id)


class Seq2SeqPreTrainedModel(SwapformerPreTrainedModel):
    config_class = Seq2SeqConfig

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """Also resizes the decoder's own embedding when `shared_embeddings=False`, and the LM's
        `final_logits_bias` (new tokens get 0, as in BART)."""
        base = self.model if isinstance(self, Seq2SeqForConditionalGeneration) else self
        if new_num_tokens is not None and base.shared is None:
            base.decoder.embed_tokens = self._get_resized_embeddings(
                base.decoder.embed_tokens, new_num_tokens, pad_to_multiple_of, mean_resizing
            )
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        bias = getattr(self, "final_logits_bias", None)
        if bias is not None and bias.shape[-1] != embeddings.num_embeddings:
            n = embeddings.num_embeddings
            resized = bias.new_zeros(1, n)
            resized[:, : min(n, bias.shape[-1])] = bias[:, :n]
            self.final_logits_bias = resized
        return embeddings


class Seq2SeqModel(Seq2SeqPreTrainedModel):
    def __init__(self, config: Seq2SeqConfig):
        super().__init__(config)
        if config.shared_embeddings:
            # Declared so that saving drops the two aliases of `shared` and loading restores them.
            self._tied_weights_keys = {
                "encoder.embed_tokens.weight": "shared.weight",
                "decoder.embed_tokens.weight": "shared.weight",
            }
        self.shared = (
            nn.Embedding(config.vocab_size, config.hidden_size) if config.shared_embeddings else None
        )
        self.encoder = Seq2SeqStack(config, decoder=False, embed_tokens=self.shared)
        self.decoder = Seq2SeqStack(config, decoder=True, embed_tokens=self.shared)
        self.gradient_checkpointing = False  # set by activation_checkpointing_enable
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # Both halves read `shared` whether or not the output projection is tied to it.
        keys = super().get_expanded_tied_weights_keys(all_submodels=all_submodels)
        if self.config.shared_embeddings:
            keys.update(self._tied_weights_keys)
        return keys

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared if self.shared is not None else self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        if self.shared is not None:
            self.shared = value
            self.decoder.embed_tokens = value
        self.encoder.embed_tokens = value

    def get_encoder(self, modality: str | None = None):
        return self.encoder

    def run_encoder(self, input_ids, attention_mask, position_ids, inputs_embeds, encoder_outputs, kwargs):
        """The encoder's output (computed, or `encoder_outputs` as given) and its packed sequences,
        found again from the inputs when the output was given, for cross-attention. kwargs: the
        encoder's `global_attention_mask` and `BaseModelKwargs`."""
        if attention_mask is not None and attention_mask.dim() == 4:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, but an encoder-decoder's attention_mask also "
                "masks cross-attention, so it is the (batch, source length) padding mask; run a 4D mask through "
                "the encoder alone (model.get_encoder()(input_ids, attention_mask=mask)) and pass its output as "
                "encoder_outputs (decoder_attention_mask may be 4D)"
            )
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids, attention_mask, position_ids, inputs_embeds, return_dict=True, **kwargs
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        encoder_h = encoder_outputs.last_hidden_state
        encoder_packing = find_packed_sequences(
            batch=encoder_h.shape[0],
            length=encoder_h.shape[1],
            device=encoder_h.device,
            key_valid=attention_mask,
            position_ids=position_ids,
            **{name: kwargs.get(name) for name in PACKING_INPUTS},
        )
        return encoder_outputs, encoder_packing

    def decoder_cache(self, cache: Cache | None, use_cache: bool | None) -> Cache | None:
        """The caller's cache, always read and updated, or a new one on request (`use_cache`)."""
        if use_cache_unless_checkpointing(self, use_cache) and cache is None:
            cache = EncoderDecoderCache(dynamic_cache(self.config), DynamicCache())
        if isinstance(cache, EncoderDecoderCache):
            check_cross_attention_cache(cache)
        return cache

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        decoder_position_ids: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        *,
        global_attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Unpack[BaseModelKwargs],
    ) -> Seq2SeqModelOutput | tuple:
        """
        Args:
            attention_mask: (B, S_enc) padding mask of the encoder input (also masks cross-attention).
            decoder_attention_mask: (B, P + T) padding mask of the decoder input.
            encoder_outputs: a previous encoder output, reused instead of running the encoder.
            cache: an `EncoderDecoderCache` (`past_key_values=` and `cache_params=`: deprecated names).
            global_attention_mask: (B, S_enc), the encoder input's global tokens (sliding_global/bigbird).
            position_ids: (B, S_enc) positions of the encoder input; restarting ones mark packed
                sequences. Packed decoder inputs (restarting `decoder_position_ids`) pair their n-th
                sequence with the n-th encoder one.
            kwargs: `BaseModelKwargs`: the output flags (both halves); packed sequences of the
                encoder input.
        """
        new_tokens = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
        cache = cache_argument(self, cache, kwargs, new_tokens)
        check_base_inputs(self, kwargs)
        encoder_outputs, encoder_packing = self.run_encoder(
            input_ids,
            attention_mask,
            position_ids,
            inputs_embeds,
            encoder_outputs,
            dict(kwargs, global_attention_mask=global_attention_mask),
        )
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError(
                "Pass decoder_input_ids or decoder_inputs_embeds (or labels to the LM, which makes them)"
            )
        cache = self.decoder_cache(cache, use_cache)
        dec = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            position_ids=decoder_position_ids,
            inputs_embeds=decoder_inputs_embeds,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            encoder_packing=encoder_packing,
            cache=cache,
            return_dict=True,
            output_attentions=kwargs.get("output_attentions"),
            output_hidden_states=kwargs.get("output_hidden_states"),
        )
        out = Seq2SeqModelOutput(
            last_hidden_state=dec.last_hidden_state,
            cache=cache,
            decoder_hidden_states=dec.hidden_states,
            decoder_attentions=dec.attentions,
            cross_attentions=dec.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        return model_output(self.config, out, return_dict)


class Seq2SeqForConditionalGeneration(TaskHead, Seq2SeqPreTrainedModel, SwapformerGenerationMixin):
    accepts_loss_kwargs = True
    output_class = Seq2SeqLMOutput
    _tp_plan = {"lm_head": "colwise_gather_output"}  # with config.base_model_tp_plan

    def __init__(self, config: Seq2SeqConfig):
        super().__init__(config)
        source = "model.shared.weight" if config.shared_embeddings else "model.decoder.embed_tokens.weight"
        self._tied_weights_keys = {"lm_head.weight": source}
        self.model = Seq2SeqModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.add_final_logits_bias:
            # BART's: a buffer, so it is saved and loaded but not trained
            self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size))
        else:
            self.final_logits_bias = None
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is self and self.final_logits_bias is not None:
            init.zeros_(self.final_logits_bias)

    def get_encoder(self, modality: str | None = None):
        return self.model.encoder

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def output_logits(self, h: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The LM head on the kept positions of the decoder's output (B, T, E)."""
        if self.config.scale_decoder_outputs:
            h = h * self.config.hidden_size**-0.5  # T5 v1.0: the tied embedding read as output projection
        logits = project(self.lm_head, keep_positions(h, logits_to_keep))
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias.to(logits.device)
        return logits

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        decoder_position_ids: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        *,
        logits_to_keep: int | torch.Tensor = 0,
        global_attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Unpack[HeadKwargs],
    ) -> Seq2SeqLMOutput | tuple:
        """
        Args:
            labels: (B, T) target ids, -100 where no loss is taken. When decoder inputs are not
                given they are made by shifting the labels right once; the loss compares the logits
                with the labels as they are (no second shift).
            kwargs: `HeadKwargs` (`num_items_in_batch`); the rest as `Seq2SeqModel.forward`'s.
        """
        new_tokens = next(
            (t for t in (decoder_input_ids, decoder_inputs_embeds, labels) if t is not None), None
        )
        cache = cache_argument(self, cache, kwargs, new_tokens)
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            check_label_ids(labels, self.config.vocab_size)  # before they become decoder_input_ids
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        base = (input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, decoder_position_ids)
        base += (encoder_outputs, cache, inputs_embeds, decoder_inputs_embeds, use_cache)
        kwargs.update(global_attention_mask=global_attention_mask, position_ids=position_ids)
        return self.run_head(base, kwargs, return_dict, labels=labels, logits_to_keep=logits_to_keep)

    def head_outputs(self, out, labels, logits_to_keep, num_items_in_batch=None) -> dict:
        logits = self.output_logits(out.last_hidden_state, logits_to_keep)
        loss = None
        if labels is not None:
            loss = token_cross_entropy(logits, labels, shift=False, num_items_in_batch=num_items_in_batch)
        return dict(loss=loss, logits=logits)


AUTO_CLASSES = {
    "AutoModel": Seq2SeqModel,
    "AutoModelForSeq2SeqLM": Seq2SeqForConditionalGeneration,
}
for _cls in AUTO_CLASSES.values():
    _cls.auto_classes = AUTO_CLASSES

__all__ = ["Seq2SeqPreTrainedModel", "Seq2SeqModel", "Seq2SeqForConditionalGeneration", "shift_tokens_right"]
