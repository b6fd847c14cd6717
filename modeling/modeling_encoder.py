"""The bidirectional encoder (BERT, RoBERTa, ModernBERT-like) and its task heads."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from ..configuration.configuration_swapformer import EncoderConfig
from .layers import make_norm
from .modeling_base import (
    SwapformerPreTrainedModel,
    finish_output,
    sequence_classification_loss,
    token_cross_entropy,
)
from .stack import StackMixin


class EncoderPreTrainedModel(SwapformerPreTrainedModel):
    config_class = EncoderConfig


class EncoderModel(StackMixin, EncoderPreTrainedModel):
    """Token ids to contextual hidden states (B, T, E)."""

    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.init_stack(
            config,
            num_layers=config.num_hidden_layers,
            causal=False,
            cross_attention=False,
            layer_types=config.layer_types,
            token_types=True,
        )
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        global_attention_mask: torch.Tensor | None = None,
    ) -> BaseModelOutput | tuple:
        """global_attention_mask: (B, T), 1 for tokens that attend to and are attended by all tokens
        in sliding_global/bigbird layers (e.g. the CLS token, question tokens)."""
        cfg = self.config
        h, hidden, attns, _ = self.forward_stack(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            token_type_ids=token_type_ids,
            global_attention_mask=global_attention_mask,
            output_attentions=cfg.output_attentions if output_attentions is None else output_attentions,
            output_hidden_states=cfg.output_hidden_states
            if output_hidden_states is None
            else output_hidden_states,
        )
        return finish_output(
            cfg, BaseModelOutput(last_hidden_state=h, hidden_states=hidden, attentions=attns), return_dict
        )


class MaskedLMHead(nn.Module):
    """dense -> act -> norm -> vocabulary projection (BERT's prediction head)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act_fn = ACT2FN[config.hidden_act]
        self.norm = make_norm(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act_fn(self.dense(h))))


class EncoderForMaskedLM(EncoderPreTrainedModel):
    _tied_weights_keys = {"lm_head.decoder.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head.decoder": "colwise_gather_output"}  # with config.base_model_tp_plan
    accepts_loss_kwargs = True

    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.model = EncoderModel(config)
        self.lm_head = MaskedLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels: torch.Tensor | None = None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        global_attention_mask=None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> MaskedLMOutput | tuple:
        """labels: (B, T) token ids at masked positions, -100 elsewhere."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            global_attention_mask=global_attention_mask,
            return_dict=True,
        )
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = token_cross_entropy(logits, labels, shift=False, num_items_in_batch=num_items_in_batch)
        result = MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return finish_output(self.config, result, return_dict)


class ClassificationHead(nn.Module):
    """dense -> tanh -> dropout -> out_proj on the first token (BERT's pooler + classifier)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
        )
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.dropout(torch.tanh(self.dense(h[:, 0]))))


class EncoderForSequenceClassification(EncoderPreTrainedModel):
    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.model = EncoderModel(config)
        self.classifier = ClassificationHead(config)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels: torch.Tensor | None = None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        global_attention_mask=None,
    ) -> SequenceClassifierOutput | tuple:
        """labels: (B,) class ids, (B,) floats for regression, or (B, num_labels) multi-label targets."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            global_attention_mask=global_attention_mask,
            return_dict=True,
        )
        logits = self.classifier(out.last_hidden_state)
        loss = sequence_classification_loss(self.config, logits, labels) if labels is not None else None
        result = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return finish_output(self.config, result, return_dict)


class EncoderForTokenClassification(EncoderPreTrainedModel):
    accepts_loss_kwargs = True

    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        dropout = (
            config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
        )
        self.model = EncoderModel(config)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels: torch.Tensor | None = None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        global_attention_mask=None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> TokenClassifierOutput | tuple:
        """labels: (B, T) class ids, -100 where no loss is taken."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            global_attention_mask=global_attention_mask,
            return_dict=True,
        )
        logits = self.classifier(self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            loss = token_cross_entropy(logits, labels, shift=False, num_items_in_batch=num_items_in_batch)
        result = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return finish_output(self.config, result, return_dict)


class EncoderForQuestionAnswering(EncoderPreTrainedModel):
    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.model = EncoderModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        global_attention_mask=None,
    ) -> QuestionAnsweringModelOutput | tuple:
        """start_positions, end_positions: (B,) token indices of the answer span; positions outside
        the sequence are ignored by the loss."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            global_attention_mask=global_attention_mask,
            return_dict=True,
        )
        start_logits, end_logits = self.qa_outputs(out.last_hidden_state).unbind(-1)  # (B, T) each
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = (
                nn.functional.cross_entropy(start_logits.float(), start, ignore_index=ignored)
                + nn.functional.cross_entropy(end_logits.float(), end, ignore_index=ignored)
            ) / 2
        result = QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits.contiguous(),
            end_logits=end_logits.contiguous(),
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )
        return finish_output(self.config, result, return_dict)


AUTO_CLASSES = {
    "AutoModel": EncoderModel,
    "AutoModelForMaskedLM": EncoderForMaskedLM,
    "AutoModelForSequenceClassification": EncoderForSequenceClassification,
    "AutoModelForTokenClassification": EncoderForTokenClassification,
    "AutoModelForQuestionAnswering": EncoderForQuestionAnswering,
}
for _cls in AUTO_CLASSES.values():
    _cls.auto_classes = AUTO_CLASSES

__all__ = [
    "EncoderPreTrainedModel",
    "EncoderModel",
    "EncoderForMaskedLM",
    "EncoderForSequenceClassification",
    "EncoderForTokenClassification",
    "EncoderForQuestionAnswering",
]
