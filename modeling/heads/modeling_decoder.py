"""The causal decoder (GPT-2, Llama, Mistral-like), its LM head and its classification head."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Cache
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from typing_extensions import Unpack

from ...configuration.configuration_swapformer import DecoderConfig
from ..caches.cache import dynamic_cache
from ..core.layers import project
from ..core.stack import StackMixin
from .generation import DecoderGenerationMixin
from .losses import causal_lm_loss, sequence_classification_loss
from .modeling_base import SwapformerPreTrainedModel
from .task_heads import (
    BaseModelKwargs,
    HeadKwargs,
    TaskHead,
    cache_argument,
    keep_positions,
    model_output,
    stack_inputs,
    use_cache_unless_checkpointing,
)


class DecoderPreTrainedModel(SwapformerPreTrainedModel):
    config_class = DecoderConfig


class DecoderModel(StackMixin, DecoderPreTrainedModel):
    """Token ids to hidden states (B, T, E), with a KV cache for generation."""

    def __init__(self, config: DecoderConfig):
        super().__init__(config)
        self.init_stack(
            config,
            num_layers=config.num_hidden_layers,
            causal=True,
            cross_attention=False,
            layer_types=config.layer_types,
        )
        self.gradient_checkpointing = False  # set by activation_checkpointing_enable
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        *,
        global_attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[BaseModelKwargs],
    ) -> BaseModelOutputWithPast | tuple:
        """
        Args:
            attention_mask: (B, P + T) over cached and new tokens, 1 for tokens, 0 for padding; or a 4D
                mask (B, 1, T, P + T) (README: Custom attention masks).
            cache: a transformers `Cache` holding P tokens (`past_key_values=` and `cache_params=` are
                its deprecated names; `cache_position`, if given, must be P..P+T-1).
            use_cache: create a `DynamicCache` when none is given and return it (off, with
                transformers' warning, while gradient checkpointing trains).
            global_attention_mask: (B, P + T), 1 for tokens that attend to and are attended by all
                tokens in sliding_global/bigbird layers.
            kwargs: `BaseModelKwargs` (output flags, packed sequences).
        """
        cache = cache_argument(self, cache, kwargs, input_ids if input_ids is not None else inputs_embeds)
        # A cache the caller passed is always read and updated; one is only created on request.
        if use_cache_unless_checkpointing(self, use_cache) and cache is None:
            cache = dynamic_cache(self.config)  # swapformer's layer objects (cache.fresh_cache)
        h, hidden, attns, _ = self.forward_stack(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            **stack_inputs(self, global_attention_mask, kwargs),
        )
        out = BaseModelOutputWithPast(
            last_hidden_state=h, cache=cache, hidden_states=hidden, attentions=attns
        )
        return model_output(self.config, out, return_dict)


class DecoderForCausalLM(TaskHead, DecoderPreTrainedModel, DecoderGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # with config.base_model_tp_plan, as Llama's
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    accepts_loss_kwargs = True
    output_class = CausalLMOutputWithPast

    def __init__(self, config: DecoderConfig):
        super().__init__(config)
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        *,
        global_attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = None,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Unpack[HeadKwargs],
    ) -> CausalLMOutputWithPast | tuple:
        """
        Args:
            labels: (B, T) usually the input ids; shifted inside, -100 where no loss is taken.
            logits_to_keep: compute logits for the last N positions only (0: all), or for the
                positions a tensor selects (transformers' rule, see `keep_positions`); generation uses 1.
            shift_labels: (B, T) labels already shifted (the target of position t at t), as
                transformers' causal-LM loss takes them; used instead of `labels`.
            kwargs: `HeadKwargs`: `num_items_in_batch`, labelled tokens in the whole accumulated batch
                (see `token_cross_entropy`); the rest as `DecoderModel.forward`'s.
        """
        cache = cache_argument(self, cache, kwargs, input_ids if input_ids is not None else inputs_embeds)
        base = (input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache)
        kwargs["global_attention_mask"] = global_attention_mask
        targets = dict(labels=labels, shift_labels=shift_labels, logits_to_keep=logits_to_keep)
        return self.run_head(base, kwargs, return_dict, **targets)

    def head_outputs(self, out, labels, shift_labels, logits_to_keep, num_items_in_batch=None) -> dict:
        logits = project(self.lm_head, keep_positions(out.last_hidden_state, logits_to_keep))
        wanted = labels is not None or shift_labels is not None  # losses.py runs only then
        loss = causal_lm_loss(logits, labels, shift_labels, num_items_in_batch) if wanted else None
        return dict(loss=loss, logits=logits)


class DecoderForSequenceClassification(TaskHead, DecoderPreTrainedModel):
    """Classifies a sequence from the hidden state of its last token (GPT-2, Llama style)."""

    accepts_loss_kwargs = False  # its loss is a mean over sequences: Trainer must not pass a token count
    output_class = SequenceClassifierOutputWithPast

    def __init__(self, config: DecoderConfig):
        super().__init__(config)
        self.model = DecoderModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        *,
        global_attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[HeadKwargs],
    ) -> SequenceClassifierOutputWithPast | tuple:
        """labels: (B,) class ids, (B,) floats for regression, or (B, num_labels) multi-label targets."""
        cache = cache_argument(self, cache, kwargs, input_ids if input_ids is not None else inputs_embeds)
        base = (input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache)
        kwargs["global_attention_mask"] = global_attention_mask
        return self.run_head(
            base, kwargs, return_dict, labels=labels, input_ids=input_ids, mask=attention_mask
        )

    def head_outputs(self, out, labels, input_ids, mask) -> dict:
        """The last token is the last one with a (B, P + T) attention_mask 1 (left or right padding),
        else the last one that is not `pad_token_id` (with a 4D mask too, as Llama's), else the last
        position."""
        logits = project(self.score, out.last_hidden_state)  # (B, T, num_labels)
        b, t = logits.shape[:2]
        positions = torch.arange(t, device=logits.device)
        if mask is not None and mask.dim() == 2:
            last = (mask[:, -t:].to(logits.device).bool() * positions).argmax(-1)
        elif input_ids is not None and self.config.pad_token_id is not None:
            last = ((input_ids != self.config.pad_token_id).to(logits.device) * positions).argmax(-1)
        elif b == 1 or input_ids is None:
            last = torch.full((b,), t - 1, device=logits.device)
        else:
            raise ValueError(
                "DecoderForSequenceClassification needs attention_mask or config.pad_token_id to find the last "
                f"token of each of the {b} sequences"
            )
        pooled = logits[torch.arange(b, device=logits.device), last]
        loss = sequence_classification_loss(self.config, pooled, labels) if labels is not None else None
        return dict(loss=loss, logits=pooled)


AUTO_CLASSES = {
    "AutoModel": DecoderModel,
    "AutoModelForCausalLM": DecoderForCausalLM,
    "AutoModelForSequenceClassification": DecoderForSequenceClassification,
}
for _cls in AUTO_CLASSES.values():
    _cls.auto_classes = AUTO_CLASSES

__all__ = ["DecoderPreTrainedModel", "DecoderModel", "DecoderForCausalLM", "DecoderForSequenceClassification"]
