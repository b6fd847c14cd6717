"""swapformer: Hugging Face-compatible Transformers whose attention backend you can swap.

Importing the package registers its configs and models with transformers' Auto classes, so
`AutoModel*.from_config` / `from_pretrained` build swapformer models without `trust_remote_code`.
"""

from . import auto as _auto
from .configuration import (
    BACKENDS,
    PER_LAYER_BACKEND,
    DecoderConfig,
    EncoderConfig,
    Seq2SeqConfig,
    SwapformerConfig,
    capability_table_markdown,
)
from .conversion import convert
from .modeling import (
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    DecoderModel,
    EncoderForMaskedLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    EncoderModel,
    Seq2SeqForConditionalGeneration,
    Seq2SeqModel,
    SwapformerPreTrainedModel,
)

__version__ = "0.1.0"

_auto.register_all()

__all__ = [
    "BACKENDS",
    "PER_LAYER_BACKEND",
    "capability_table_markdown",
    "convert",
    "SwapformerConfig",
    "EncoderConfig",
    "DecoderConfig",
    "Seq2SeqConfig",
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
