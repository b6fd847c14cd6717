"""eager is the oracle: sdpa must compute the same function for every architecture and option."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import swapformer

from conftest import ARCHS, BASE_CLASSES, LM_CLASSES, POSITIONS, build, max_diff, padded_batch, tiny_config

TOL = 1e-5


def run(model, arch, ids, mask, **kw):
    if arch == "seq2seq":
        dec_ids, dec_mask = ids[:, :6], mask[:, :6]
        return model(
            ids, attention_mask=mask, decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask, **kw
        ), dec_mask
    return model(ids, attention_mask=mask, **kw), mask


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_sdpa_matches_eager(arch, position, padding, kv_heads):
    if arch == "seq2seq" and padding == "left":
        pytest.skip("decoder inputs of a seq2seq are right-padded by construction")
    config = tiny_config(arch, position_embedding_type=position, num_key_value_heads=kv_heads)
    model = build(BASE_CLASSES[arch], config, attn="sdpa")
    ids, mask = padded_batch(padding=padding)
    with torch.no_grad():
        fast, valid = run(model, arch, ids, mask)
        model.set_attn_implementation("eager")
        ref, _ = run(model, arch, ids, mask)
    # every position, padding included: fully masked rows are zeros on both backends
    assert max_diff(fast.last_hidden_state, ref.last_hidden_state) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "options",
    [
        dict(norm_type="rmsnorm", mlp_type="gated", hidden_act="silu", pre_norm=True),
        dict(norm_type="layernorm", pre_norm=False, embedding_norm=True, scale_embeddings=True),
        dict(attention_bias=False, mlp_bias=False, attention_scale=1.0 / 16, head_dim=16, hidden_act="relu"),
    ],
    ids=["llama-like", "bert-like", "t5-like"],
)
def test_sdpa_matches_eager_options_with_gradients(arch, options, report):
    config = tiny_config(arch, position_embedding_type="rope", num_key_value_heads=2, **options)
    ids, mask = padded_batch(padding="right")
    grads, outs = {}, {}
    model = build(LM_CLASSES[arch], config, attn="eager")
    model.train()  # dropouts are 0 in tiny_config; train mode exercises the training path
    for attn in ("eager", "sdpa"):
        model.set_attn_implementation(attn)
        model.zero_grad()
        labels = ids.masked_fill(mask == 0, -100)
        out, _ = run(model, arch, ids, mask, labels=labels[:, :6] if arch == "seq2seq" else labels)
        out.loss.backward()
        outs[attn] = out.logits.detach()
        grads[attn] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    report("logits max abs diff", max_diff(outs["eager"], outs["sdpa"]))
    assert max_diff(outs["eager"], outs["sdpa"]) <= TOL
    worst = max(max_diff(grads["eager"][n], grads["sdpa"][n]) for n in grads["eager"])
    report("grad max abs diff", worst)
    assert grads["eager"].keys() == grads["sdpa"].keys()
    assert worst <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("position", ["rope", "alibi", "relative_bias"])
def test_output_attentions_under_sdpa_equal_eager(arch, position):
    config = tiny_config(arch, position_embedding_type=position, num_key_value_heads=2)
    model = build(BASE_CLASSES[arch], config, attn="sdpa")
    ids, mask = padded_batch(padding="right")
    with torch.no_grad():
        fast, _ = run(model, arch, ids, mask, output_attentions=True)
        model.set_attn_implementation("eager")
        ref, _ = run(model, arch, ids, mask, output_attentions=True)
    names = (
        ["attentions"]
        if arch != "seq2seq"
        else ["encoder_attentions", "decoder_attentions", "cross_attentions"]
    )
    for name in names:
        got, want = getattr(fast, name), getattr(ref, name)
        assert len(got) == config.num_hidden_layers and all(w is not None for w in got)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.shape[1] == config.num_attention_heads
            assert max_diff(g, w) <= TOL
    # Rows sum to one over allowed keys; padding keys get exactly zero weight.
    attn = (fast.attentions if arch != "seq2seq" else fast.encoder_attentions)[0]
    key_pad = (mask == 0)[:, None, None, :].expand_as(attn)
    assert torch.all(attn[key_pad] == 0)


def test_causal_attention_weights_are_zero_above_the_diagonal():
    model = build(swapformer.DecoderModel, tiny_config("decoder"), attn="sdpa")
    ids, _ = padded_batch(padding="none")
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions[0]
    upper = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)
    assert torch.all(weights[..., upper] == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))


def test_set_attn_implementation_switches_the_kernel_that_runs():
    """The logits match, and the profiler shows which kernel actually ran."""
    config = tiny_config("decoder", num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids, mask = padded_batch(padding="left")

    def ops_and_logits():
        with (
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
            torch.no_grad(),
        ):
            logits = model(ids, attention_mask=mask).logits
        return {e.key for e in prof.key_averages()}, logits

    sdpa_ops, sdpa_logits = ops_and_logits()
    model.set_attn_implementation("eager")
    eager_ops, eager_logits = ops_and_logits()
    assert "aten::scaled_dot_product_attention" in sdpa_ops
    assert "aten::scaled_dot_product_attention" not in eager_ops
    assert max_diff(sdpa_logits, eager_logits) <= TOL


class TestBackendChoiceErrors:
    def test_unknown_backend_in_config(self):
        with pytest.raises(
            ValueError, match=r'attn_implementation="bogus"` is not supported.*"eager"`, `"sdpa"`'
        ):
            swapformer.DecoderConfig(attn_implementation="bogus")

    def test_unknown_backend_in_from_config(self):
        with pytest.raises(ValueError, match='attn_implementation="bogus"`'):
            AutoModelForCausalLM.from_config(tiny_config("decoder"), attn_implementation="bogus")

    def test_flash_without_flash_attn_says_what_to_use(self):
        model = AutoModelForCausalLM.from_config(tiny_config("decoder"), attn_implementation="eager")
        with pytest.raises(
            ValueError, match="'flash_attention_2' (runs on CUDA only|needs the flash_attn package).*'sdpa'"
        ):
            model.set_attn_implementation("flash_attention_2")
        assert model.config._attn_implementation == "eager"  # nothing changed

    def test_from_pretrained_checks_the_backend(self, tmp_path):
        AutoModelForCausalLM.from_config(
            tiny_config("decoder", position_embedding_type="alibi")
        ).save_pretrained(tmp_path)
        with pytest.raises(ValueError, match="'flex_attention' does not support position_bias.*'sparse'"):
            AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flex_attention")
