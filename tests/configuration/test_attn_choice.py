"""Choosing an attention backend fails as transformers' own models fail, and flex_attention's limits
on CPU show up when the backend is chosen (or in the forward that reveals them), never as a raw
compiler error (issue 10, items 14 and 15)."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import swapformer
from swapformer.configuration.backends import capable

from conftest import build, cached_step_diffs, padded_batch, pattern_config, tiny_config

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
        for name in capable(lambda caps: True):  # the backends that run on this machine
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
            match='Specified `attn_implementation="flash_attention_3"` is not supported: .*; use \'',
        ):
            swapformer.DecoderConfig(attn_implementation="flash_attention_3")


@pytest.mark.slow  # flex compiles its kernel on first use
class TestFlexDropout:
    """attention_dropout only acts in training, which flex cannot do: it is refused there, not at choice."""

    def test_choice_and_inference_work(self):
        config = tiny_config("encoder", attention_dropout=0.1)
        flex = build(swapformer.EncoderModel, config, attn="flex_attention")
        eager = build(swapformer.EncoderModel, config, attn="eager")
        ids, mask = padded_batch()
        with torch.no_grad():
            diff = (
                flex(ids, attention_mask=mask).last_hidden_state
                - eager(ids, attention_mask=mask).last_hidden_state
            )
        assert float(diff.abs().max()) <= 1e-5

    def test_training_forward_is_refused_with_the_way_out(self):
        model = build(
            swapformer.EncoderModel, tiny_config("encoder", attention_dropout=0.1), attn="flex_attention"
        )
        model.train()
        with (
            torch.no_grad(),
            pytest.raises(
                ValueError,
                match=r"'flex_attention' cannot apply attention_dropout=0.1 in training; call model.eval\(\).*"
                r"attention_dropout=0.0.*'sdpa'",
            ),
        ):
            model(torch.tensor([[5, 6, 7]]))


def sliding_decoder(attn):
    config = tiny_config("decoder", layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    return build(swapformer.DecoderModel, config, attn=attn)


@pytest.mark.slow
class TestCompiledModelOnBackendsThatDoNotCompile:
    """torch.compile(model) works (the layers the table rules out run uncompiled); fullgraph=True and
    torch.export fail naming the backend that cannot compile and the ones that can."""

    @pytest.mark.parametrize("attn", ["flex_attention", "sparse"])
    def test_compile_without_fullgraph_matches_eager(self, attn):
        torch._dynamo.reset()
        model = sliding_decoder(attn)
        ids, mask = padded_batch(padding="left")
        with torch.no_grad():
            want = model(ids, attention_mask=mask, use_cache=False).last_hidden_state
            got = torch.compile(model)(ids, attention_mask=mask, use_cache=False).last_hidden_state
        assert float((got - want).abs().max()) <= 1e-5

    @pytest.mark.parametrize("attn", ["flex_attention", "sparse"])
    def test_fullgraph_and_export_name_the_backend(self, attn):
        torch._dynamo.reset()
        model = sliding_decoder(attn)
        ids, mask = padded_batch(padding="left")
        message = rf"attn_implementation='{attn}' cannot run inside torch.compile\(fullgraph=True\) or torch.export on cpu"
        with torch.no_grad(), pytest.raises(ValueError, match=message + r".*Compile with 'eager' or 'sdpa'"):
            torch.export.export(model, (ids,), {"attention_mask": mask, "use_cache": False}, strict=False)
        with torch.no_grad(), pytest.raises(Exception, match=message):
            torch.compile(model, fullgraph=True)(ids, attention_mask=mask, use_cache=False)


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("layer_type", ["bigbird_attention", "sliding_global_attention", "full_attention"])
def test_flex_decoding_on_cpu(layer_type, padding, report):
    """generate() on flex, CPU: every cached step equals the uncached forward (BigBird decoding died in
    a C++ compile error of torch inductor's flex kernel, recompiled with the mask's offsets symbolic)."""
    config = pattern_config(
        "decoder",
        layer_type,
        position_embedding_type="learned",
        sliding_window=4,
        global_tokens=1,
        attention_block_size=4,
    )
    model = build(swapformer.DecoderForCausalLM, config, attn="flex_attention")
    ids, mask = padded_batch(batch=2, length=9, padding=padding)
    diffs = cached_step_diffs(model, ids, mask, 4)
    report("max step diff vs uncached", max(diffs))
    assert max(diffs) <= 1e-5
