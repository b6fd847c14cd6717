"""T5 (`T5Model`, `T5ForConditionalGeneration`; v1.0 and v1.1) -> swapformer `Seq2SeqModel` /
`Seq2SeqForConditionalGeneration`.

T5 (https://arxiv.org/abs/1910.10683) is pre-norm with an RMS norm that has no bias and no mean
(`T5LayerNorm`, swapformer's `rmsnorm`), no biases anywhere, unscaled scores (`attention_scale=1.0`),
and no absolute positions: a bucketed relative bias per head, held by the first block of each stack
and added in every layer (swapformer keeps one `relative_attention_bias` per stack), bidirectional
buckets in the encoder and causal ones in the decoder, none in cross-attention.
v1.0: ReLU MLP, output projection tied to the embedding and the decoder output scaled by
d_model ** -0.5 (`scale_decoder_outputs`). v1.1: gated-GELU MLP (`wi_0` the gate, `wi_1` the up
projection), a separate `lm_head`, no scaling.
"""

from __future__ import annotations

from ..configuration.configuration_swapformer import Seq2SeqConfig
from .family import Architecture, Family, Fields, register
from .rules import Rule, prefixed

_B = r"(encoder|decoder)\.block\.(\d+)\."
_MLP = r"layer\.(1|2)\.DenseReluDense\."  # layer 1 in the encoder, 2 in the decoder (after cross-attention)
BASE_RULES = [
    Rule(r"shared\.weight", "shared.weight"),
    Rule(
        r"(encoder|decoder)\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.weight",
        r"\1.relative_attention_bias.weight",
    ),
    Rule(_B + r"layer\.0\.SelfAttention\.(q|k|v|o)\.weight", r"\1.layers.\2.self_attn.\3_proj.weight"),
    Rule(_B + r"layer\.0\.layer_norm\.weight", r"\1.layers.\2.self_attn_norm.weight"),
    Rule(
        r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.(q|k|v|o)\.weight",
        r"decoder.layers.\1.cross_attn.\2_proj.weight",
    ),
    Rule(r"decoder\.block\.(\d+)\.layer\.1\.layer_norm\.weight", r"decoder.layers.\1.cross_attn_norm.weight"),
    Rule(_B + _MLP + r"wi\.weight", r"\1.layers.\2.mlp.up_proj.weight"),
    Rule(_B + _MLP + r"wi_0\.weight", r"\1.layers.\2.mlp.gate_proj.weight"),
    Rule(_B + _MLP + r"wi_1\.weight", r"\1.layers.\2.mlp.up_proj.weight"),
    Rule(_B + _MLP + r"wo\.weight", r"\1.layers.\2.mlp.down_proj.weight"),
    Rule(_B + r"layer\.(1|2)\.layer_norm\.weight", r"\1.layers.\2.mlp_norm.weight"),
    Rule(r"(encoder|decoder)\.final_layer_norm\.weight", r"\1.norm.weight"),
]
# T5ForConditionalGeneration has no `model.` level; swapformer's LM keeps its base model under `model.`.
ARCHITECTURES = {
    "T5Model": Architecture("Seq2SeqModel", BASE_RULES),
    "T5ForConditionalGeneration": Architecture(
        "Seq2SeqForConditionalGeneration",
        prefixed(BASE_RULES, "", "model.") + [Rule(r"lm_head\.weight", "lm_head.weight")],
    ),
}
# encoder/decoder.embed_tokens are views of `shared`.
DROP = (r"(encoder|decoder)\.embed_tokens\.weight",)


FIELDS = Fields.parse(
    "vocab_size hidden_size=d_model num_hidden_layers=num_layers decoder_layers=num_decoder_layers "
    "num_attention_heads=num_heads head_dim=d_kv intermediate_size=d_ff relative_attention_num_buckets "
    "relative_attention_max_distance norm_eps=layer_norm_epsilon hidden_dropout=dropout_rate pad_token_id "
    "eos_token_id decoder_start_token_id"
)
# What every T5 is in swapformer's terms; a config without these values has no T5.
T5_VALUES = dict(
    position_embedding_type="relative_bias", norm_type="rmsnorm", pre_norm=True, attention_bias=False,
    mlp_bias=False, attention_scale=1.0, shared_embeddings=True, embedding_norm=False, scale_embeddings=False,
)  # fmt: skip


def config_from_hf(hf) -> Seq2SeqConfig:
    return Seq2SeqConfig(
        **FIELDS.from_hf(hf),
        **T5_VALUES,
        hidden_act=hf.dense_act_fn,
        mlp_type="gated" if hf.is_gated_act else "mlp",
        attention_dropout=hf.dropout_rate,
        activation_dropout=hf.dropout_rate,
        final_dropout=True,  # T5Stack applies its dropout again after the final layer norm
        # whether the LM head really shares the embedding is read from the weights by the converter
        tie_word_embeddings=True,
        scale_decoder_outputs=bool(hf.scale_decoder_outputs),
    )


def config_to_hf(cfg: Seq2SeqConfig):
    from transformers import T5Config

    if wrong := {k: getattr(cfg, k) for k, v in T5_VALUES.items() if getattr(cfg, k) != v}:
        raise ValueError(f"This seq2seq config cannot be a T5: it has {wrong}; T5 needs {T5_VALUES}")
    act = cfg.hidden_act
    if cfg.mlp_type == "gated":
        # transformers reads "gated-gelu" as gelu_new (tanh GELU), so an exact GELU gate has no T5 name
        if act == "gelu":
            raise ValueError(
                "T5 has no gated MLP with the exact GELU (hidden_act='gelu'); 'gated-gelu' means gelu_new"
            )
        act = "gated-gelu" if act == "gelu_new" else f"gated-{act}"
    # transformers reads tie_word_embeddings as "scale the decoder output" and ties the LM head unless
    # the checkpoint holds a different one
    return T5Config(**FIELDS.to_hf(cfg), feed_forward_proj=act, tie_word_embeddings=cfg.scale_decoder_outputs)


LONG_REFUSAL = (
    "t5 has a relative position bias and no table of absolute positions: it already runs on longer "
    "inputs as it is"
)
FAMILY = register(
    Family("t5", ARCHITECTURES, config_from_hf, config_to_hf, drop=DROP, long_refusal=LONG_REFUSAL)
)
