"""StableLM (`StableLmModel`, `StableLmForCausalLM`, `StableLmForSequenceClassification`) -> swapformer
`DecoderModel` and heads: Llama's blocks with LayerNorms (with biases) in place of RMSNorms, and RoPE on
the first `int(head_dim * partial_rotary_factor)` dims of each head (0.25 by default), which
`rope_parameters` carries both ways.

Refused, since a swapformer block cannot compute them: `use_qkv_bias=True` (biases on q, k and v but none
on o_proj, while swapformer's `attention_bias` covers all four), `qk_layernorm=True` (a LayerNorm per head
on queries and keys), `use_parallel_residual=True` (attention and MLP from one norm, summed), and a
`hidden_dropout` other than 0 (StableLM drops out the MLP branch only, swapformer both residual branches;
StableLM's checkpoints have 0.0).
"""

from __future__ import annotations

from ..configuration.configuration_swapformer import DecoderConfig
from .family import Family, Fields, register
from .llama import BASE_RULES as LLAMA_RULES
from .llama import DROP, decoder_architectures, decoder_config, hf_decoder_fields, rope_refusal
from .rules import renames

# Llama's rules but for the norms, which have biases here
BASE_RULES = [
    *(rule for rule in LLAMA_RULES if "norm" not in rule.replacement),
    *renames(
        r"layers\.(\d+)\.", r"layers.\1.", "input_layernorm=self_attn_norm post_attention_layernorm=mlp_norm"
    ),
    *renames("", "", "norm"),
]
ARCHITECTURES = decoder_architectures("StableLm", BASE_RULES)

FIELDS = Fields.parse(
    "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads intermediate_size "
    "hidden_act max_position_embeddings norm_eps=layer_norm_eps initializer_range tie_word_embeddings "
    "pad_token_id bos_token_id eos_token_id"
)
REFUSED = {
    "use_qkv_bias": "biases on q, k and v but not on o_proj",
    "qk_layernorm": "a LayerNorm per head on queries and keys",
    "use_parallel_residual": "attention and MLP in parallel from one norm",
}


def config_from_hf(hf) -> DecoderConfig:
    refused = [f"{name}=True ({why})" for name, why in REFUSED.items() if getattr(hf, name)]
    if hf.hidden_dropout:
        refused.append(
            f"hidden_dropout={hf.hidden_dropout} (on the MLP branch only; swapformer's drops out both residual "
            "branches; set it to 0.0 in config.json to convert)"
        )
    if refused:
        raise ValueError(
            f"stablelm with {'; '.join(refused)} has no swapformer counterpart; only StableLM blocks with "
            f"{', '.join(f'{name}=False' for name in REFUSED)} and hidden_dropout=0.0 convert"
        )
    return decoder_config(hf, FIELDS, norm_type="layernorm", attention_bias=False, mlp_bias=False)


def config_to_hf(cfg: DecoderConfig):
    from transformers import StableLmConfig

    needs = dict(
        norm_type="layernorm",
        attention_bias=False,
        mlp_bias=False,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
    )
    wrong = {name: getattr(cfg, name) for name, value in needs.items() if getattr(cfg, name) != value}
    if wrong:
        raise ValueError(f"Only decoders with {needs} go back to StableLM; this one has {wrong}")
    fields = hf_decoder_fields(cfg, FIELDS)
    # StableLmConfig fills in 0.25 where rope_parameters has no factor: a whole-head rotation says so
    fields["rope_parameters"].setdefault("partial_rotary_factor", 1.0)
    return StableLmConfig(**fields)


FAMILY = register(
    Family(
        "stablelm",
        ARCHITECTURES,
        config_from_hf,
        config_to_hf,
        drop=DROP,
        long_refusal=rope_refusal("stablelm"),
    )
)
