"""BigBird (`BigBirdModel`, `BigBirdForMaskedLM`, `BigBirdForTokenClassification`) with
`attention_type="original_full"` -> swapformer `EncoderModel` and heads: BERT's post-LN encoder with
full attention layers, learned positions from 0, token types, and `rescale_embeddings` as
`scale_embeddings`, and its embedding dropout before the LayerNorm (`embedding_dropout_first`). The pooler is a bare linear layer (`pooler`, not BERT's `pooler.dense`); the
masked-LM and token classifiers hold one too and never read it, so there it is kept aside.

`attention_type="block_sparse"` is refused: its pattern is not one swapformer's layer types express.
transformers' block-sparse attention (https://arxiv.org/abs/2007.14062) works on blocks of `block_size`
tokens: a query block sees whole key blocks (itself and one block on each side, so the reach of a token
depends on where it sits in its block, up to 2 * block_size - 1 tokens away), the first and the last
block are global (the last block of the batch's padded length), the second and second-to-last query
blocks see other fixed blocks, and the random blocks are drawn per head from numpy's global generator
reseeded with the layer index at every training forward (one layout per layer and head), and in eval
mode are all block 0 (whose keys then enter the softmax once more per random block). swapformer's `bigbird_attention` has a token window, global leading
tokens, and one seeded random layout shared by all heads and by training and eval; a converted model
would compute another function. Such a checkpoint converts as `attention_type="original_full"` (the
same weights, full attention; what BigBirdModel itself does for inputs too short for block-sparse).
BigBird's sequence classifier (whose head applies `hidden_act` where swapformer's applies tanh) and
question-answering head (a head of its own) do not convert.
"""

from __future__ import annotations

import dataclasses

from ..configuration.configuration_swapformer import EncoderConfig
from .bert import LAYER_RULES, MLM_RULES, check_encoder, encoder_config, encoder_heads, hf_encoder_fields
from .family import Family, register
from .rules import ASIDE, ConversionError, Rule

BASE_RULES = [
    *LAYER_RULES,
    Rule(r"embeddings\.position_embeddings\.weight", "embed_positions.weight"),
    Rule(r"pooler\.(weight|bias)", r"pooler.dense.\1"),
]
_HEADS = encoder_heads(
    "bert.",
    BASE_RULES,
    mlm_rules=MLM_RULES,
    seq_rules=[],
    seq_pooler=True,
)
# BigBirdForMaskedLM and BigBirdForTokenClassification hold a pooler their outputs never read: kept aside.
_UNREAD_POOLER = Rule(r"bert\.pooler\.(weight|bias)", ASIDE + r"model.pooler.dense.\1")
ARCHITECTURES = {
    "BigBirdModel": _HEADS["Model"],
    **{
        "BigBird" + s: dataclasses.replace(_HEADS[s], rules=[_UNREAD_POOLER, *_HEADS[s].rules])
        for s in ("ForMaskedLM", "ForTokenClassification")
    },
}
DROP = (r"(bert\.)?embeddings\.position_ids", r"(bert\.)?embeddings\.token_type_ids")


def check_big_bird(hf) -> None:
    if hf.attention_type != "original_full":
        raise ConversionError(
            f"BigBird with attention_type={hf.attention_type!r} cannot map: its block-sparse pattern (whole "
            "neighbouring blocks, the first and last blocks global, random blocks drawn per head and layer from "
            "numpy seeded with the layer index in training, and all block 0 in eval) is not swapformer's "
            "bigbird_attention (a token window, leading global tokens, one seeded layout for every head, layer "
            "and mode). Set "
            "attention_type='original_full' in config.json (the same weights with full attention) and convert that"
        )
    if not hf.use_bias:
        raise ConversionError(
            "BigBird with use_bias=False cannot map: its query/key/value have no bias but its attention output "
            "dense has one, and swapformer's attention_bias covers all four projections"
        )


def config_from_hf(hf) -> EncoderConfig:
    check_encoder(hf)
    check_big_bird(hf)
    # BigBird drops out its embeddings before their LayerNorm
    return encoder_config(hf, scale_embeddings=bool(hf.rescale_embeddings), embedding_dropout_first=True)


def config_to_hf(cfg: EncoderConfig):
    from transformers import BigBirdConfig

    if set(cfg.layer_types) != {"full_attention"}:
        raise ConversionError(
            f"Only full-attention encoders convert back to BigBird (attention_type='original_full'); this one has "
            f"layer_types={cfg.layer_types}"
        )
    if not cfg.attention_bias:
        raise ConversionError(
            "attention_bias=False cannot map: BigBird's attention output dense always has a bias"
        )
    return BigBirdConfig(
        **hf_encoder_fields(cfg, embedding_dropout_first=True),
        attention_type="original_full",
        rescale_embeddings=cfg.scale_embeddings,
        use_bias=True,
    )


FAMILY = register(Family("big_bird", ARCHITECTURES, config_from_hf, config_to_hf, drop=DROP))
