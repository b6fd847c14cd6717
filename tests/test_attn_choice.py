"""Choosing an attention backend fails as transformers' own models fail, and flex_attention's limits
on CPU show up when the backend is chosen (or in the forward that reveals them), never as a raw
compiler error (issue 10, items 14 and 15)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import swapformer

from conftest import build, padded_batch, tiny_config

# transformers 5.24, PreTrainedModel.get_correct_attn_implementation
HF_PATTERN = r'Specified `attn_implementation="{}"` is not supported\. The only possible arguments are '


def llama_error(call) -> Exception:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def tiny_llama_config(**kw):
    return LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, **kw
    )


class TestUnknownBackendLikeTransformers:
    """Type and wording pattern of a live Llama's error, plus swapformer's list of names."""

    def test_from_config(self):
        ref = llama_error(
            lambda: LlamaForCausalLM._from_config(tiny_llama_config(), attn_implementation="nope")
        )
        ours = llama_error(
            lambda: AutoModelForCausalLM.from_config(tiny_config("decoder"), attn_implementation="nope")
        )
        assert type(ours) is type(ref)
        for error in (ref, ours):
            assert re.match(HF_PATTERN.format("nope"), str(error)), str(error)
        for name in swapformer.BACKENDS:
            assert f'"{name}"' in str(ours)

    def test_set_attn_implementation(self):
        llama = LlamaForCausalLM(tiny_llama_config())
        ref = llama_error(lambda: llama.set_attn_implementation("nope"))
        model = build(swapformer.EncoderModel, tiny_config("encoder"))
        ours = llama_error(lambda: model.set_attn_implementation("nope"))
        assert type(ours) is type(ref)
        assert re.match(HF_PATTERN.format("nope"), str(ours)), str(ours)
        assert model.config._attn_implementation == "eager"  # nothing changed

    def test_config_construction_uses_the_same_wording(self):
        # transformers' configs accept any name and its models refuse it; swapformer's configs refuse it
        # already (validation at construction), with the models' type and wording.
        with pytest.raises(ValueError, match=HF_PATTERN.format("nope") + '`attn_implementation="eager"`'):
            swapformer.Seq2SeqConfig(attn_implementation="nope")

    def test_mapping_value(self):
        config = tiny_config("encoder", layer_types=["full_attention", "sliding_attention"], sliding_window=4)
        with pytest.raises(ValueError, match=HF_PATTERN.format("nope") + ".*sliding_attention"):
            AutoModel.from_config(
                config, attn_implementation={"full_attention": "sdpa", "sliding_attention": "nope"}
            )

    def test_known_to_transformers_but_not_wired(self):
        with pytest.raises(
            ValueError,
            match="Specified `attn_implementation=\"flash_attention_3\"` is not supported: .*'sdpa_fa'",
        ):
            swapformer.DecoderConfig(attn_implementation="flash_attention_3")
