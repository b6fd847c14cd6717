"""The field table of the configurations, and folders saved before it keep loading.

tests/data/configs_v0_1/<case>/config.json were written by `save_pretrained` with the configuration code
of commit a6773aa, before the fields became a table (issue 27), from the arguments in CASES below. Each
must load, with its class and with AutoConfig, to the config the current code builds from the same
arguments, and the current code must still write the same file.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import AutoConfig, PreTrainedConfig

import swapformer  # noqa: F401  (registers the classes with AutoConfig)
from swapformer import configuration
from swapformer.configuration.config_fields import RULE, rules_of

from conftest import DATA

SAVED = DATA / "configs_v0_1"  # folders saved by the release before the table
CLASSES = [
    configuration.SwapformerConfig,
    configuration.EncoderConfig,
    configuration.DecoderConfig,
    configuration.Seq2SeqConfig,
]

# {case: (class name, arguments)}: the defaults of each class and varied non-default configs.
CASES = {
    "base_defaults": ("SwapformerConfig", {}),
    "encoder_defaults": ("EncoderConfig", {}),
    "decoder_defaults": ("DecoderConfig", {}),
    "seq2seq_defaults": ("Seq2SeqConfig", {}),
    "encoder_patterns": (
        "EncoderConfig",
        {
            "vocab_size": 1000,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 96,
            "hidden_act": "gelu_new",
            "max_position_embeddings": 256,
            "position_embedding_type": "rope",
            "rope_parameters": {
                "rope_type": "linear",
                "rope_theta": 20000.0,
                "factor": 2.0,
                "partial_rotary_factor": 0.5,
            },
            "layer_types": [
                "full_attention",
                "sliding_global_attention",
                "bigbird_attention",
                "sliding_attention",
            ],
            "sliding_window": 32,
            "global_tokens": 2,
            "attention_block_size": 16,
            "num_random_blocks": 2,
            "random_seed": 7,
            "global_projections": True,
            "type_vocab_size": 2,
            "add_pooling_layer": True,
            "norm_type": "rmsnorm",
            "norm_eps": 1e-6,
            "pre_norm": False,
            "embedding_norm": True,
            "hidden_dropout": 0.2,
            "embedding_dropout": 0.05,
            "embedding_dropout_first": True,
            "final_dropout": True,
            "attention_dropout": 0.1,
            "activation_dropout": 0.1,
            "classifier_dropout": 0.3,
            "initializer": "xavier",
            "initializer_range": 0.01,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_scale": 0.25,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "id2label": {0: "neg", 1: "pos"},
        },
    ),
    "encoder_linformer": (
        "EncoderConfig",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 128,
            "position_embedding_type": "sinusoidal",
            "linformer_k": 32,
            "linformer_sharing": "headwise",
        },
    ),
    "encoder_t5_bias": (
        "EncoderConfig",
        {
            "position_embedding_type": "relative_bias",
            "relative_attention_num_buckets": 16,
            "relative_attention_max_distance": 64,
            "mlp_type": "gated",
            "hidden_act": "silu",
            "attention_scale": 1.0,
        },
    ),
    "decoder_llama3": (
        "DecoderConfig",
        {
            "position_embedding_type": "rope",
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "max_position_embeddings": 16384,
            "num_key_value_heads": 4,
            "mlp_type": "gated",
            "hidden_act": "silu",
            "norm_type": "rmsnorm",
            "tie_word_embeddings": False,
            "use_cache": False,
            "scale_embeddings": True,
            "eos_token_id": [1, 2],
        },
    ),
    "decoder_legacy_rope_scaling": (
        "DecoderConfig",
        {
            "position_embedding_type": "rope",
            "rope_theta": 50000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        },
    ),
    "decoder_sinks_streaming": (
        "DecoderConfig",
        {
            "num_hidden_layers": 2,
            "position_embedding_type": "rope",
            "layer_types": ["sliding_global_attention", "full_attention"],
            "sliding_window": 16,
            "global_tokens": 4,
            "streaming_positions": "cache",
            "attention_sinks": True,
            "attn_implementation": {"sliding_global_attention": "sparse", "full_attention": "sdpa"},
        },
    ),
    "decoder_mla": (
        "DecoderConfig",
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "position_embedding_type": "rope",
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale_all_dim": 1.0,
            },
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "rope_interleave": True,
            "mla_decode": "decompressed",
        },
    ),
    "decoder_alibi_windows": (
        "DecoderConfig",
        {
            "num_hidden_layers": 3,
            "position_embedding_type": "alibi",
            "num_key_value_heads": 1,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "sliding_window": 128,
            "embedding_dropout": 0.0,
        },
    ),
    "seq2seq_varied": (
        "Seq2SeqConfig",
        {
            "num_hidden_layers": 3,
            "decoder_layers": 2,
            "layer_types": ["sliding_global_attention", "full_attention", "sliding_global_attention"],
            "decoder_layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "global_tokens": 1,
            "global_projections": True,
            "position_embedding_type": "relative_bias",
            "shared_embeddings": False,
            "scale_decoder_outputs": True,
            "add_final_logits_bias": True,
            "tie_word_embeddings": False,
            "decoder_start_token_id": 0,
            "pad_token_id": 0,
            "eos_token_id": 1,
        },
    ),
}


def _saved_fields(config) -> dict:
    """`to_dict` without where it was read from (AutoConfig records the folder)."""
    return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


def _build(case: str):
    class_name, kwargs = CASES[case]
    return getattr(configuration, class_name), kwargs


@pytest.mark.parametrize("case", sorted(CASES))
def test_folder_saved_before_the_table_loads_to_the_same_config(case):
    config_class, kwargs = _build(case)
    expected = _saved_fields(config_class(**kwargs))
    loaded = config_class.from_pretrained(SAVED / case)
    assert type(loaded) is config_class and _saved_fields(loaded) == expected
    if config_class is not configuration.SwapformerConfig:  # the base class is not an Auto class
        auto = AutoConfig.from_pretrained(SAVED / case)
        assert type(auto) is config_class and _saved_fields(auto) == expected


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_json_is_written_as_before(case, tmp_path):
    """Diff-to-default saving is unchanged: the current code writes the file the old code wrote."""
    config_class, kwargs = _build(case)
    config_class(**kwargs).save_pretrained(tmp_path)
    now, before = (json.loads((folder / "config.json").read_text()) for folder in (tmp_path, SAVED / case))
    now.pop("transformers_version"), before.pop("transformers_version")
    assert now == before


def test_every_saved_case_is_listed():
    assert sorted(p.name for p in SAVED.iterdir() if p.is_dir()) == sorted(CASES)


@pytest.mark.parametrize("config_class", CLASSES, ids=lambda c: c.__name__)
def test_every_swapformer_field_is_in_the_table(config_class):
    """Fields transformers declares are transformers' to check; every field swapformer adds has a rule."""
    base = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    own = [f for f in dataclasses.fields(config_class) if f.name not in base]
    assert own and all(RULE in f.metadata for f in own), [f.name for f in own if RULE not in f.metadata]
    for f in own:  # defaults stay plain class attributes (tensor_parallel_plan reads them on the class)
        assert getattr(config_class, f.name) == f.default


def _wrong_value(rule):
    """A value the rule refuses, or None when a cross-field rule checks the field."""
    if rule.kind == "int":
        return rule.minimum - 1
    if rule.kind == "number":
        return rule.minimum - 1.0
    return {"choice": "not-a-choice", "bool": "yes", "token_id": 10**9}.get(rule.kind)


TABLE = [
    (config_class, name, _wrong_value(rule))
    for config_class in CLASSES[1:]
    for name, rule in rules_of(config_class).items()
    if _wrong_value(rule) is not None
]


@pytest.mark.parametrize("config_class, name, value", TABLE, ids=[f"{c.__name__}.{n}" for c, n, _ in TABLE])
def test_the_table_refuses_each_field_naming_it_and_the_value(config_class, name, value):
    with pytest.raises((ValueError, TypeError)) as caught:
        config_class(**{name: value})
    message = str(caught.value)
    assert (name in message and repr(value) in message) or f"{name}={value}" in message, message
