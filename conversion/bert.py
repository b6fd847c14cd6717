"""BERT (`BertModel` and its masked-LM, sequence, token classification and question answering heads)
-> swapformer `EncoderModel` and heads: a post-LN encoder with learned positions, token types, an
embedding LayerNorm and BERT's pooler (`add_pooling_layer`), which `BertModel` returns and
`BertForSequenceClassification` classifies. RoBERTa (roberta.py) has the same layers under other
names for its heads."""

from __future__ import annotations

from ..configuration.configuration_swapformer import EncoderConfig
from .family import Architecture, Family, Fields, label_fields, register
from .rules import ASIDE, ConversionError, Rule, prefixed, renames, split_rows

POOLER_RULE = Rule(r"pooler\.dense\.(weight|bias)", r"pooler.dense.\1")

LAYER_RULES = [
    Rule(r"embeddings\.word_embeddings\.weight", "embed_tokens.weight"),
    Rule(r"embeddings\.token_type_embeddings\.weight", "token_type_embeddings.weight"),
    Rule(r"embeddings\.LayerNorm\.(weight|bias)", r"embed_norm.\1"),
    *renames(
        r"encoder\.layer\.(\d+)\.",
        r"layers.\1.",
        "attention.self.query=self_attn.q_proj attention.self.key=self_attn.k_proj "
        "attention.self.value=self_attn.v_proj attention.output.dense=self_attn.o_proj "
        "attention.output.LayerNorm=self_attn_norm intermediate.dense=mlp.up_proj output.dense=mlp.down_proj "
        "output.LayerNorm=mlp_norm",
    ),
]
BASE_RULES = [
    *LAYER_RULES,
    Rule(r"embeddings\.position_embeddings\.weight", "embed_positions.weight"),
    POOLER_RULE,
]


def positions_from_row(offset: int) -> Rule:
    """A learned position table whose first `offset` rows are never read by real tokens (RoBERTa's
    positions start at padding_idx + 1): those rows are set aside."""
    return Rule(
        r"embeddings\.position_embeddings\.weight",
        ("embed_positions.weight", ASIDE + "embed_positions.leading_rows"),
        split_rows(offset),
    )


def encoder_heads(
    prefix: str,
    base_rules: list[Rule],
    mlm_rules: list[Rule],
    seq_rules: list[Rule],
    seq_pooler: bool,
    mlm_check=None,
):
    """The five encoder classes, for a family whose heads nest the encoder under `prefix`. Head rules
    come first: they win over the base rules. The base model has a pooler; the sequence classifier
    reads it when `seq_pooler` (BERT), and has a head of its own otherwise (RoBERTa)."""
    nested = prefixed(base_rules, prefix, "model.")
    return {
        "Model": Architecture("EncoderModel", base_rules, {"add_pooling_layer": True}),
        "ForMaskedLM": Architecture("EncoderForMaskedLM", mlm_rules + nested, check=mlm_check),
        "ForSequenceClassification": Architecture(
            "EncoderForSequenceClassification", seq_rules + nested, {"add_pooling_layer": seq_pooler}
        ),
        "ForTokenClassification": Architecture(
            "EncoderForTokenClassification", [Rule(r"classifier\.(weight|bias)", r"classifier.\1"), *nested]
        ),
        "ForQuestionAnswering": Architecture(
            "EncoderForQuestionAnswering", [Rule(r"qa_outputs\.(weight|bias)", r"qa_outputs.\1"), *nested]
        ),
    }


_P = r"cls\.predictions\."
# BERT's masked-LM head (BigBird has the same one)
MLM_RULES = [
    Rule(_P + r"transform\.dense\.(weight|bias)", r"lm_head.dense.\1"),
    Rule(_P + r"transform\.LayerNorm\.(weight|bias)", r"lm_head.norm.\1"),
    Rule(_P + r"decoder\.weight", "lm_head.decoder.weight"),
    # cls.predictions.bias is the decoder's bias under a second name (tied in transformers)
    Rule(_P + r"(decoder\.)?bias", "lm_head.decoder.bias"),
]
ARCHITECTURES = {
    "Bert" + suffix: arch
    for suffix, arch in encoder_heads(
        "bert.",
        BASE_RULES,
        mlm_rules=MLM_RULES,
        seq_rules=[Rule(r"classifier\.(weight|bias)", r"classifier.\1")],
        seq_pooler=True,
    ).items()
}
RULES = ARCHITECTURES["BertModel"].rules
# Buffers transformers rebuilds.
DROP = (r"(bert\.)?embeddings\.position_ids", r"(bert\.)?embeddings\.token_type_ids")


# What BERT-like configs (BERT, RoBERTa, Longformer, BigBird) carry as it is, and what a BERT-like
# encoder always is in swapformer's terms.
ENCODER_FIELDS = Fields.parse(
    "vocab_size hidden_size num_hidden_layers num_attention_heads intermediate_size hidden_act "
    "max_position_embeddings type_vocab_size initializer_range pad_token_id norm_eps=layer_norm_eps "
    "hidden_dropout=hidden_dropout_prob attention_dropout=attention_probs_dropout_prob"
)
# BERT's pooler belongs to the architecture (add_pooling_layer): a sequence classifier later fine-tuned
# from any converted BERT reads it, as BertForSequenceClassification would (heads without it skip it).
ENCODER_VALUES = dict(
    position_embedding_type="learned", norm_type="layernorm", pre_norm=False, embedding_norm=True,
    attention_bias=True, mlp_bias=True, tie_word_embeddings=True, add_pooling_layer=True,
)  # fmt: skip


def encoder_config(hf, **fields) -> EncoderConfig:
    """The swapformer config of a BERT-like HF config (`fields` override)."""
    values = {
        **ENCODER_FIELDS.from_hf(hf),
        **ENCODER_VALUES,
        "classifier_dropout": getattr(hf, "classifier_dropout", None),  # Longformer has none
        **fields,
    }
    return EncoderConfig(**values, **label_fields(hf))


def hf_encoder_fields(cfg: EncoderConfig, embedding_dropout_first: bool = False) -> dict:
    """The BERT-like HF config fields of a swapformer encoder config, whose family drops out the
    embeddings after their LayerNorm (BERT) or before it (`embedding_dropout_first`, BigBird)."""
    if cfg.embedding_dropout_first != embedding_dropout_first:
        raise ConversionError(
            f"embedding_dropout_first={cfg.embedding_dropout_first} cannot map: this family drops out the embeddings "
            f"{'before' if embedding_dropout_first else 'after'} their LayerNorm (the model would train differently); "
            f"set embedding_dropout_first={embedding_dropout_first}"
        )
    return {**ENCODER_FIELDS.to_hf(cfg), "classifier_dropout": cfg.classifier_dropout, **label_fields(cfg)}


def check_encoder(hf) -> None:
    kind = getattr(hf, "position_embedding_type", "absolute")
    if kind not in (None, "absolute"):
        raise ValueError(
            f"{hf.model_type} with position_embedding_type={kind!r} is not supported; only 'absolute' positions convert"
        )
    if getattr(hf, "is_decoder", False) or getattr(hf, "add_cross_attention", False):
        raise ValueError(
            f"{hf.model_type} configured as a decoder (is_decoder/add_cross_attention) does not convert; "
            "swapformer's encoder is bidirectional"
        )


def config_from_hf(hf) -> EncoderConfig:
    check_encoder(hf)
    return encoder_config(hf)


def config_to_hf(cfg: EncoderConfig):
    from transformers import BertConfig

    return BertConfig(**hf_encoder_fields(cfg))


FAMILY = register(Family("bert", ARCHITECTURES, config_from_hf, config_to_hf, drop=DROP, stretchable=True))
