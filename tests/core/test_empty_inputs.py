"""An empty sequence is refused at input validation with a ValueError naming the input (issue 10,
item 21). transformers' Llama, BERT and T5 do not return empty outputs either: in 5.24 they stop on a
RuntimeError deep inside attention ("cannot reshape tensor of 0 elements"), which the first test
checks, so swapformer refuses where the mistake is made instead of guessing a result."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import swapformer

from conftest import build, tiny_config

EMPTY = torch.zeros(2, 0, dtype=torch.long)


def test_llama_has_no_result_for_an_empty_sequence():
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
        )
    )
    with pytest.raises(RuntimeError, match="0 elements"):
        llama(EMPTY)


@pytest.mark.parametrize("attn", ["eager", "sdpa", "sparse"])
@pytest.mark.parametrize(
    "arch, cls", [("encoder", swapformer.EncoderModel), ("decoder", swapformer.DecoderForCausalLM)]
)
def test_empty_input_ids(arch, cls, attn):
    model = build(cls, tiny_config(arch), attn=attn)
    with pytest.raises(ValueError, match=r"input_ids has shape \(2, 0\).*at least one token"):
        model(EMPTY)
    with pytest.raises(ValueError, match=r"inputs_embeds has shape \(2, 0, 32\).*at least one token"):
        model(inputs_embeds=torch.zeros(2, 0, 32))


def test_empty_seq2seq_inputs_name_the_right_argument():
    model = build(swapformer.Seq2SeqForConditionalGeneration, tiny_config("seq2seq"))
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError, match=r"^input_ids has shape \(2, 0\)"):
        model(EMPTY, decoder_input_ids=ids)
    with pytest.raises(ValueError, match=r"^decoder_input_ids has shape \(2, 0\)"):
        model(ids, decoder_input_ids=EMPTY)


def test_empty_batch():
    model = build(swapformer.DecoderModel, tiny_config("decoder"))
    with pytest.raises(ValueError, match=r"input_ids has shape \(0, 4\).*at least one sequence"):
        model(torch.zeros(0, 4, dtype=torch.long))
