"""A 2D attention_mask holds 1 for tokens and 0 for padding, or booleans (issue 28): other values were
read as "keep"; now they are refused, naming the values found."""

from __future__ import annotations

import pytest
import torch

import swapformer

from conftest import build, padded_batch, tiny_config

HEADS = {"encoder": swapformer.EncoderModel, "decoder": swapformer.DecoderModel}


@pytest.mark.parametrize("arch", HEADS)
@pytest.mark.parametrize("odd", [0.5, 2, -1])
def test_values_other_than_0_and_1_are_refused(arch, odd):
    model = build(HEADS[arch], tiny_config(arch))
    ids, mask = padded_batch()
    bad = mask.float() if isinstance(odd, float) else mask.clone()
    bad[0, 1] = odd
    with pytest.raises(ValueError) as error:
        model(ids, attention_mask=bad)
    message = str(error.value)
    assert f"attention_mask holds {odd}" in message
    assert "1 for tokens and 0 for padding" in message


def test_the_seq2seq_decoder_mask_is_checked_under_its_own_name():
    model = build(swapformer.Seq2SeqModel, tiny_config("seq2seq"))
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match="decoder_attention_mask holds 3, 4"):
        model(
            ids, attention_mask=mask, decoder_input_ids=ids, decoder_attention_mask=mask * 3 + 4 * (mask == 0)
        )


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.float32, torch.bfloat16, torch.bool])
def test_zeros_and_ones_of_every_dtype_give_the_same_outputs(dtype):
    model = build(swapformer.DecoderModel, tiny_config("decoder"))
    ids, mask = padded_batch()
    expected = model(ids, attention_mask=mask).last_hidden_state
    got = model(ids, attention_mask=mask.to(dtype)).last_hidden_state
    assert torch.equal(got, expected)
