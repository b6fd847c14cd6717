"""Registration of swapformer's configs and models with transformers' Auto classes."""

import transformers

from .configuration import DecoderConfig, EncoderConfig, Seq2SeqConfig
from .modeling.heads import modeling_decoder, modeling_encoder, modeling_seq2seq

ARCHITECTURES = (
    (EncoderConfig, modeling_encoder.AUTO_CLASSES),
    (DecoderConfig, modeling_decoder.AUTO_CLASSES),
    (Seq2SeqConfig, modeling_seq2seq.AUTO_CLASSES),
)


def register_all() -> None:
    """Register every config with AutoConfig and every model with its Auto class (idempotent)."""
    for config_class, auto_classes in ARCHITECTURES:
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for auto_name, model_class in auto_classes.items():
            getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)
