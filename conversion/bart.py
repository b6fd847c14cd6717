"""BART (`BartModel`, `BartForConditionalGeneration`) -> swapformer `Seq2SeqModel` /
`Seq2SeqForConditionalGeneration`: post-LN, learned positions offset by 2, embedding LayerNorm; the LM
adds BART's `final_logits_bias` buffer to its logits (`add_final_logits_bias`)."""

from __future__ import annotations

from ..configuration.configuration_swapformer import Seq2SeqConfig
from .family import Architecture, Family, Fields, label_fields, register
from .rules import ASIDE, Rule, prefixed, renames, split_rows

BASE_RULES = [
    Rule(r"shared\.weight", "shared.weight"),
    # BART's position table has two extra leading rows (its positions start at 2), set aside.
    Rule(
        r"(encoder|decoder)\.embed_positions\.weight",
        (r"\1.embed_positions.weight", ASIDE + r"\1.embed_positions.leading_rows"),
        split_rows(2),
    ),
    Rule(r"(encoder|decoder)\.layernorm_embedding\.(weight|bias)", r"\1.embed_norm.\2"),
    *renames(
        r"(encoder|decoder)\.layers\.(\d+)\.",
        r"\1.layers.\2.",
        "self_attn.q_proj self_attn.k_proj self_attn.v_proj self_attn.out_proj=self_attn.o_proj "
        "self_attn_layer_norm=self_attn_norm encoder_attn.q_proj=cross_attn.q_proj encoder_attn.k_proj=cross_attn.k_proj "
        "encoder_attn.v_proj=cross_attn.v_proj encoder_attn.out_proj=cross_attn.o_proj "
        "encoder_attn_layer_norm=cross_attn_norm fc1=mlp.up_proj fc2=mlp.down_proj final_layer_norm=mlp_norm",
    ),
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
# encoder/decoder.embed_tokens are views of `shared`.
DROP = (r"(model\.)?(encoder|decoder)\.embed_tokens\.weight",)


FIELDS = Fields.parse(
    "vocab_size hidden_size=d_model num_hidden_layers=encoder_layers decoder_layers "
    "num_attention_heads=encoder_attention_heads intermediate_size=encoder_ffn_dim hidden_act=activation_function "
    "max_position_embeddings scale_embeddings=scale_embedding hidden_dropout=dropout attention_dropout "
    "activation_dropout initializer_range=init_std tie_word_embeddings pad_token_id bos_token_id eos_token_id "
    "decoder_start_token_id"
)


def config_from_hf(hf) -> Seq2SeqConfig:
    if hf.encoder_attention_heads != hf.decoder_attention_heads or hf.encoder_ffn_dim != hf.decoder_ffn_dim:
        raise ValueError(
            "swapformer's encoder and decoder share head count and MLP width; this BART has "
            f"encoder_attention_heads={hf.encoder_attention_heads}, decoder_attention_heads={hf.decoder_attention_heads}, "
            f"encoder_ffn_dim={hf.encoder_ffn_dim}, decoder_ffn_dim={hf.decoder_ffn_dim}"
        )
    values = dict(position_embedding_type="learned", norm_type="layernorm", norm_eps=1e-5, pre_norm=False)
    return Seq2SeqConfig(
        **FIELDS.from_hf(hf),
        **values,
        embedding_norm=True,
        attention_bias=True,
        mlp_bias=True,
        shared_embeddings=True,
        **label_fields(hf),
    )


def config_to_hf(cfg: Seq2SeqConfig):
    from transformers import BartConfig

    decoder = {"decoder_attention_heads": cfg.num_attention_heads, "decoder_ffn_dim": cfg.intermediate_size}
    return BartConfig(**FIELDS.to_hf(cfg), **decoder, **label_fields(cfg))


LONG_REFUSAL = (
    "bart is an encoder-decoder; copying its position tables (as LED did) is not implemented, only "
    "encoders (bert, roberta) stretch"
)
FAMILY = register(
    Family("bart", ARCHITECTURES, config_from_hf, config_to_hf, drop=DROP, long_refusal=LONG_REFUSAL)
)
