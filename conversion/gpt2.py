"""GPT-2 (`GPT2Model`, `GPT2LMHeadModel`) -> swapformer `DecoderModel` / `DecoderForCausalLM`: pre-LN,
learned positions, tanh-GELU, biases everywhere; Conv1D weights are (in, out) and the fused c_attn
is split into q, k and v."""

from __future__ import annotations

from ..configuration.configuration_swapformer import DecoderConfig
from .bert import label_fields
from .rules import Architecture, Rule, prefixed, split_last, transpose

_L = r"h\.(\d+)\."
BASE_RULES = [
    Rule(r"wte\.weight", "embed_tokens.weight"),
    Rule(r"wpe\.weight", "embed_positions.weight"),
    Rule(_L + r"ln_1\.(weight|bias)", r"layers.\1.self_attn_norm.\2"),
    Rule(
        _L + r"attn\.c_attn\.weight",
        (
            r"layers.\1.self_attn.q_proj.weight",
            r"layers.\1.self_attn.k_proj.weight",
            r"layers.\1.self_attn.v_proj.weight",
        ),
        split_last(3, transposed=True),
    ),
    Rule(
        _L + r"attn\.c_attn\.bias",
        (
            r"layers.\1.self_attn.q_proj.bias",
            r"layers.\1.self_attn.k_proj.bias",
            r"layers.\1.self_attn.v_proj.bias",
        ),
        split_last(3, transposed=False),
    ),
    Rule(_L + r"attn\.c_proj\.weight", r"layers.\1.self_attn.o_proj.weight", transpose),
    Rule(_L + r"attn\.c_proj\.bias", r"layers.\1.self_attn.o_proj.bias"),
    Rule(_L + r"ln_2\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
    Rule(_L + r"mlp\.c_fc\.weight", r"layers.\1.mlp.up_proj.weight", transpose),
    Rule(_L + r"mlp\.c_fc\.bias", r"layers.\1.mlp.up_proj.bias"),
    Rule(_L + r"mlp\.c_proj\.weight", r"layers.\1.mlp.down_proj.weight", transpose),
    Rule(_L + r"mlp\.c_proj\.bias", r"layers.\1.mlp.down_proj.bias"),
    Rule(r"ln_f\.(weight|bias)", r"norm.\1"),
]
# The heads keep the base model under `transformer.`; ours under `model.`.
_NESTED = prefixed(BASE_RULES, "transformer.", "model.")
ARCHITECTURES = {
    "GPT2Model": Architecture("DecoderModel", BASE_RULES),
    "GPT2LMHeadModel": Architecture(
        "DecoderForCausalLM", _NESTED + [Rule(r"lm_head\.weight", "lm_head.weight")]
    ),
    "GPT2ForSequenceClassification": Architecture(
        "DecoderForSequenceClassification", _NESTED + [Rule(r"score\.weight", "score.weight")]
    ),
}
RULES = ARCHITECTURES["GPT2LMHeadModel"].rules + BASE_RULES
DROP = [r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias"]


def config_from_hf(hf) -> DecoderConfig:
    unsupported = {
        "scale_attn_by_inverse_layer_idx": hf.scale_attn_by_inverse_layer_idx,
        "reorder_and_upcast_attn": hf.reorder_and_upcast_attn,
        "scale_attn_weights": not hf.scale_attn_weights,
    }
    if any(unsupported.values()):
        raise ValueError(
            f"GPT-2 options swapformer does not implement: {[k for k, v in unsupported.items() if v]}"
        )
    in_vocab = lambda t: t if t is not None and 0 <= t < hf.vocab_size else None  # noqa: E731
    return DecoderConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.n_embd,
        num_hidden_layers=hf.n_layer,
        num_attention_heads=hf.n_head,
        intermediate_size=hf.n_inner or 4 * hf.n_embd,
        hidden_act=hf.activation_function,
        max_position_embeddings=hf.n_positions,
        position_embedding_type="learned",
        norm_type="layernorm",
        norm_eps=hf.layer_norm_epsilon,
        pre_norm=True,
        attention_bias=True,
        mlp_bias=True,
        hidden_dropout=hf.resid_pdrop,
        embedding_dropout=hf.embd_pdrop,
        attention_dropout=hf.attn_pdrop,
        initializer_range=hf.initializer_range,
        tie_word_embeddings=hf.tie_word_embeddings,
        bos_token_id=in_vocab(hf.bos_token_id),
        eos_token_id=in_vocab(hf.eos_token_id),
        pad_token_id=in_vocab(hf.pad_token_id),
        **label_fields(hf),
    )


def config_to_hf(cfg: DecoderConfig):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_embd=cfg.hidden_size,
        n_layer=cfg.num_hidden_layers,
        n_head=cfg.num_attention_heads,
        n_inner=cfg.intermediate_size,
        activation_function=cfg.hidden_act,
        n_positions=cfg.max_position_embeddings,
        layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=cfg.hidden_dropout,
        embd_pdrop=cfg.hidden_dropout if cfg.embedding_dropout is None else cfg.embedding_dropout,
        attn_pdrop=cfg.attention_dropout,
        initializer_range=cfg.initializer_range,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        **label_fields(cfg),
    )
