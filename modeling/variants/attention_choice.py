"""Which self-attention class a layer gets: the plain `Attention` or one of the variants, chosen once,
when the stack is built (`stack.init_stack`), never in a forward."""

from __future__ import annotations

from ...configuration.backends import LAYER_TYPE_PATTERN
from ...configuration.configuration_swapformer import GLOBAL_KINDS
from ..core.layers import Attention, AttentionBase
from .global_rows import GlobalProjectionAttention
from .linformer import LinformerAttention
from .mla import LatentAttention
from .streaming import StreamingAttention


def attention_class(config, layer_type: str, causal: bool) -> type[AttentionBase]:
    """The self-attention class of a layer of `layer_type`, chosen once when the stack is built."""
    if getattr(config, "kv_lora_rank", None) is not None:  # multi-head latent attention (decoders)
        return LatentAttention
    if getattr(config, "linformer_k", None) is not None and not causal:
        return LinformerAttention
    if config.global_projections and not causal and LAYER_TYPE_PATTERN[layer_type] in GLOBAL_KINDS:
        return GlobalProjectionAttention  # Longformer's q/k/v_global_proj
    if config.streaming_positions == "cache" and LAYER_TYPE_PATTERN[layer_type] == "sliding_global":
        return StreamingAttention
    return Attention
