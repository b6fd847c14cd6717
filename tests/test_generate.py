"""generate() works with the KV cache: every step's logits equal an uncached forward over the prefix.

(The full cache matrix — every backend, static caches, beam search — is the generation issue's;
this pins down the contract the foundation must already keep.)"""

from __future__ import annotations

import pytest
import torch

import swapformer

from conftest import build, cached_step_diffs, max_diff, padded_batch, tiny_config


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("position", ["learned", "rope", "alibi", "relative_bias", "sinusoidal"])
def test_decoder_cached_steps_equal_uncached_forward(position, attn):
    model = build(
        swapformer.DecoderForCausalLM,
        tiny_config("decoder", position_embedding_type=position, num_key_value_heads=2),
        attn=attn,
    )
    ids, mask = padded_batch(batch=2, length=6, padding="left")
    assert max(cached_step_diffs(model, ids, mask, 5)) <= 1e-4


def test_left_padding_does_not_change_a_rows_generation():
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder", position_embedding_type="learned"))
    row = torch.tensor([[5, 6, 7, 8]])
    alone = model.generate(row, max_new_tokens=4, do_sample=False, pad_token_id=0)[:, 4:]
    batch = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (batch != 0).long()
    together = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)[
        :1, 6:
    ]
    assert torch.equal(alone, together)


@pytest.mark.parametrize("position", ["learned", "relative_bias"])
def test_seq2seq_cached_steps_equal_uncached_forward(position):
    model = build(
        swapformer.Seq2SeqForConditionalGeneration,
        tiny_config("seq2seq", position_embedding_type=position),
        attn="sdpa",
    )
    ids, mask = padded_batch(batch=2, length=7, padding="right")
    assert max(cached_step_diffs(model, ids, mask, 5)) <= 1e-4


@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_static_cache_generates_what_the_dynamic_cache_does(arch):
    """generate(cache_implementation="static") goes through transformers' compileable-cache path,
    which asks the model for its masks (create_masks_for_generate): swapformer keeps its own."""
    model_class = (
        swapformer.DecoderForCausalLM if arch == "decoder" else swapformer.Seq2SeqForConditionalGeneration
    )
    model = build(
        model_class, tiny_config(arch, position_embedding_type="rope", num_key_value_heads=2), attn="sdpa"
    )
    ids, mask = padded_batch(batch=2, length=6, padding="left" if arch == "decoder" else "right")
    kw = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    dynamic = model.generate(ids, **kw)
    static = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(dynamic.sequences, static.sequences)
    assert max(max_diff(a, b) for a, b in zip(dynamic.logits, static.logits)) <= 1e-5
