"""The math is the real thing: swapformer configured like BERT, Llama, StableLM and BART matches
transformers' own models with the weights copied across (fp32, padding, eager and sdpa)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BartForConditionalGeneration,
    LlamaForCausalLM,
    StableLmConfig,
    StableLmForCausalLM,
)

import swapformer
from swapformer.conversion import ConversionError, convert_state_dict, from_hf_model

from conftest import HF_SIZE, max_diff, padded_batch
from hf_models import bart, bert, llama, pair

TOL = 1e-5
BACKENDS = ["eager", "sdpa"]


@pytest.mark.parametrize("attn", BACKENDS)
def test_bert_matches_bertmodel(attn, report):
    hf, ours = pair(bert(attn), swapformer.EncoderModel, attn)
    ids, mask = padded_batch(padding="right")
    types = torch.zeros_like(ids)
    types[:, 4:] = 1
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        got = ours(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    diff = max_diff(got, want, mask)
    report("BERT last_hidden_state max abs diff", diff)
    assert diff <= TOL


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("attn", BACKENDS)
def test_llama_matches_llamaforcausallm(attn, padding, report):
    hf, ours = pair(llama(attn, LlamaForCausalLM), swapformer.DecoderForCausalLM, attn)
    diff = causal_lm_diff(hf, ours, padding)
    report(f"Llama logits max abs diff ({padding} padding)", diff)
    assert diff <= TOL


def causal_lm_diff(hf, ours, padding: str) -> float:
    """max |logits| difference over the real tokens of a padded batch. Llama and StableLM count positions
    from 0 at the first column, swapformer counts real tokens: the transformers model gets the pad-aware
    positions, so a left-padded row means the same thing to both."""
    ids, mask = padded_batch(padding=padding)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask).logits
    return max_diff(got, want, mask)


ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4,
    },
}


@pytest.mark.parametrize("rope", list(ROPE))
@pytest.mark.parametrize("factor", [0.25, 0.5])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("attn", BACKENDS)
def test_stablelm_partial_rotary_matches_stablelmforcausallm(attn, padding, factor, rope, report):
    """StableLM rotates the first int(head_dim * partial_rotary_factor) dims of each head (here 4 or 8 of
    16); its LayerNorms have biases. Past original_max_position_embeddings, so YaRN acts too."""
    config = StableLmConfig(
        vocab_size=97,
        **HF_SIZE,
        num_key_value_heads=2,
        max_position_embeddings=16,
        rope_parameters={**ROPE[rope], "partial_rotary_factor": factor},
        attn_implementation=attn,
    )
    hf, ours = pair(StableLmForCausalLM(config), swapformer.DecoderForCausalLM, attn)
    assert ours.config.rope_parameters["partial_rotary_factor"] == factor
    diff = causal_lm_diff(hf, ours, padding)
    report(f"StableLM logits max abs diff ({factor}, {rope}, {padding} padding)", diff)
    assert diff <= TOL


@pytest.mark.parametrize("tied", [True, False])
def test_llama_tied_and_untied_heads(tied):
    hf, ours = pair(
        llama("sdpa", LlamaForCausalLM, tie_word_embeddings=tied), swapformer.DecoderForCausalLM, "sdpa"
    )
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    ids, mask = padded_batch(padding="right")
    with torch.no_grad():
        assert (
            max_diff(ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits, mask) <= TOL
        )


@pytest.mark.parametrize("attn", BACKENDS)
def test_bart_matches_bartmodel(attn, report):
    hf, ours = pair(bart(attn), swapformer.Seq2SeqModel, attn)
    ids, mask = padded_batch(padding="right")
    dec_ids, dec_mask = padded_batch(length=7, padding="right", seed=5)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask)
        got = ours(ids, attention_mask=mask, decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask)
    enc = max_diff(got.encoder_last_hidden_state, want.encoder_last_hidden_state, mask)
    dec = max_diff(got.last_hidden_state, want.last_hidden_state, dec_mask)
    report("BART encoder max abs diff", enc)
    report("BART decoder max abs diff", dec)
    assert enc <= TOL and dec <= TOL


def test_bart_lm_head_and_loss_match(report):
    hf, ours = pair(
        bart("sdpa", BartForConditionalGeneration), swapformer.Seq2SeqForConditionalGeneration, "sdpa"
    )
    ids, mask = padded_batch(padding="right")
    labels, label_mask = padded_batch(length=7, padding="right", seed=5)
    labels = labels.masked_fill(label_mask == 0, -100)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, labels=labels)
        got = ours(ids, attention_mask=mask, labels=labels)
    report("BART LM logits max abs diff", max_diff(got.logits, want.logits, label_mask))
    assert max_diff(got.logits, want.logits, label_mask) <= TOL
    assert abs(got.loss.item() - want.loss.item()) <= TOL


def test_a_wrong_key_map_is_caught():
    """The parity above is not vacuous: leaving BART's position offset in place breaks it."""
    hf, ours = pair(bart("eager"), swapformer.Seq2SeqModel, "eager")
    with torch.no_grad():
        ours.encoder.embed_positions.weight.copy_(hf.encoder.embed_positions.weight[:64])
    ids, mask = padded_batch(padding="none")
    dec_ids, _ = padded_batch(length=5, padding="none", seed=3)
    with torch.no_grad():
        a = hf(ids, decoder_input_ids=dec_ids).last_hidden_state
        b = ours(ids, decoder_input_ids=dec_ids).last_hidden_state
    assert max_diff(a, b) > 1e-2


def test_converter_refuses_unmapped_and_missing_keys():
    hf = bert("eager")
    target = swapformer.EncoderModel(swapformer.conversion.bert.config_from_hf(hf.config))
    state = dict(hf.state_dict())
    state["encoder.layer.0.attention.self.extra.weight"] = torch.zeros(1)
    del state["embeddings.word_embeddings.weight"]
    with pytest.raises(ConversionError) as err:
        convert_state_dict(
            state,
            swapformer.conversion.bert.RULES,
            expected_keys=target.state_dict().keys(),
            drop=swapformer.conversion.bert.DROP,
        )
    assert "attention.self.extra.weight" in str(err.value) and "embed_tokens.weight" in str(err.value)


@pytest.mark.parametrize("attn", BACKENDS)
def test_gpt2_matches_gpt2lmheadmodel(attn, report):
    """Conv1D weights are transposed and the fused c_attn split into q, k, v."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=48, n_head=4, vocab_size=97, n_positions=64, attn_implementation=attn
    )
    hf, ours = pair(GPT2LMHeadModel(config), swapformer.DecoderForCausalLM, attn)
    ids, mask = padded_batch(padding="right")
    with torch.no_grad():
        diff = max_diff(ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits, mask)
    report("GPT-2 logits max abs diff", diff)
    assert diff <= TOL


def test_unsupported_family_lists_the_supported_ones():
    from transformers import OPTConfig, OPTModel

    model = OPTModel(
        OPTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, ffn_dim=64, vocab_size=100)
    )
    with pytest.raises(
        ValueError, match="model_type='opt'.*bart, bert, big_bird, deepseek_v3, gpt2, llama, longformer"
    ):
        from_hf_model(model, swapformer.DecoderModel)
