"""BART (`BartModel`, `BartForConditionalGeneration`) -> swapformer `Seq2SeqModel` /
`Seq2SeqForConditionalGeneration`: post-LN, learned positions offset by 2, embedding LayerNorm; the LM
adds BART's `final_logits_bias` buffer to its logits (`add_final_logits_bias`)."""

from __future__ import annotations

from ..configuration.configuration_swapformer import Seq2SeqConfig
from .bert import label_fields
from .rules import ASIDE, Architecture, Rule, prefixed, split_rows

_S = r"(encoder|decoder)\.layers\.(\d+)\."
BASE_RULES = [
    Rule(r"shared\.weight", "shared.weight"),
    # BART's position table has two extra leading rows (its positions start at 2), set aside.
    Rule(
        r"(encoder|decoder)\.embed_positions\.weight",
        (r"\1.embed_positions.weight", ASIDE + r"\1.embed_positions.leading_rows"),
        split_rows(2),
    ),
    Rule(r"(encoder|decoder)\.layernorm_embedding\.(weight|bias)", r"\1.embed_norm.\2"),
    Rule(_S + r"self_attn\.(q|k|v)_proj\.(weight|bias)", r"\1.layers.\2.self_attn.\3_proj.\4"),
    Rule(_S + r"self_attn\.out_proj\.(weight|bias)", r"\1.layers.\2.self_attn.o_proj.\3"),
    Rule(_S + r"self_attn_layer_norm\.(weight|bias)", r"\1.layers.\2.self_attn_norm.\3"),
    Rule(_S + r"encoder_attn\.(q|k|v)_proj\.(weight|bias)", r"\1.layers.\2.cross_attn.\3_proj.\4"),
    Rule(_S + r"encoder_attn\.out_proj\.(weight|bias)", r"\1.layers.\2.cross_attn.o_proj.\3"),
    Rule(_S + r"encoder_attn_layer_norm\.(weight|bias)", r"\1.layers.\2.cross_attn_norm.\3"),
    Rule(_S + r"fc1\.(weight|bias)", r"\1.layers.\2.mlp.up_proj.\3"),
    Rule(_S + r"fc2\.(weight|bias)", r"\1.layers.\2.mlp.down_proj.\3"),
    Rule(_S + r"final_layer_norm\.(weight|bias)", r"\1.layers.\2.mlp_norm.\3"),
]
ARCHITECTURES = {
    "BartModel": Architecture("Seq2SeqModel", BASE_RULES),
    "BartForConditionalGeneration": Architecture(
        "Seq2SeqForConditionalGeneration",
        prefixed(BASE_RULES, "model.", "model.")
        + [
            Rule(r"lm_head\.weight", "lm_head.weight"),
            Rule(r"final_logits_bias", "final_logits_bias"),
        ],
        {"add_final_logits_bias": True},
    ),
}
RULES = ARCHITECTURES["BartForConditionalGeneration"].rules + BASE_RULES
# encoder/decoder.embed_tokens are views of `shared`.
DROP = [r"(model\.)?(encoder|decoder)\.embed_tokens\.weight"]


def config_from_hf(hf) -> Seq2SeqConfig:
    if hf.encoder_attention_heads != hf.decoder_attention_heads or hf.encoder_ffn_dim != hf.decoder_ffn_dim:
        raise ValueError(
            "swapformer's encoder and decoder share head count and MLP width; this BART has "
            f"encoder_attention_heads={hf.encoder_attention_heads}, decoder_attention_heads={hf.decoder_attention_heads}, "
            f"encoder_ffn_dim={hf.encoder_ffn_dim}, decoder_ffn_dim={hf.decoder_ffn_dim}"
        )
    return Seq2SeqConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.d_model,
        num_hidden_layers=hf.encoder_layers,
        decoder_layers=hf.decoder_layers,
        num_attention_heads=hf.encoder_attention_heads,
        intermediate_size=hf.encoder_ffn_dim,
        hidden_act=hf.activation_function,
        max_position_embeddings=hf.max_position_embeddings,
        position_embedding_type="learned",
        norm_type="layernorm",
        norm_eps=1e-5,
        pre_norm=False,
        embedding_norm=True,
        scale_embeddings=hf.scale_embedding,
        attention_bias=True,
        mlp_bias=True,
        hidden_dropout=hf.dropout,
        attention_dropout=hf.attention_dropout,
        activation_dropout=hf.activation_dropout,
        initializer_range=hf.init_std,
        shared_embeddings=True,
        tie_word_embeddings=hf.tie_word_embeddings,
        pad_token_id=hf.pad_token_id,
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        decoder_start_token_id=hf.decoder_start_token_id,
        **label_fields(hf),
    )


def config_to_hf(cfg: Seq2SeqConfig):
    from transformers import BartConfig

    return BartConfig(
        vocab_size=cfg.vocab_size,
        d_model=cfg.hidden_size,
        encoder_layers=cfg.num_hidden_layers,
        decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.num_attention_heads,
        decoder_attention_heads=cfg.num_attention_heads,
        encoder_ffn_dim=cfg.intermediate_size,
        decoder_ffn_dim=cfg.intermediate_size,
        activation_function=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        scale_embedding=cfg.scale_embeddings,
        dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        activation_dropout=cfg.activation_dropout,
        init_std=cfg.initializer_range,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        decoder_start_token_id=cfg.decoder_start_token_id,
        **label_fields(cfg),
    )
