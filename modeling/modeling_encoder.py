"""The bidirectional encoder (BERT, RoBERTa, ModernBERT-like) and its task heads."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from ..configuration.configuration_swapformer import EncoderConfig
from .hf_compat import ACT2FN
from .layers import make_norm
from .modeling_base import (
    SwapformerPreTrainedModel,
    finish_output,
    sequence_classification_loss,
    token_cross_entropy,
)
from .packing import packing_kwargs
from .stack import StackMixin


class EncoderPreTrainedModel(SwapformerPreTrainedModel):
    config_class = EncoderConfig


class Pooler(nn.Module):
    """BERT's pooler: the first token's hidden state through dense and tanh, (B, T, E) -> (B, E)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(h[:, 0]))


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
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        global_attention_mask: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
    ) -> BaseModelOutputWithPooling | tuple:
        """global_attention_mask: (B, T), 1 for tokens that attend to and are attended by all tokens
        in sliding_global/bigbird layers (e.g. the CLS token, question tokens).

        cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx: packed sequences as
        `DataCollatorWithFlattening` marks them (restarting `position_ids` alone do too); each sequence
        then attends only to itself (see modeling/packing.py)."""
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
            packing_inputs=packing_kwargs(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx),
        )
        out = BaseModelOutputWithPooling(
            last_hidden_state=h,
            pooler_output=self.pooler(h) if self.pooler is not None else None,
            hidden_states=hidden,
            attentions=attns,
        )
        return finish_output(cfg, out, return_dict)


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
        self.model = EncoderModel(config, add_pooling_layer=False)
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
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
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
            **packing_kwargs(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx),
        )
        logits = self.lm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = token_cross_entropy(logits, labels, shift=False, num_items_in_batch=num_items_in_batch)
        result = MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return finish_output(self.config, result, return_dict)


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
        x = torch.tanh(self.dense(self.dropout(h[:, 0])))
        return self.out_proj(self.dropout(x))


class EncoderForSequenceClassification(EncoderPreTrainedModel):
    """With `add_pooling_layer`: BERT's classifier, pooler -> dropout -> linear `classifier` (so a
    model converted from BERT starts from its trained pooler). Without: RoBERTa's head `classifier`
    (`ClassificationHead`) on the first token."""

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
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
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
            **packing_kwargs(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx),
        )
        if self.dropout is not None:
            logits = self.classifier(self.dropout(out.pooler_output))
        else:
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
        self.model = EncoderModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(classifier_dropout(config))
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
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
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
            **packing_kwargs(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx),
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
        self.model = EncoderModel(config, add_pooling_layer=False)
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
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        seq_idx: torch.Tensor | None = None,
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
            **packing_kwargs(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx),
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
