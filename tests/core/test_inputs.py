"""Bad inputs fail with a ValueError that names the shapes/values, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

import swapformer

from conftest import LM_CLASSES, VOCAB, build, tiny_config


@pytest.fixture(scope="module")
def models():
    return {arch: build(LM_CLASSES[arch], tiny_config(arch)) for arch in LM_CLASSES}


def call(model, arch, **kw):
    if arch == "seq2seq":
        kw.setdefault("decoder_input_ids", torch.tensor([[1, 5, 6]]))
    return model(**kw)


@pytest.fixture(autouse=True)
def no_kernel_runs(monkeypatch):
    """Any attention or linear kernel running during a bad call fails the test."""
    calls = []
    for name in ("scaled_dot_product_attention", "linear"):
        original = getattr(torch.nn.functional, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, name, spy)
    yield calls


ARCHS = list(LM_CLASSES)


@pytest.mark.parametrize("arch", ARCHS)
def test_input_ids_of_wrong_rank(models, arch, no_kernel_runs):
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, sequence\), got shape \(5,\)"):
        call(models[arch], arch, input_ids=torch.tensor([5, 6, 7, 8, 9]))
    assert not no_kernel_runs


@pytest.mark.parametrize("arch", ARCHS)
def test_input_ids_of_wrong_dtype(models, arch, no_kernel_runs):
    with pytest.raises(ValueError, match=r"input_ids must hold integer token ids, got dtype torch.float32"):
        call(models[arch], arch, input_ids=torch.ones(1, 4))
    assert not no_kernel_runs


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_mask_of_a_different_length(models, arch, no_kernel_runs):
    with pytest.raises(
        ValueError, match=r"attention_mask has shape \(1, 3\) but the inputs need \(batch=1, length=4\)"
    ):
        call(models[arch], arch, input_ids=torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.ones(1, 3))
    assert not no_kernel_runs


@pytest.mark.parametrize("arch", ARCHS)
def test_token_ids_outside_the_vocabulary(models, arch, no_kernel_runs):
    with pytest.raises(ValueError, match=rf"token ids in \[5, {VOCAB + 3}\] but vocab_size={VOCAB}"):
        call(models[arch], arch, input_ids=torch.tensor([[5, VOCAB + 3]]))
    with pytest.raises(ValueError, match=r"token ids in \[-1, 5\]"):
        call(models[arch], arch, input_ids=torch.tensor([[-1, 5]]))
    assert not no_kernel_runs


@pytest.mark.parametrize("arch", ARCHS)
def test_sequence_longer_than_learned_positions(models, arch, no_kernel_runs):
    too_long = torch.full((1, 65), 5)
    with pytest.raises(ValueError, match=r"Sequence of 65 positions exceeds max_position_embeddings=64"):
        call(models[arch], arch, input_ids=too_long)
    assert not no_kernel_runs


def test_rope_models_are_not_limited_by_max_positions():
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder", position_embedding_type="rope"))
    assert model(torch.full((1, 80), 5)).logits.shape[1] == 80


@pytest.mark.parametrize("arch", ARCHS)
def test_inputs_embeds_together_with_input_ids(models, arch, no_kernel_runs):
    with pytest.raises(ValueError, match="Pass exactly one of input_ids and inputs_embeds \\(got both\\)"):
        call(models[arch], arch, input_ids=torch.tensor([[5, 6]]), inputs_embeds=torch.zeros(1, 2, 32))
    assert not no_kernel_runs


def test_decoder_side_errors_name_the_decoder_inputs(models, no_kernel_runs):
    with pytest.raises(ValueError, match=r"decoder_attention_mask has shape \(1, 2\)"):
        models["seq2seq"](
            input_ids=torch.tensor([[5, 6]]),
            decoder_input_ids=torch.tensor([[1, 5, 6]]),
            decoder_attention_mask=torch.ones(1, 2),
        )


def test_inputs_embeds_alone_work_and_match_ids(models):
    model = models["decoder"]
    ids = torch.tensor([[5, 6, 7]])
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(input_ids=ids).logits)


def test_token_type_ids_without_a_type_table_are_refused():
    model = build(swapformer.EncoderModel, tiny_config("encoder", type_vocab_size=0))
    model(torch.tensor([[5, 6]]), token_type_ids=torch.zeros(1, 2, dtype=torch.long))  # zeros mean nothing
    with pytest.raises(ValueError, match="type_vocab_size=0"):
        model(torch.tensor([[5, 6]]), token_type_ids=torch.tensor([[0, 1]]))


def test_cache_and_past_key_values_together_are_refused(models):
    from transformers import DynamicCache

    with pytest.raises(ValueError, match="not both"):
        models["decoder"](torch.tensor([[5]]), cache=DynamicCache(), past_key_values=DynamicCache())


def test_the_kernel_spy_sees_a_valid_call(models, no_kernel_runs):
    call(models["decoder"], "decoder", input_ids=torch.tensor([[5, 6]]))
    assert "linear" in no_kernel_runs
