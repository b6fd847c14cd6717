"""generate() works with the KV cache: every step's logits equal an uncached forward over the prefix.

(The full cache matrix — every backend, static caches, beam search — is the generation issue's;
this pins down the contract the foundation must already keep.)"""

from __future__ import annotations

import pytest
import torch

import swapformer

from conftest import build, cached_step_diffs, padded_batch, tiny_config


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
