"""The bidirectional encoder (BERT, RoBERTa, ModernBERT-like) and its task heads."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Cache
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput
from typing_extensions import Unpack

from ...configuration.configuration_swapformer import EncoderConfig
from ..compat.hf_compat import ACT2FN
from ..core.layers import make_norm, project
from ..core.stack import StackMixin
from .encoder_prefix import key_value_prefix
from .losses import sequence_classification_loss, span_loss, token_cross_entropy
from .modeling_base import SwapformerPreTrainedModel
from .task_heads import BaseModelKwargs, HeadKwargs, TaskHead, cache_argument, model_output, stack_inputs


class EncoderPreTrainedModel(SwapformerPreTrainedModel):
    config_class = EncoderConfig


class Pooler(nn.Module):
    """BERT's pooler: the first token's hidden state through dense and tanh, (B, T, E) -> (B, E)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(project(self.dense, h[:, 0]))


class EncoderModel(StackMixin, EncoderPreTrainedModel):
    """Token ids to contextual hidden states (B, T, E), and BERT's `pooler_output` (B, E) when the
    config has `add_pooling_layer`."""

    def __init__(self, config: EncoderConfig, add_pooling_layer: bool | None = None):
        """add_pooling_layer: overrides the config's; heads that never read the pooler pass False
        (as BERT's masked-LM, token and span heads do), so they hold no unused weights."""
        super().__init__(config)
        self.init_stack(
            config,
            num_layers=config.num_hidden_layers,
            causal=False,
            cross_attention=False,
            layer_types=config.layer_types,
            token_types=True,
        )
        if add_pooling_layer is None:
            add_pooling_layer = config.add_pooling_layer
        self.pooler = Pooler(config) if add_pooling_layer else None
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        *,
        global_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[BaseModelKwargs],
    ) -> BaseModelOutputWithPooling | tuple:
        """
        Args:
            global_attention_mask: (B, T), 1 for tokens that attend to and are attended by all tokens
                in sliding_global/bigbird layers (e.g. the CLS token, question tokens).
            cache: a key/value prefix every layer's tokens attend to, as BertModel takes it (PEFT's
                prefix tuning passes it as `past_key_values`): each layer's keys and values
                (B, kv heads, P, head dim); `attention_mask` then covers P + T. It is read, never
                extended (encoder_prefix.py).
            kwargs: `BaseModelKwargs` (output flags, packed sequences).
        """
        prefix = key_value_prefix(self, cache_argument(self, cache, kwargs, None))
        h, hidden, attns, _ = self.forward_stack(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            token_type_ids=token_type_ids,
            cache=prefix,
            **stack_inputs(self, global_attention_mask, kwargs),
        )
        out = BaseModelOutputWithPooling(
            last_hidden_state=h,
            pooler_output=self.pooler(h) if self.pooler is not None else None,
            hidden_states=hidden,
            attentions=attns,
        )
        return model_output(self.config, out, return_dict)


class MaskedLMHead(nn.Module):
    """dense -> act -> norm -> vocabulary projection (BERT's prediction head)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act_fn = ACT2FN[config.hidden_act]
        self.norm = make_norm(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return project(self.decoder, self.norm(self.act_fn(project(self.dense, h))))


class EncoderTaskHead(TaskHead, EncoderPreTrainedModel):
    """The forward of the encoder heads: BERT's inputs, then the head's `labels` (its `head_outputs`)."""

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        global_attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[HeadKwargs],
    ) -> ModelOutput | tuple:
        """global_attention_mask, kwargs: as `EncoderModel.forward`'s (and `num_items_in_batch`)."""
        base = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        kwargs["global_attention_mask"] = global_attention_mask
        return self.run_head(base, kwargs, return_dict, labels=labels)


class EncoderForMaskedLM(EncoderTaskHead):
    _tied_weights_keys = {"lm_head.decoder.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head.decoder": "colwise_gather_output"}  # with config.base_model_tp_plan
    accepts_loss_kwargs = True
    output_class = MaskedLMOutput

    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.model = EncoderModel(config, add_pooling_layer=False)
        self.lm_head = MaskedLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def head_outputs(self, out, labels: torch.Tensor | None, num_items_in_batch=None) -> dict:
        """labels: (B, T) token ids at masked positions, -100 elsewhere."""
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = token_cross_entropy(logits, labels, shift=False, num_items_in_batch=num_items_in_batch)
        return dict(loss=loss, logits=logits)


def classifier_dropout(config: EncoderConfig) -> float:
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout


class ClassificationHead(nn.Module):
    """dropout -> dense -> tanh -> dropout -> out_proj on the first token: RoBERTa's head, for
    encoders without a pooler."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(project(self.dense, self.dropout(h[:, 0])))
        return project(self.out_proj, self.dropout(x))


class EncoderForSequenceClassification(EncoderTaskHead):
    """With `add_pooling_layer`: BERT's classifier, pooler -> dropout -> linear `classifier` (so a
    model converted from BERT starts from its trained pooler). Without: RoBERTa's head `classifier`
    (`ClassificationHead`) on the first token."""

    accepts_loss_kwargs = False  # its loss is a mean over sequences: Trainer must not pass a token count
    output_class = SequenceClassifierOutput

    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.model = EncoderModel(config)
        if self.model.pooler is not None:
            self.dropout = nn.Dropout(classifier_dropout(config))
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        else:
            self.dropout = None
            self.classifier = ClassificationHead(config)
        self.post_init()

    def head_outputs(self, out, labels: torch.Tensor | None) -> dict:
        """labels: (B,) class ids, (B,) floats for regression, or (B, num_labels) multi-label targets."""
        if self.dropout is not None:
            logits = project(self.classifier, self.dropout(out.pooler_output))
        else:
            logits = self.classifier(out.last_hidden_state)
        loss = sequence_classification_loss(self.config, logits, labels) if labels is not None else None
        return dict(loss=loss, logits=logits)


class EncoderForTokenClassification(EncoderTaskHead):
    accepts_loss_kwargs = True
    output_class = TokenClassifierOutput

    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.model = EncoderModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def head_outputs(self, out, labels: torch.Tensor | None, num_items_in_batch=None) -> dict:
        """labels: (B, T) class ids, -100 where no loss is taken."""
        logits = project(self.classifier, self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            loss = token_cross_entropy(logits, labels, shift=False, num_items_in_batch=num_items_in_batch)
        return dict(loss=loss, logits=logits)


class EncoderForQuestionAnswering(EncoderTaskHead):
    accepts_loss_kwargs = False  # its loss is a mean over sequences: Trainer must not pass a token count
    output_class = QuestionAnsweringModelOutput

    def __init__(self, config: EncoderConfig):
        super().__init__(config)
        self.model = EncoderModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        *,
        global_attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Unpack[HeadKwargs],
    ) -> QuestionAnsweringModelOutput | tuple:
        """BERT's question-answering inputs: the span targets take the place of `labels`."""
        base = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        kwargs["global_attention_mask"] = global_attention_mask
        spans = dict(start_positions=start_positions, end_positions=end_positions)
        return self.run_head(base, kwargs, return_dict, **spans)

    def head_outputs(self, out, start_positions: torch.Tensor | None, end_positions: torch.Tensor | None):
        """start_positions, end_positions: (B,) token indices of the answer span; positions outside
        the sequence are ignored by the loss."""
        start_logits, end_logits = project(self.qa_outputs, out.last_hidden_state).unbind(-1)  # (B, T) each
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = span_loss(start_logits, end_logits, start_positions, end_positions)
        return dict(loss=loss, start_logits=start_logits.contiguous(), end_logits=end_logits.contiguous())


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
