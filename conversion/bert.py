"""BERT (`BertModel`) -> swapformer `EncoderModel`: a post-LN encoder with learned positions,
token types and an embedding LayerNorm."""

from __future__ import annotations

from ..configuration.configuration_swapformer import EncoderConfig
from .rules import Rule

_L = r"encoder\.layer\.(\d+)\."
RULES = [
    Rule(r"embeddings\.word_embeddings\.weight", "embed_tokens.weight"),
    Rule(r"embeddings\.position_embeddings\.weight", "embed_positions.weight"),
    Rule(r"embeddings\.token_type_embeddings\.weight", "token_type_embeddings.weight"),
    Rule(r"embeddings\.LayerNorm\.(weight|bias)", r"embed_norm.\1"),
    Rule(_L + r"attention\.self\.query\.(weight|bias)", r"layers.\1.self_attn.q_proj.\2"),
    Rule(_L + r"attention\.self\.key\.(weight|bias)", r"layers.\1.self_attn.k_proj.\2"),
    Rule(_L + r"attention\.self\.value\.(weight|bias)", r"layers.\1.self_attn.v_proj.\2"),
    Rule(_L + r"attention\.output\.dense\.(weight|bias)", r"layers.\1.self_attn.o_proj.\2"),
    Rule(_L + r"attention\.output\.LayerNorm\.(weight|bias)", r"layers.\1.self_attn_norm.\2"),
    Rule(_L + r"intermediate\.dense\.(weight|bias)", r"layers.\1.mlp.up_proj.\2"),
    Rule(_L + r"output\.dense\.(weight|bias)", r"layers.\1.mlp.down_proj.\2"),
    Rule(_L + r"output\.LayerNorm\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
]
# The base encoder has no pooler (classification heads carry their own dense layer).
DROP = [r"pooler\.dense\.(weight|bias)", r"embeddings\.position_ids"]


def config_from_hf(hf) -> EncoderConfig:
    return EncoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        intermediate_size=hf.intermediate_size,
        hidden_act=hf.hidden_act,
        max_position_embeddings=hf.max_position_embeddings,
        type_vocab_size=hf.type_vocab_size,
        position_embedding_type="learned",
        norm_type="layernorm",
        norm_eps=hf.layer_norm_eps,
        pre_norm=False,
        embedding_norm=True,
        attention_bias=True,
        mlp_bias=True,
        hidden_dropout=hf.hidden_dropout_prob,
        attention_dropout=hf.attention_probs_dropout_prob,
        initializer_range=hf.initializer_range,
        pad_token_id=hf.pad_token_id,
        tie_word_embeddings=True,
    )
