"""DeepSeek-V3 (`DeepseekV3Model`, `DeepseekV3ForCausalLM`, `DeepseekV3ForSequenceClassification`) with
dense MLPs in every layer (`first_k_dense_replace >= num_hidden_layers`) -> swapformer `DecoderModel` and
heads with multi-head latent attention (`kv_lora_rank`, modeling/variants/mla.py): Llama's blocks otherwise
(pre-RMSNorm, RoPE, SwiGLU). The attention's parameter names are transformers' own. Mixture-of-experts
layers have no swapformer counterpart and are refused.
"""

from __future__ import annotations

from ..configuration.configuration_swapformer import DecoderConfig
from .family import Family, Fields, register
from .llama import DROP, decoder_architectures, decoder_config, hf_decoder_fields, rope_refusal
from .rules import Rule

_L = r"layers\.(\d+)\."
_ATTENTION = r"(q_proj|q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj|o_proj)"
BASE_RULES = [
    Rule(r"embed_tokens\.weight", "embed_tokens.weight"),
    Rule(_L + r"self_attn\." + _ATTENTION + r"\.(weight|bias)", r"layers.\1.self_attn.\2.\3"),
    Rule(_L + r"mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight"),
    Rule(_L + r"input_layernorm\.weight", r"layers.\1.self_attn_norm.weight"),
    Rule(_L + r"post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
    Rule(r"norm\.weight", "norm.weight"),
]
ARCHITECTURES = decoder_architectures("DeepseekV3", BASE_RULES)

MLA_FIELDS = Fields.parse(
    "kv_lora_rank q_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim rope_interleave"
)


def config_from_hf(hf) -> DecoderConfig:
    dense = hf.first_k_dense_replace
    if dense is None or dense < hf.num_hidden_layers:
        raise ValueError(
            f"deepseek_v3 with first_k_dense_replace={dense} < num_hidden_layers={hf.num_hidden_layers} has "
            "mixture-of-experts layers, which swapformer does not compute; only checkpoints whose every layer "
            "has a dense MLP (first_k_dense_replace >= num_hidden_layers) convert"
        )
    return decoder_config(
        hf,
        **MLA_FIELDS.from_hf(hf),
        head_dim=hf.qk_rope_head_dim,
        num_key_value_heads=hf.num_attention_heads,
        mlp_bias=False,
    )


def config_to_hf(cfg: DecoderConfig):
    from transformers import DeepseekV3Config

    if cfg.kv_lora_rank is None or cfg.mlp_bias:
        raise ValueError(
            f"Only decoders with multi-head latent attention and no MLP biases go back to DeepSeek-V3; this one has "
            f"kv_lora_rank={cfg.kv_lora_rank}, mlp_bias={cfg.mlp_bias}"
        )
    fields = {k: v for k, v in hf_decoder_fields(cfg).items() if k != "head_dim"}
    return DeepseekV3Config(
        **fields,
        **MLA_FIELDS.to_hf(cfg),
        attention_bias=cfg.attention_bias,
        first_k_dense_replace=cfg.num_hidden_layers,
    )


FAMILY = register(
    Family(
        "deepseek_v3",
        ARCHITECTURES,
        config_from_hf,
        config_to_hf,
        drop=DROP,
        long_refusal=rope_refusal("deepseek_v3"),
    )
)
