"""GPT-2 (`GPT2Model`, `GPT2LMHeadModel`) -> swapformer `DecoderModel` / `DecoderForCausalLM`: pre-LN,
learned positions, tanh-GELU, biases everywhere; Conv1D weights are (in, out) and the fused c_attn
is split into q, k and v."""

from __future__ import annotations

from ..configuration.configuration_swapformer import DecoderConfig
from .family import Family, Fields, label_fields, register
from .llama import decoder_architectures
from .rules import Rule, split_last, transpose

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
ARCHITECTURES = decoder_architectures("GPT2", BASE_RULES, "transformer.", causal_lm="LMHeadModel")
DROP = (r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias",)


FIELDS = Fields.parse(
    "vocab_size hidden_size=n_embd num_hidden_layers=n_layer num_attention_heads=n_head intermediate_size=n_inner "
    "hidden_act=activation_function max_position_embeddings=n_positions norm_eps=layer_norm_epsilon "
    "hidden_dropout=resid_pdrop attention_dropout=attn_pdrop initializer_range tie_word_embeddings"
)
TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


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
    values = {**FIELDS.from_hf(hf), **{name: in_vocab(getattr(hf, name)) for name in TOKENS}}
    values.update(intermediate_size=hf.n_inner or 4 * hf.n_embd, embedding_dropout=hf.embd_pdrop)
    return DecoderConfig(
        **values,
        position_embedding_type="learned",
        norm_type="layernorm",
        pre_norm=True,
        attention_bias=True,
        mlp_bias=True,
        **label_fields(hf),
    )


def config_to_hf(cfg: DecoderConfig):
    from transformers import GPT2Config

    embedding_dropout = cfg.hidden_dropout if cfg.embedding_dropout is None else cfg.embedding_dropout
    tokens = {name: getattr(cfg, name) for name in TOKENS}
    return GPT2Config(**FIELDS.to_hf(cfg), **tokens, embd_pdrop=embedding_dropout, **label_fields(cfg))


LONG_REFUSAL = (
    "gpt2 is a causal decoder: copying its learned position table (Longformer's recipe, made for "
    "bidirectional encoders) gives it positions it never learned to continue from"
)
FAMILY = register(
    Family("gpt2", ARCHITECTURES, config_from_hf, config_to_hf, drop=DROP, long_refusal=LONG_REFUSAL)
)
