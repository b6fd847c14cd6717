"""Llama (`LlamaModel`, `LlamaForCausalLM`, `LlamaForSequenceClassification`) -> swapformer
`DecoderModel` and heads: pre-RMSNorm, RoPE, SwiGLU, GQA, no biases. The parameter names are already
HF-standard. Mistral (mistral.py) is the same with a sliding window."""

from __future__ import annotations

from ..configuration.configuration_swapformer import ROPE_TYPES, DecoderConfig
from .bert import label_fields
from .rules import Architecture, Rule, prefixed

_L = r"layers\.(\d+)\."
BASE_RULES = [
    Rule(r"embed_tokens\.weight", "embed_tokens.weight"),
    Rule(_L + r"self_attn\.(q|k|v|o)_proj\.(weight|bias)", r"layers.\1.self_attn.\2_proj.\3"),
    Rule(_L + r"mlp\.(gate|up|down)_proj\.(weight|bias)", r"layers.\1.mlp.\2_proj.\3"),
    Rule(_L + r"input_layernorm\.weight", r"layers.\1.self_attn_norm.weight"),
    Rule(_L + r"post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
    Rule(r"norm\.weight", "norm.weight"),
]


def decoder_architectures(prefix: str) -> dict[str, Architecture]:
    """`{prefix}Model`, `{prefix}ForCausalLM`, `{prefix}ForSequenceClassification`."""
    nested = prefixed(BASE_RULES, "model.", "model.")
    return {
        f"{prefix}Model": Architecture("DecoderModel", BASE_RULES),
        f"{prefix}ForCausalLM": Architecture(
            "DecoderForCausalLM", nested + [Rule(r"lm_head\.weight", "lm_head.weight")]
        ),
        f"{prefix}ForSequenceClassification": Architecture(
            "DecoderForSequenceClassification", nested + [Rule(r"score\.weight", "score.weight")]
        ),
    }


ARCHITECTURES = decoder_architectures("Llama")
RULES = ARCHITECTURES["LlamaForCausalLM"].rules + BASE_RULES
DROP = [r"(model\.)?rotary_emb\.(inv_freq|original_inv_freq)"]


def decoder_config(hf, **fields) -> DecoderConfig:
    """The swapformer config of a Llama-like HF config (`fields` add to or override it)."""
    rope = dict(hf.rope_parameters or {})
    rope.setdefault("rope_theta", 10000.0)
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        raise ValueError(
            f"{hf.model_type} rope_type={rope['rope_type']!r} cannot be converted; swapformer computes "
            f"{', '.join(map(repr, ROPE_TYPES))}"
        )
    values = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        intermediate_size=hf.intermediate_size,
        hidden_act=hf.hidden_act,
        mlp_type="gated",
        max_position_embeddings=hf.max_position_embeddings,
        position_embedding_type="rope",
        rope_parameters=rope,
        norm_type="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        pre_norm=True,
        embedding_norm=False,
        attention_bias=getattr(hf, "attention_bias", False),
        mlp_bias=getattr(hf, "mlp_bias", False),
        hidden_dropout=0.0,
        attention_dropout=float(hf.attention_dropout),
        initializer_range=hf.initializer_range,
        tie_word_embeddings=hf.tie_word_embeddings,
        pad_token_id=hf.pad_token_id,
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
    )
    values.update(fields)
    return DecoderConfig(**values, **label_fields(hf))


def hf_decoder_fields(cfg: DecoderConfig) -> dict:
    """The Llama-like HF config fields of a swapformer decoder config."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope_parameters),
        rms_norm_eps=cfg.norm_eps,
        attention_dropout=cfg.attention_dropout,
        initializer_range=cfg.initializer_range,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        **label_fields(cfg),
    )


def config_from_hf(hf) -> DecoderConfig:
    return decoder_config(hf)


def config_to_hf(cfg: DecoderConfig):
    from transformers import LlamaConfig

    return LlamaConfig(**hf_decoder_fields(cfg), attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
