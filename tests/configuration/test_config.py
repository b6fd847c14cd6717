"""Configs validate at construction with messages that name the values, and round-trip exactly."""

from __future__ import annotations

import ast
import pathlib

import pytest

import swapformer

from conftest import tiny_config

CONFIGS = [swapformer.EncoderConfig, swapformer.DecoderConfig, swapformer.Seq2SeqConfig]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            dict(hidden_size=100, num_attention_heads=3),
            ValueError,
            r"hidden_size=100 is not divisible by num_attention_heads=3",
        ),
        (
            dict(num_attention_heads=12, num_key_value_heads=5),
            ValueError,
            r"num_attention_heads=12 is not divisible by num_key_value_heads=5",
        ),
        (
            dict(position_embedding_type="xpos"),
            ValueError,
            r"Unknown position_embedding_type='xpos'; choose one of 'learned'",
        ),
        (dict(norm_type="batchnorm"), ValueError, r"Unknown norm_type='batchnorm'"),
        (dict(hidden_act="gelu9"), ValueError, r"Unknown hidden_act='gelu9'"),
        (dict(mlp_type="moe"), ValueError, r"Unknown mlp_type='moe'"),
        (dict(initializer="orthogonal"), ValueError, r"Unknown initializer='orthogonal'"),
        (
            dict(attn_implementation="fastest"),
            ValueError,
            r'Specified `attn_implementation="fastest"` is not supported',
        ),
        (dict(vocab_size=0), ValueError, r"vocab_size must be >= 1, got vocab_size=0"),
        (dict(hidden_size=-8), ValueError, r"hidden_size must be >= 1, got hidden_size=-8"),
        (dict(num_hidden_layers=0), ValueError, r"num_hidden_layers must be >= 1"),
        (dict(intermediate_size=0), ValueError, r"intermediate_size must be >= 1"),
        (dict(max_position_embeddings=0), ValueError, r"max_position_embeddings must be >= 1"),
        (dict(hidden_size="64"), TypeError, r"hidden_size must be an int, got '64'"),
        (
            dict(hidden_dropout=1.5),
            ValueError,
            r"hidden_dropout must lie in \[0, 1\], got hidden_dropout=1.5; it is a dropout probability",
        ),
        (dict(attention_dropout=-0.1), ValueError, r"attention_dropout must lie in"),
        (
            dict(pad_token_id=5000, vocab_size=100),
            ValueError,
            r"pad_token_id=5000 must be None or a token id in \[0, vocab_size=100\)",
        ),
        (
            dict(position_embedding_type="rope", hidden_size=24, num_attention_heads=8),
            ValueError,
            r"even head_dim, got head_dim=3",
        ),
        (
            dict(
                position_embedding_type="relative_bias",
                relative_attention_num_buckets=32,
                relative_attention_max_distance=10,
            ),
            ValueError,
            r"relative_attention_max_distance=10 must exceed",
        ),
        (dict(pre_norm="yes"), TypeError, r"pre_norm must be True or False"),
    ],
)
@pytest.mark.parametrize("config_class", CONFIGS, ids=lambda c: c.__name__)
def test_bad_values_fail_at_construction(config_class, kwargs, error, message):
    with pytest.raises(error, match=message):
        config_class(**kwargs)


# Values transformers' configs and tests use: its common model tests zero the initialisation with
# initializer_range=1e-10 (TF: 0.0), model testers use eps 1e-12, and nothing forbids eps >= 1, a
# dropout of 1, a wide initialiser or a RoPE base below 1. All of them compute something.
ACCEPTED = [
    dict(norm_eps=1.0),
    dict(norm_eps=2.5),
    dict(norm_eps=1e-12),
    dict(initializer_range=0.0),
    dict(initializer_range=1e-10),
    dict(initializer_range=1.5),
    dict(hidden_dropout=1.0, attention_dropout=1.0, activation_dropout=1.0, classifier_dropout=1.0),
    dict(embedding_dropout=0.0),
    dict(position_embedding_type="rope", rope_theta=0.5),
    dict(position_embedding_type="rope", rope_theta=1e6),
    dict(attention_scale=0.0),
    dict(norm_eps=1),  # an int is a number
]


@pytest.mark.parametrize("kwargs", ACCEPTED, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("config_class", CONFIGS, ids=lambda c: c.__name__)
def test_values_transformers_uses_are_accepted(config_class, kwargs):
    config = config_class(**kwargs)
    assert all(getattr(config, k) == v for k, v in kwargs.items())
    again = config_class.from_dict(config.to_dict())  # and they survive a save/load
    assert all(getattr(again, k) == v for k, v in kwargs.items())


NAN, INF = float("nan"), float("inf")
REJECTED = [
    ("norm_eps", 0.0, ValueError, r"norm_eps must be a finite number > 0, got norm_eps=0.0; .*1e-5 for LayerNorm"),
    ("norm_eps", -1e-5, ValueError, r"norm_eps must be a finite number > 0, got norm_eps=-1e-05"),
    ("norm_eps", NAN, ValueError, r"norm_eps must be a finite number > 0, got norm_eps=nan"),
    ("norm_eps", INF, ValueError, r"norm_eps must be a finite number > 0, got norm_eps=inf"),
    ("norm_eps", "1e-5", TypeError, r"norm_eps must be a number, got '1e-5' \(str\); .*1e-6 for RMSNorm"),
    ("norm_eps", True, TypeError, r"norm_eps must be a number, got True \(bool\)"),
    ("initializer_range", -0.02, ValueError, r"initializer_range must be a finite number >= 0, got initializer_range=-0.02; .*0.02 is usual"),
    ("initializer_range", NAN, ValueError, r"initializer_range must be a finite number >= 0, got initializer_range=nan"),
    ("initializer_range", INF, ValueError, r"initializer_range must be a finite number >= 0, got initializer_range=inf"),
    ("rope_theta", 0.0, ValueError, r"rope_theta must be a finite number > 0, got rope_theta=0.0; the usual RoPE base is 10000.0"),
    ("rope_theta", -10000.0, ValueError, r"rope_theta must be a finite number > 0"),
    ("rope_theta", INF, ValueError, r"rope_theta must be a finite number > 0, got rope_theta=inf"),
    ("attention_scale", -1.0, ValueError, r"attention_scale must be a finite number >= 0, got attention_scale=-1.0; or None for head_dim"),
    ("attention_scale", NAN, ValueError, r"attention_scale must be a finite number >= 0, got attention_scale=nan"),
    ("hidden_dropout", NAN, ValueError, r"hidden_dropout must lie in \[0, 1\], got hidden_dropout=nan; it is a dropout probability"),
    ("hidden_dropout", 1.0000001, ValueError, r"hidden_dropout must lie in \[0, 1\]"),
    ("attention_dropout", -0.1, ValueError, r"attention_dropout must lie in \[0, 1\], got attention_dropout=-0.1"),
    ("activation_dropout", INF, ValueError, r"activation_dropout must lie in \[0, 1\], got activation_dropout=inf"),
    ("classifier_dropout", 2.0, ValueError, r"classifier_dropout must lie in \[0, 1\], got classifier_dropout=2.0"),
    ("embedding_dropout", -0.5, ValueError, r"embedding_dropout must lie in \[0, 1\], got embedding_dropout=-0.5"),
    ("hidden_dropout", "0.1", TypeError, r"hidden_dropout must be a number, got '0.1' \(str\)"),
]  # fmt: skip


@pytest.mark.parametrize("name, value, error, message", REJECTED, ids=lambda x: str(x)[:20])
@pytest.mark.parametrize("config_class", CONFIGS, ids=lambda c: c.__name__)
def test_truly_invalid_numbers_are_refused_naming_value_and_fix(config_class, name, value, error, message):
    with pytest.raises(error, match=message):
        config_class(**{name: value})


def test_seq2seq_specific_validation():
    with pytest.raises(ValueError, match="decoder_layers must be >= 1"):
        swapformer.Seq2SeqConfig(decoder_layers=0)
    with pytest.raises(ValueError, match="decoder_start_token_id=500 must be None or a token id"):
        swapformer.Seq2SeqConfig(vocab_size=100, decoder_start_token_id=500)
    with pytest.raises(ValueError, match="type_vocab_size must be >= 0"):
        swapformer.EncoderConfig(type_vocab_size=-1)


def test_derived_defaults():
    c = swapformer.DecoderConfig(hidden_size=256, num_attention_heads=8)
    assert (c.num_key_value_heads, c.head_dim, c.intermediate_size) == (8, 32, 1024)
    assert swapformer.Seq2SeqConfig(num_hidden_layers=3).decoder_layers == 3
    assert swapformer.Seq2SeqConfig().is_encoder_decoder
    assert c.model_type == "swapformer_decoder"
    assert len({cls.model_type for cls in CONFIGS}) == 3


@pytest.mark.parametrize("arch", ["encoder", "decoder", "seq2seq"])
def test_round_trip_dict_and_disk(arch, tmp_path):
    config = tiny_config(
        arch,
        position_embedding_type="alibi",
        norm_type="rmsnorm",
        mlp_type="gated",
        hidden_act="silu",
        num_key_value_heads=2,
        attention_scale=0.5,
        classifier_dropout=0.2,
        id2label={0: "neg", 1: "pos", 2: "mid"},
    )
    again = type(config).from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()
    config.save_pretrained(tmp_path)
    loaded = type(config).from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert loaded.id2label == {0: "neg", 1: "pos", 2: "mid"} and loaded.num_labels == 3
    from transformers import AutoConfig

    assert type(AutoConfig.from_pretrained(tmp_path)) is type(config)


def test_configuration_package_does_not_import_torch():
    root = pathlib.Path(swapformer.configuration.__file__).parent
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path
