"""swapformer.configuration: config classes and the backend capability table (no torch import)."""

from .backends import BACKENDS, PER_LAYER_BACKEND, Capabilities, capability_table_markdown, check_backend_name
from .configuration_swapformer import DecoderConfig, EncoderConfig, Seq2SeqConfig, SwapformerConfig

__all__ = [
    "BACKENDS",
    "PER_LAYER_BACKEND",
    "Capabilities",
    "capability_table_markdown",
    "check_backend_name",
    "DecoderConfig",
    "EncoderConfig",
    "Seq2SeqConfig",
    "SwapformerConfig",
]
