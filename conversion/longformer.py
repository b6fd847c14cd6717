"""Longformer (`LongformerModel`, `LongformerForMaskedLM`, `LongformerForSequenceClassification`,
`LongformerForTokenClassification`) -> swapformer encoders whose layers are all
`sliding_global_attention` with `global_projections` (https://arxiv.org/abs/2004.05150).

Longformer is RoBERTa's encoder (roberta.py: positions from padding_idx + 1, the rows before set
aside; the same LM head) with another self-attention:

- a window of `attention_window` = w keys in total, w/2 on each side: a token sees |q - k| <= w/2,
  which is swapformer's `sliding_window` = w/2 + 1 (|q - k| < sliding_window);
- global tokens, marked per row by the `global_attention_mask` input (both models take it), which
  every token attends to with the ordinary key/value projections, and whose own output row is
  attention of `query_global` over `key_global`/`value_global` of every non-padding key: swapformer's
  `global_projections` (`q_global_proj`, `k_global_proj`, `v_global_proj`);
- `LongformerForSequenceClassification` makes the first token global when it gets no
  `global_attention_mask`; the converted classifier has `global_tokens=1`, so its first token is
  always global (also when a `global_attention_mask` that leaves it out is passed, where Longformer
  would not make it global). Its head reads position 0, like Longformer's: on a left-padded row that is
  a padding token, whose output the two models do not compute alike, so classify right-padded rows
  (RoBERTa's and Longformer's tokenizers pad on the right).

transformers pads each batch to a multiple of the window inside the forward (padding that no token
attends to); swapformer needs no such padding, and the outputs on real tokens are the same.

What cannot map is refused, naming the field: windows that differ per layer (swapformer has one
`sliding_window`), odd or non-positive windows, a window that reaches every position the table
holds (swapformer's windows must cut, and its full-attention layers have no global projections), a
dilated window (`attention_dilation` of the original allenai configs; transformers' Longformer has
none either), a masked-LM head with another activation than GELU. `LongformerForQuestionAnswering`
and `LongformerForMultipleChoice` are not converted: they derive global tokens from `sep_token_id`
inside the forward.
"""

from __future__ import annotations

import dataclasses

import torch

from ..configuration.configuration_swapformer import EncoderConfig
from .bert import LAYER_RULES, POOLER_RULE, check_encoder, encoder_config, encoder_heads, hf_encoder_fields
from .bert import positions_from_row as _positions_from_row
from .family import register
from .roberta import CLASSIFIER_RULES, MLM_RULES, lm_head_check, offset_family, position_offset
from .rules import ConversionError, Rule

_S = r"encoder\.layer\.(\d+)\.attention\.self\."
GLOBAL_RULES = [
    Rule(_S + r"query_global\.(weight|bias)", r"layers.\1.self_attn.q_global_proj.\2"),
    Rule(_S + r"key_global\.(weight|bias)", r"layers.\1.self_attn.k_global_proj.\2"),
    Rule(_S + r"value_global\.(weight|bias)", r"layers.\1.self_attn.v_global_proj.\2"),
]
# Longformer's heads: sequence classification makes the first token global (when no mask is given).
CLASSES = {
    "Model": 0,
    "ForMaskedLM": 0,
    "ForSequenceClassification": 1,
    "ForTokenClassification": 0,
}


check_lm_head = lm_head_check("Longformer", "LongformerModel")


def architectures(offset: int):
    """Longformer's classes for a position table whose first `offset` rows real tokens never read."""
    base = [*LAYER_RULES, *GLOBAL_RULES, _positions_from_row(offset), POOLER_RULE]
    heads = encoder_heads(
        "longformer.",
        base,
        mlm_rules=MLM_RULES,
        seq_rules=CLASSIFIER_RULES,
        seq_pooler=False,
        mlm_check=check_lm_head,
    )
    return {
        "Longformer" + suffix: dataclasses.replace(
            heads[suffix], config={**heads[suffix].config, "global_tokens": global_tokens}
        )
        for suffix, global_tokens in CLASSES.items()
    }


DROP = (r"(longformer\.)?embeddings\.position_ids", r"(longformer\.)?embeddings\.token_type_ids")


def window_of(hf) -> int:
    """The one attention window of a Longformer config (even, > 0, the same for every layer)."""
    windows = hf.attention_window
    windows = list(windows) if isinstance(windows, (list, tuple)) else [windows] * hf.num_hidden_layers
    if len(set(windows)) != 1:
        raise ConversionError(
            f"LongformerConfig.attention_window={windows} differs per layer; swapformer has one sliding_window "
            "for every layer, so these layers cannot map. Convert a checkpoint whose layers share one window"
        )
    window = windows[0]
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0 or window % 2:
        raise ConversionError(
            f"LongformerConfig.attention_window={window!r} must be an even positive int (w/2 keys on each side)"
        )
    dilation = getattr(hf, "attention_dilation", None)
    if dilation is not None:
        dilations = dilation if isinstance(dilation, (list, tuple)) else [dilation]
        if any(d != 1 for d in dilations):
            raise ConversionError(
                f"attention_dilation={dilation!r} cannot map: a dilated window skips keys inside it, and "
                "swapformer's window (like transformers' LongformerSelfAttention) sees every key within it. "
                "Only undilated windows (attention_dilation=1) convert"
            )
    return window


def config_from_hf(hf) -> EncoderConfig:
    check_encoder(hf)
    if hf.pad_token_id is None:
        raise ConversionError("Longformer needs pad_token_id: its positions start at pad_token_id + 1")
    window = window_of(hf)
    sliding_window = window // 2 + 1  # |q - k| <= w/2
    offset = position_offset(hf)
    positions = hf.max_position_embeddings - offset
    if sliding_window >= positions:
        raise ConversionError(
            f"LongformerConfig.attention_window={window} reaches {window // 2} keys on each side, so with "
            f"max_position_embeddings={hf.max_position_embeddings} ({positions} positions after the padding "
            f"offset of {offset}) every token sees every other. swapformer refuses a window that "
            "never cuts (full_attention expresses that), and its full_attention layers have no global "
            f"projections, so this model cannot convert; at this length, windows up to attention_window="
            f"{2 * (positions - 2)} can"
        )
    return encoder_config(
        hf,
        max_position_embeddings=positions,
        add_pooling_layer=False,  # only LongformerModel has one (its Architecture says so)
        # Longformer's heads drop out with hidden_dropout_prob; it has no classifier_dropout
        classifier_dropout=None,
        layer_types=["sliding_global_attention"] * hf.num_hidden_layers,
        sliding_window=sliding_window,
        global_projections=True,
    )


def config_to_hf(cfg: EncoderConfig):
    from transformers import LongformerConfig

    if set(cfg.layer_types) != {"sliding_global_attention"} or not cfg.global_projections:
        raise ConversionError(
            f"Only encoders whose layers are all 'sliding_global_attention' with global_projections=True convert "
            f"back to Longformer; this one has layer_types={cfg.layer_types}, global_projections="
            f"{cfg.global_projections}"
        )
    if cfg.sliding_window < 2:
        raise ConversionError(
            f"sliding_window={cfg.sliding_window} sees no neighbour; Longformer's attention_window = "
            "2 * (sliding_window - 1) must be a positive even number, so sliding_window must be >= 2"
        )
    if cfg.classifier_dropout is not None and cfg.classifier_dropout != cfg.hidden_dropout:
        raise ConversionError(
            f"classifier_dropout={cfg.classifier_dropout} cannot map: Longformer's heads drop out with "
            f"hidden_dropout_prob ({cfg.hidden_dropout}); set classifier_dropout=None"
        )
    fields = hf_encoder_fields(cfg)
    del fields["classifier_dropout"]
    fields["max_position_embeddings"] += cfg.pad_token_id + 1
    return LongformerConfig(**fields, attention_window=2 * (cfg.sliding_window - 1))


def verification_inputs(config, inputs: dict) -> dict:
    """`swapformer convert` checks Longformer with global tokens in play: the first token of every row
    and one in the middle are marked global (both sides read `global_attention_mask`)."""
    ids = inputs["input_ids"]
    marks = torch.zeros_like(ids)
    marks[:, 0] = 1
    marks[:, ids.shape[1] // 3] = 1
    return {**inputs, "global_attention_mask": marks}


# Verification runs on sliding_window + 8 tokens, so the window is cut (longformer-base: 265 tokens).
FAMILY = register(
    offset_family(
        "longformer",
        architectures,
        config_from_hf,
        config_to_hf,
        DROP,
        verify_window_limit=4096,
        verification_inputs=verification_inputs,
    )
)
ARCHITECTURES = FAMILY.architectures  # padding_idx=1, the usual
