"""swapformer.modeling: attention backends, masks, layers and the three architectures."""

from .caches.int8_cache import Int8Cache, int8_cache
from .cpu import cpu_linear, cpu_linear_route, cpu_routes, sparse_cpu, sparse_cpu_route
from .heads.modeling_base import SwapformerPreTrainedModel
from .heads.modeling_decoder import DecoderForCausalLM, DecoderForSequenceClassification, DecoderModel
from .heads.modeling_encoder import (
    EncoderForMaskedLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    EncoderModel,
)
from .heads.modeling_seq2seq import Seq2SeqForConditionalGeneration, Seq2SeqModel

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
    "Int8Cache",
    "int8_cache",
    "cpu_linear",
    "cpu_linear_route",
    "cpu_routes",
    "sparse_cpu",
    "sparse_cpu_route",
]
