"""generate() on a learned position table (issue 28): a request that would run past the table is refused
before the first step, naming the prompt, max_new_tokens (or max_length) and the table; the largest
request that fits generates every token it asks for."""

from __future__ import annotations

import traceback

import pytest
import torch

import swapformer

from conftest import build, generate_steps, tiny_config

TABLE = 16


def model_of(arch: str):
    head = swapformer.DecoderForCausalLM if arch == "decoder" else swapformer.Seq2SeqForConditionalGeneration
    return build(head, tiny_config(arch, max_position_embeddings=TABLE))


def counting(model) -> list:
    """The calls of the model's forward (one per generation step; a seq2seq's encoder runs apart)."""
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def prompt(length: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(length))


def test_max_new_tokens_past_the_table_is_refused_before_the_first_step():
    model, ids = model_of("decoder"), prompt(5)
    fits = TABLE - 5 + 1  # the last new token is never fed back
    assert generate_steps(model, ids, fits).sequences.shape == (1, 5 + fits)
    calls = counting(model)
    with pytest.raises(ValueError) as error:
        generate_steps(model, ids, fits + 1)
    message = str(error.value)
    assert calls == []
    for part in ("prompt of 5 tokens", f"max_new_tokens={fits + 1}", f"max_position_embeddings={TABLE}"):
        assert part in message
    assert f"at most max_new_tokens={fits}" in message
    assert "\n" not in message
    frames = [frame.filename for frame in traceback.extract_tb(error.tb)]
    assert not [f for f in frames if "transformers" in f], "the refusal comes from swapformer's generate()"


def test_max_length_past_the_table_is_refused_naming_max_length():
    model, ids = model_of("decoder"), prompt(5)
    out = model.generate(ids, max_length=TABLE + 1, min_length=TABLE + 1, do_sample=False, pad_token_id=0)
    assert out.shape == (1, TABLE + 1)
    calls = counting(model)
    with pytest.raises(ValueError, match=rf"max_length={TABLE + 2}.*at most max_length={TABLE + 1}"):
        model.generate(ids, max_length=TABLE + 2, do_sample=False, pad_token_id=0)
    assert calls == []


@pytest.mark.parametrize("new_tokens", [None, 3])
def test_a_prompt_longer_than_the_table_is_refused_as_such(new_tokens):
    model, ids = model_of("decoder"), prompt(TABLE + 4)
    calls = counting(model)
    options = {} if new_tokens is None else {"max_new_tokens": new_tokens}
    with pytest.raises(ValueError) as error:
        model.generate(ids, do_sample=False, pad_token_id=0, **options)
    assert calls == []
    assert f"prompt has {TABLE + 4} tokens" in str(error.value)
    assert f"max_position_embeddings={TABLE}" in str(error.value)


def test_padding_does_not_count_against_the_table():
    """Positions are counted over real tokens, so left padding takes no place in the table."""
    model, ids = model_of("decoder"), prompt(7, batch=2)
    mask = torch.ones_like(ids)
    mask[:, :2] = 0  # every row has 5 real tokens
    fits = TABLE - 5 + 1
    out = generate_steps(model, ids.masked_fill(mask == 0, 0), fits, attention_mask=mask)
    assert out.sequences.shape == (2, 7 + fits)
    with pytest.raises(ValueError, match=f"at most max_new_tokens={fits}"):
        generate_steps(model, ids, fits + 1, attention_mask=mask)


def test_a_seq2seq_decoder_is_held_to_its_table_too():
    model, ids = model_of("seq2seq"), prompt(4)
    fits = TABLE  # the decoder starts from one token, decoder_start_token_id
    assert generate_steps(model, ids, fits).sequences.shape == (1, 1 + fits)
    calls = counting(model)
    with pytest.raises(ValueError, match=rf"decoder_input_ids of 1 token.*max_new_tokens={fits + 1}"):
        generate_steps(model, ids, fits + 1)
    assert calls == []
