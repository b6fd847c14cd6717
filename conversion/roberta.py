"""RoBERTa (`RobertaModel` and heads) -> swapformer `EncoderModel` and heads: BERT's layers; positions
counted from padding_idx + 1 (the rows before it are set aside), one token type. `RobertaModel` keeps
its pooler (`add_pooling_layer=True`); the heads have none, and `RobertaForSequenceClassification`'s
own head (dropout, dense, tanh, dropout, out_proj) is swapformer's classifier without a pooler.

transformers' RoBERTa counts positions over tokens that are not `pad_token_id`; swapformer counts them
over `attention_mask`, so the converted model needs the attention mask whenever a batch is padded
(the tokenizer returns it). Its LM head applies `hidden_act` where RoBERTa's always uses GELU: a
masked LM with another activation is refused, naming the tensor.
"""

from __future__ import annotations

from ..configuration.configuration_swapformer import EncoderConfig
from .bert import (
    LAYER_RULES,
    POOLER_RULE,
    check_encoder,
    encoder_config,
    encoder_heads,
    hf_encoder_fields,
    positions_from_row,
)
from .family import Family, register
from .rules import ConversionError, Rule


def lm_head_check(family: str, encoder_class: str):
    """The check of a RoBERTa-style masked-LM head (RoBERTa, Longformer): its head applies GELU after
    `lm_head.dense` whatever `hidden_act` says, where swapformer's applies `hidden_act`."""

    def check(hf) -> None:
        if hf.hidden_act != "gelu":
            raise ConversionError(
                f"{family}ForMaskedLM's lm_head.dense cannot map: {family}'s LM head applies GELU after it whatever "
                f"hidden_act says, and swapformer's masked-LM head applies hidden_act={hf.hidden_act!r}. Convert the "
                f"encoder alone ({encoder_class}), or a checkpoint with hidden_act='gelu'"
            )

    return check


check_lm_head = lm_head_check("Roberta", "RobertaModel")

# The heads RoBERTa and Longformer share: the masked LM (dense, norm, tied decoder) and the classifier
# (dense, out_proj, no pooler).
MLM_RULES = [
    Rule(r"lm_head\.dense\.(weight|bias)", r"lm_head.dense.\1"),
    Rule(r"lm_head\.layer_norm\.(weight|bias)", r"lm_head.norm.\1"),
    Rule(r"lm_head\.decoder\.weight", "lm_head.decoder.weight"),
    # lm_head.bias is the decoder's bias under a second name (tied in transformers)
    Rule(r"lm_head\.(decoder\.)?bias", "lm_head.decoder.bias"),
]
CLASSIFIER_RULES = [Rule(r"classifier\.(dense|out_proj)\.(weight|bias)", r"classifier.\1.\2")]


def architectures(offset: int):
    """RoBERTa's classes for a position table whose first `offset` rows real tokens never read."""
    base = [*LAYER_RULES, positions_from_row(offset), POOLER_RULE]
    return {
        "Roberta" + suffix: arch
        for suffix, arch in encoder_heads(
            "roberta.",
            base,
            mlm_rules=MLM_RULES,
            seq_rules=CLASSIFIER_RULES,
            seq_pooler=False,
            mlm_check=check_lm_head,
        ).items()
    }


DROP = (r"(roberta\.)?embeddings\.position_ids", r"(roberta\.)?embeddings\.token_type_ids")


def position_offset(hf) -> int:
    return hf.pad_token_id + 1


def config_from_hf(hf) -> EncoderConfig:
    check_encoder(hf)
    if hf.pad_token_id is None:
        raise ValueError("RoBERTa needs pad_token_id: its positions start at pad_token_id + 1")
    return encoder_config(
        hf,
        max_position_embeddings=hf.max_position_embeddings - position_offset(hf),
        add_pooling_layer=False,  # only RobertaModel has one (its Architecture says so)
    )


def config_to_hf(cfg: EncoderConfig):
    from transformers import RobertaConfig

    fields = hf_encoder_fields(cfg)
    fields["max_position_embeddings"] += cfg.pad_token_id + 1
    return RobertaConfig(**fields)


def offset_family(model_type: str, architectures, config_from_hf, config_to_hf, drop, **fields) -> Family:
    """The Family of a RoBERTa-like model, whose `architectures(offset)` depend on where its
    position table starts (pad_token_id + 1)."""
    classes = lambda hf: architectures(position_offset(hf))  # noqa: E731
    return Family(model_type, architectures(2), config_from_hf, config_to_hf, drop, classes, **fields)


FAMILY = register(
    offset_family("roberta", architectures, config_from_hf, config_to_hf, DROP, stretchable=True)
)
ARCHITECTURES = FAMILY.architectures  # padding_idx=1, the usual
