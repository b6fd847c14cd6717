"""swapformer.modeling: attention backends, masks, layers and the three architectures."""

from .modeling_base import SwapformerPreTrainedModel
from .modeling_decoder import DecoderForCausalLM, DecoderForSequenceClassification, DecoderModel
from .modeling_encoder import (
    EncoderForMaskedLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    EncoderModel,
)
from .modeling_seq2seq import Seq2SeqForConditionalGeneration, Seq2SeqModel

__all__ = [
    "SwapformerPreTrainedModel",
    "EncoderModel",
    "EncoderForMaskedLM",
    "EncoderForSequenceClassification",
    "EncoderForTokenClassification",
    "EncoderForQuestionAnswering",
    "DecoderModel",
    "DecoderForCausalLM",
    "DecoderForSequenceClassification",
    "Seq2SeqModel",
    "Seq2SeqForConditionalGeneration",
]
