"""The configurations of the three swapformer architectures: encoder, decoder, encoder-decoder.

`SwapformerConfig` (configuration_base.py) holds the fields they share; each class here adds its own
fields to the table (config_fields.py) and its own rules between fields. The names other modules
import from here (the tables of choices, the tensor-parallel plan) are re-exported at the end.
"""

from __future__ import annotations

import math

from .backends import LAYER_TYPE_PATTERN
from .config_fields import choice, flag, free, integer, token_id
from .config_rules import GLOBAL_KINDS, LAYER_TYPES, ROPE_TYPES, SHARED_RULES, check_layer_list
from .configuration_base import (
    ACTIVATIONS,
    INITIALIZERS,
    LINFORMER_SHARING,
    MLP_TYPES,
    NORM_TYPES,
    POSITION_TYPES,
    STREAMING_POSITIONS,
    SwapformerConfig,
)
from .tp_plan import per_head_tables, tensor_parallel_plan

MLA_FIELDS = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class EncoderConfig(SwapformerConfig):
    """A bidirectional encoder (BERT, RoBERTa, ModernBERT-like).

    Args:
        type_vocab_size: rows of the token-type (segment) embedding; 0 means none (BERT uses 2).
        add_pooling_layer: BERT's pooler (first token, dense, tanh): `EncoderModel` returns it as
            `pooler_output`, and `EncoderForSequenceClassification` classifies it as
            `BertForSequenceClassification` does (pooler, dropout, linear). Off: the classifier is
            RoBERTa's head on the first token (dropout, dense, tanh, dropout, linear). Converted BERT
            checkpoints turn it on, so a classifier fine-tuned from them starts from the trained pooler.
    """

    model_type = "swapformer_encoder"

    type_vocab_size: int = integer(0, minimum=0, feature="embeddings")
    add_pooling_layer: bool = flag(False, feature="heads")


# Multi-head latent attention (DecoderConfig.kv_lora_rank) ----------------------------------------


def mla_fields_need_latent(config) -> None:
    given = [n for n in MLA_FIELDS if getattr(config, n)]
    if config.kv_lora_rank is None and given:
        raise ValueError(
            f"{', '.join(f'{n}={getattr(config, n)}' for n in given)} only apply to multi-head latent attention, "
            "which kv_lora_rank turns on; set kv_lora_rank (DeepSeek-V3: 512) or leave them None"
        )


def mla_sizes_given(config) -> None:
    if config.kv_lora_rank is None:
        return
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(config, name) is None:
            raise ValueError(
                f"kv_lora_rank={config.kv_lora_rank} (multi-head latent attention) needs {name}; "
                "set it (DeepSeek-V3: qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)"
            )


def mla_rotates_whole_rope_part(config) -> None:
    if config.kv_lora_rank is None:
        return
    if config.position_embedding_type != "rope" or config.qk_rope_head_dim % 2:
        raise ValueError(
            f"kv_lora_rank={config.kv_lora_rank} (multi-head latent attention) needs position_embedding_type="
            f"'rope' and an even qk_rope_head_dim; got {config.position_embedding_type!r} and "
            f"qk_rope_head_dim={config.qk_rope_head_dim}"
        )
    if config.head_dim != config.qk_rope_head_dim:
        raise ValueError(
            f"Under multi-head latent attention head_dim is the RoPE part's width: head_dim={config.head_dim} "
            f"!= qk_rope_head_dim={config.qk_rope_head_dim}; leave head_dim=None or set it equal"
        )
    partial = config.rope_parameters.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(
            f"rope_parameters['partial_rotary_factor']={partial}: multi-head latent attention rotates its "
            f"whole RoPE part (qk_rope_head_dim={config.qk_rope_head_dim}); drop partial_rotary_factor and set "
            "qk_rope_head_dim to the width that rotates"
        )


def mla_full_layers_only(config) -> None:
    if config.kv_lora_rank is not None and set(config.layer_types) != {"full_attention"}:
        raise ValueError(
            f"Multi-head latent attention runs full_attention layers only; layer_types={config.layer_types}. "
            "Use layer_types=None (all full) or kv_lora_rank=None"
        )


class DecoderConfig(SwapformerConfig):
    """A causal decoder (GPT-2, Llama, Mistral, DeepSeek-V3-like).

    Args:
        kv_lora_rank: multi-head latent attention (MLA, DeepSeek-V2 https://arxiv.org/abs/2405.04434) when
            set: keys and values are up-projected from one per-token latent of this width, which is what
            the cache keeps (with the RoPE key); `None` (default) is ordinary attention. modeling/variants/mla.py.
        q_lora_rank: MLA queries go through a latent of this width (`None`: one query projection).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA's per-head widths of the query/key part
            without RoPE, of the RoPE part (shared by all heads on the key side) and of the values.
            `head_dim` is the RoPE part's width under MLA (it sizes the RoPE frequencies, as in DeepSeek).
        rope_interleave: MLA's RoPE pairs are interleaved dims (x0, x1), (x2, x3), ... (DeepSeek's
            checkpoints) rather than halves.
        mla_decode: `"absorbed"` (default) decodes from the latent cache with the key up-projection folded
            into the query and the value up-projection into the output; `"decompressed"` up-projects
            every cached latent at every step (the reference; slower).
    """

    model_type = "swapformer_decoder"
    _rules = (
        *SHARED_RULES,
        mla_fields_need_latent,
        mla_sizes_given,
        mla_rotates_whole_rope_part,
        mla_full_layers_only,
    )

    kv_lora_rank: int | None = integer(None, minimum=1, optional=True, feature="mla")
    q_lora_rank: int | None = integer(None, minimum=1, optional=True, feature="mla")
    qk_nope_head_dim: int | None = integer(None, minimum=1, optional=True, feature="mla")
    qk_rope_head_dim: int | None = integer(None, minimum=1, optional=True, feature="mla")
    v_head_dim: int | None = integer(None, minimum=1, optional=True, feature="mla")
    rope_interleave: bool = flag(False, feature="mla")
    mla_decode: str = choice("absorbed", ("absorbed", "decompressed"), feature="mla")

    causal = True

    def __post_init__(self, **kwargs):
        if self.kv_lora_rank is not None and self.head_dim is None:
            self.head_dim = self.qk_rope_head_dim
        super().__post_init__(**kwargs)

    @property
    def effective_attention_scale(self) -> float:
        """Under MLA: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times DeepSeek's YaRN `mscale_all_dim`
        correction squared when RoPE is scaled (as transformers' DeepseekV3Attention)."""
        if self.kv_lora_rank is None or self.attention_scale is not None:
            return super().effective_attention_scale
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        params = self.rope_parameters
        if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
            factor = params["factor"]
            mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= mscale * mscale
        return scale


# The decoder of an encoder-decoder ---------------------------------------------------------------


def decoder_layer_types_match(config) -> None:
    names = ("decoder_layer_types", config.decoder_layer_types, config.decoder_layers, "decoder_layers")
    check_layer_list(config, *names)


def encoder_decoder_flag(config) -> None:
    if not config.is_encoder_decoder:
        raise ValueError("Seq2SeqConfig needs is_encoder_decoder=True")


def decoder_has_no_global_projections(config) -> None:
    causal_global = [t for t in config.decoder_layer_types if LAYER_TYPE_PATTERN[t] in GLOBAL_KINDS]
    if config.global_projections and causal_global:
        raise ValueError(
            f"global_projections=True applies to the encoder, but decoder_layer_types has {causal_global[0]!r} "
            "layers: the decoder's self-attention is causal, and a global token's own projections attend to "
            "every key, later tokens included (Longformer's query_global/key_global/value_global). Use "
            "'sliding_attention' or 'full_attention' decoder layers, or global_projections=False"
        )


class Seq2SeqConfig(SwapformerConfig):
    """An encoder-decoder (T5, BART-like). `num_hidden_layers` is the encoder depth.

    Args:
        decoder_layers: decoder depth; `None` means `num_hidden_layers`.
        shared_embeddings: encoder and decoder read one token embedding (`shared`).
        decoder_start_token_id: first decoder input when decoder inputs are made from labels.
        scale_decoder_outputs: multiply the decoder's last hidden state by hidden_size ** -0.5 before
            the LM head (T5 v1.0, whose output projection is the input embedding).
        add_final_logits_bias: the LM adds a fixed per-token bias to its logits, the buffer
            `final_logits_bias` (1, vocab_size) of BART, saved with the weights and not trained.
    """

    model_type = "swapformer_seq2seq"
    # Seq2SeqModel holds two stacks; no pipeline plan (transformers' stages run one stack of layers)
    base_model_pp_plan = None
    _rules = (
        *SHARED_RULES,
        decoder_layer_types_match,
        encoder_decoder_flag,
        decoder_has_no_global_projections,
    )

    decoder_layers: int | None = integer(None, minimum=1, feature="seq2seq")
    decoder_layer_types: list[str] | None = free(None, feature="seq2seq")
    shared_embeddings: bool = flag(True, feature="embeddings")
    scale_decoder_outputs: bool = flag(False, feature="seq2seq")
    add_final_logits_bias: bool = flag(False, feature="seq2seq")
    decoder_start_token_id: int | None = token_id()
    is_encoder_decoder: bool = True
    causal = True  # of the decoder's self-attention; the encoder is always bidirectional

    def __post_init__(self, **kwargs):
        if self.decoder_layers is None:
            self.decoder_layers = self.num_hidden_layers
        if self.decoder_layer_types is None and isinstance(self.decoder_layers, int):
            # Always explicit: transformers' flat encoder-decoder handling turns decoder_layer_types into
            # the layer_types of the decoder's cache, and must not fall back to the encoder's.
            self.decoder_layer_types = ["full_attention"] * self.decoder_layers
        super().__post_init__(**kwargs)

    def _all_layer_types(self) -> list[str]:
        return list(self.layer_types) + list(self.decoder_layer_types)


__all__ = [
    "SwapformerConfig",
    "EncoderConfig",
    "DecoderConfig",
    "Seq2SeqConfig",
    # the tables other modules read
    "ACTIVATIONS",
    "GLOBAL_KINDS",
    "INITIALIZERS",
    "LAYER_TYPES",
    "LINFORMER_SHARING",
    "MLP_TYPES",
    "NORM_TYPES",
    "POSITION_TYPES",
    "ROPE_TYPES",
    "STREAMING_POSITIONS",
    "per_head_tables",
    "tensor_parallel_plan",
]
