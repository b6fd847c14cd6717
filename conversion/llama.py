"""Llama (`LlamaModel`, `LlamaForCausalLM`, `LlamaForSequenceClassification`) -> swapformer
`DecoderModel` and heads: pre-RMSNorm, RoPE, SwiGLU, GQA, no biases. The parameter names are already
HF-standard. Mistral (mistral.py) is the same with a sliding window."""

from __future__ import annotations

from ..configuration.configuration_swapformer import ROPE_TYPES, DecoderConfig
from .family import Architecture, Family, Fields, label_fields, register
from .rules import Rule, prefixed

_L = r"layers\.(\d+)\."
BASE_RULES = [
    Rule(r"embed_tokens\.weight", "embed_tokens.weight"),
    Rule(_L + r"self_attn\.(q|k|v|o)_proj\.(weight|bias)", r"layers.\1.self_attn.\2_proj.\3"),
    Rule(_L + r"mlp\.(gate|up|down)_proj\.(weight|bias)", r"layers.\1.mlp.\2_proj.\3"),
    Rule(_L + r"input_layernorm\.weight", r"layers.\1.self_attn_norm.weight"),
    Rule(_L + r"post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
    Rule(r"norm\.weight", "norm.weight"),
]


def decoder_architectures(
    prefix: str, base_rules: list[Rule] = BASE_RULES, nest: str = "model.", causal_lm: str = "ForCausalLM"
) -> dict[str, Architecture]:
    """`{prefix}Model`, `{prefix}{causal_lm}`, `{prefix}ForSequenceClassification`, whose heads keep
    the base model under `nest` (swapformer's under `model.`)."""
    nested = prefixed(base_rules, nest, "model.")
    return {
        f"{prefix}Model": Architecture("DecoderModel", base_rules),
        f"{prefix}{causal_lm}": Architecture(
            "DecoderForCausalLM", nested + [Rule(r"lm_head\.weight", "lm_head.weight")]
        ),
        f"{prefix}ForSequenceClassification": Architecture(
            "DecoderForSequenceClassification", nested + [Rule(r"score\.weight", "score.weight")]
        ),
    }


ARCHITECTURES = decoder_architectures("Llama")
DROP = (r"(model\.)?rotary_emb\.(inv_freq|original_inv_freq)",)


# What Llama-like configs (Llama, Mistral) carry as it is.
DECODER_FIELDS = Fields.parse(
    "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "intermediate_size hidden_act max_position_embeddings norm_eps=rms_norm_eps initializer_range "
    "tie_word_embeddings pad_token_id bos_token_id eos_token_id"
)


def decoder_config(hf, table: Fields = DECODER_FIELDS, **fields) -> DecoderConfig:
    """The swapformer config of a Llama-like HF config whose fields `table` names (`fields` add to or
    override it)."""
    rope = dict(hf.rope_parameters or {})
    rope.setdefault("rope_theta", 10000.0)
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        raise ValueError(
            f"{hf.model_type} rope_type={rope['rope_type']!r} cannot be converted; swapformer computes "
            f"{', '.join(map(repr, ROPE_TYPES))}"
        )
    values = {
        **table.from_hf(hf),
        **dict(mlp_type="gated", position_embedding_type="rope", norm_type="rmsnorm", pre_norm=True),
        "rope_parameters": rope,
        "embedding_norm": False,
        "attention_bias": getattr(hf, "attention_bias", False),
        "mlp_bias": getattr(hf, "mlp_bias", False),
        "hidden_dropout": 0.0,
        "attention_dropout": float(hf.attention_dropout),
        **fields,
    }
    return DecoderConfig(**values, **label_fields(hf))


def hf_decoder_fields(cfg: DecoderConfig, table: Fields = DECODER_FIELDS) -> dict:
    """The Llama-like HF config fields (named by `table`) of a swapformer decoder config."""
    rope = dict(cfg.rope_parameters)
    return {
        **table.to_hf(cfg),
        "rope_parameters": rope,
        "attention_dropout": cfg.attention_dropout,
        **label_fields(cfg),
    }


def rope_refusal(name: str) -> str:
    """Why `stretch` refuses a RoPE family, and what extends its context instead."""
    return (
        f"{name} has RoPE positions and no position table to copy; to extend its context, convert without these "
        "flags and load the converted folder with RoPE scaling, e.g. from_pretrained(out, rope_parameters="
        "{'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': N, 'rope_theta': the source's}, "
        "max_position_embeddings=4 * N)"
    )


def config_from_hf(hf) -> DecoderConfig:
    return decoder_config(hf)


def config_to_hf(cfg: DecoderConfig):
    from transformers import LlamaConfig

    return LlamaConfig(**hf_decoder_fields(cfg), attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)


FAMILY = register(
    Family(
        "llama", ARCHITECTURES, config_from_hf, config_to_hf, drop=DROP, long_refusal=rope_refusal("llama")
    )
)
