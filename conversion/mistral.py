"""Mistral (`MistralModel`, `MistralForCausalLM`, `MistralForSequenceClassification`) -> swapformer
`DecoderModel` and heads: Llama's layers (no biases) with every layer attending within a sliding window.

transformers' Mistral masks keys with `kv_idx > q_idx - sliding_window` on top of causality
(`masking_utils.sliding_window_overlay`): a query sees 0 <= q - k < sliding_window, which is exactly
swapformer's `sliding_attention` with the same `sliding_window`. `sliding_window=None` is full attention.
"""

from __future__ import annotations

from ..configuration.configuration_swapformer import DecoderConfig
from .family import Family, register
from .llama import DROP, decoder_architectures, decoder_config, hf_decoder_fields, rope_refusal

ARCHITECTURES = decoder_architectures("Mistral")
__all__ = ["ARCHITECTURES", "DROP", "FAMILY", "config_from_hf", "config_to_hf"]


def config_from_hf(hf) -> DecoderConfig:
    if getattr(hf, "layer_types", None):
        raise ValueError(
            f"Mistral with layer_types={hf.layer_types!r} (alternating attention) is not supported; "
            "convert a Mistral whose layers all share sliding_window"
        )
    window = hf.sliding_window
    kind = "full_attention" if window is None else "sliding_attention"
    return decoder_config(
        hf,
        sliding_window=window,
        layer_types=[kind] * hf.num_hidden_layers,
        attention_bias=False,
        mlp_bias=False,
    )


def config_to_hf(cfg: DecoderConfig):
    from transformers import MistralConfig

    kinds = set(cfg.layer_types)
    if kinds not in ({"full_attention"}, {"sliding_attention"}) or cfg.attention_bias or cfg.mlp_bias:
        raise ValueError(
            f"Only decoders whose layers are all full or all sliding_attention, without biases, go back to "
            f"Mistral; this one has layer_types={cfg.layer_types}, attention_bias={cfg.attention_bias}, "
            f"mlp_bias={cfg.mlp_bias}"
        )
    window = cfg.sliding_window if kinds == {"sliding_attention"} else None
    return MistralConfig(**hf_decoder_fields(cfg), sliding_window=window)


FAMILY = register(
    Family(
        "mistral",
        ARCHITECTURES,
        config_from_hf,
        config_to_hf,
        drop=DROP,
        long_refusal=rope_refusal("mistral"),
    )
)
