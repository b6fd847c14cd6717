"""Llama (`LlamaModel`, `LlamaForCausalLM`) -> swapformer `DecoderModel` / `DecoderForCausalLM`:
pre-RMSNorm, RoPE, SwiGLU, GQA, no biases. The parameter names are already HF-standard."""

from __future__ import annotations

from ..configuration.configuration_swapformer import DecoderConfig
from .rules import Rule

_L = r"layers\.(\d+)\."
BASE_RULES = [
    Rule(r"embed_tokens\.weight", "embed_tokens.weight"),
    Rule(_L + r"self_attn\.(q|k|v|o)_proj\.(weight|bias)", r"layers.\1.self_attn.\2_proj.\3"),
    Rule(_L + r"mlp\.(gate|up|down)_proj\.(weight|bias)", r"layers.\1.mlp.\2_proj.\3"),
    Rule(_L + r"input_layernorm\.weight", r"layers.\1.self_attn_norm.weight"),
    Rule(_L + r"post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
    Rule(r"norm\.weight", "norm.weight"),
]
# Keys of LlamaForCausalLM: the base model under `model.`, plus the LM head.
RULES = (
    [Rule("model\\." + r.pattern, "model." + r.replacement, r.transform) for r in BASE_RULES]
    + [Rule(r"lm_head\.weight", "lm_head.weight")]
    + BASE_RULES
)
DROP = [r"(model\.)?rotary_emb\.(inv_freq|original_inv_freq)"]


def config_from_hf(hf) -> DecoderConfig:
    rope = hf.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"Llama rope_type={rope['rope_type']!r} is not supported yet; only the default RoPE is"
        )
    return DecoderConfig(
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
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        norm_type="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        pre_norm=True,
        embedding_norm=False,
        attention_bias=hf.attention_bias,
        mlp_bias=hf.mlp_bias,
        hidden_dropout=0.0,
        attention_dropout=float(hf.attention_dropout),
        initializer_range=hf.initializer_range,
        tie_word_embeddings=hf.tie_word_embeddings,
        pad_token_id=hf.pad_token_id,
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
    )
