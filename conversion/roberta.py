"""RoBERTa (`RobertaModel` and heads) -> swapformer `EncoderModel` and heads: BERT's layers; positions
counted from padding_idx + 1 (the rows before it are set aside), one token type.

transformers' RoBERTa counts positions over tokens that are not `pad_token_id`; swapformer counts them
over `attention_mask`, so the converted model needs the attention mask whenever a batch is padded
(the tokenizer returns it). Its LM head applies `hidden_act` where RoBERTa's always uses GELU: a
checkpoint with another activation fails verification instead of converting wrongly.
"""

from __future__ import annotations

from ..configuration.configuration_swapformer import EncoderConfig
from .bert import (
    LAYER_RULES,
    check_encoder,
    encoder_config,
    encoder_heads,
    hf_encoder_fields,
    positions_from_row,
)
from .rules import ASIDE, Rule


def architectures(offset: int):
    """RoBERTa's classes for a position table whose first `offset` rows real tokens never read."""
    base = [
        *LAYER_RULES,
        positions_from_row(offset),
        Rule(r"pooler\.dense\.(weight|bias)", ASIDE + r"pooler.dense.\1"),
    ]
    return {
        "Roberta" + suffix: arch
        for suffix, arch in encoder_heads(
            "roberta.",
            base,
            mlm_rules=[
                Rule(r"lm_head\.dense\.(weight|bias)", r"lm_head.dense.\1"),
                Rule(r"lm_head\.layer_norm\.(weight|bias)", r"lm_head.norm.\1"),
                Rule(r"lm_head\.decoder\.weight", "lm_head.decoder.weight"),
                # lm_head.bias is the decoder's bias under a second name (tied in transformers)
                Rule(r"lm_head\.(decoder\.)?bias", "lm_head.decoder.bias"),
            ],
            seq_rules=[Rule(r"classifier\.(dense|out_proj)\.(weight|bias)", r"classifier.\1.\2")],
        ).items()
    }


ARCHITECTURES = architectures(2)  # padding_idx=1, the usual
DROP = [r"(roberta\.)?embeddings\.position_ids", r"(roberta\.)?embeddings\.token_type_ids"]


def position_offset(hf) -> int:
    return hf.pad_token_id + 1


def config_from_hf(hf) -> EncoderConfig:
    check_encoder(hf)
    if hf.pad_token_id is None:
        raise ValueError("RoBERTa needs pad_token_id: its positions start at pad_token_id + 1")
    return encoder_config(hf, max_position_embeddings=hf.max_position_embeddings - position_offset(hf))


def config_to_hf(cfg: EncoderConfig):
    from transformers import RobertaConfig

    fields = hf_encoder_fields(cfg)
    fields["max_position_embeddings"] += cfg.pad_token_id + 1
    return RobertaConfig(**fields)
