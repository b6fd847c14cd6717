"""RoPE laid out as transformers lays it out (issue 26): one `rotary_emb` module per stack whose buffers
are those of transformers' rotary embeddings for the same `rope_parameters`, re-created when a model is
loaded, following dynamic NTK's update as transformers' does; and `partial_rotary_factor`, which rotates
the first `int(head_dim * factor)` dims of each head as StableLM does (its conversion: test_conversion.py
and test_hf_parity.py), on every CPU backend and in cached decoding.

The reference is transformers' own `StableLmRotaryEmbedding` built on the same config: it reads
`partial_rotary_factor` for the default RoPE too (Llama's default ignores it), and the scaled kinds
through `ROPE_INIT_FUNCTIONS` as every transformers model does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from transformers.models.stablelm import modeling_stablelm

import swapformer
from swapformer.configuration.backends import BACKENDS

from conftest import (
    ARCHS,
    BASE_CLASSES,
    LM_CLASSES,
    build,
    cached_step_diffs,
    max_diff,
    padded_batch,
    tiny_config,
)
from hf_models import SCALINGS

TOL = 1e-5
MAX_POSITIONS = 16  # max_position_embeddings of the scaled configs: the tests run past it
CPU_BACKENDS = [n for n, c in BACKENDS.items() if "cpu" in c.devices]


def rope_config(arch, scaling="default", factor=None, **overrides):
    """A tiny config with `scaling`'s rope_parameters (hf_models.SCALINGS, original length 16);
    head_dim 8, so partial factors 0.25 and 0.5 rotate 2 and 4 dims."""
    params = dict(SCALINGS[scaling])
    if factor is not None:
        params["partial_rotary_factor"] = factor
    options = dict(
        position_embedding_type="rope", max_position_embeddings=MAX_POSITIONS, rope_parameters=params
    )
    return tiny_config(arch, **{**options, **overrides})


def rotary_modules(model) -> list:
    """The `rotary_emb` of each stack: the base model's, or the encoder's and the decoder's."""
    if model.config.is_encoder_decoder:
        return [model.encoder.rotary_emb, model.decoder.rotary_emb]
    return [model.rotary_emb]


def reference(config):
    """transformers' rotary embedding on a copy of `config` (its RoPE init functions standardise the
    config they read)."""
    return modeling_stablelm.StableLmRotaryEmbedding(copy.deepcopy(config))


def assert_same_frequencies(ours, ref):
    assert ours.inv_freq.dtype == torch.float32
    assert torch.equal(ours.inv_freq, ref.inv_freq)
    assert torch.equal(ours.original_inv_freq, ref.original_inv_freq)
    assert ours.attention_scaling == ref.attention_scaling


@pytest.mark.parametrize("factor", [None, 0.5])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_rotary_emb_holds_transformers_frequencies(arch, scaling, factor):
    config = rope_config(arch, scaling, factor)
    model = build(BASE_CLASSES[arch], config)
    ref = reference(config)
    for rotary in rotary_modules(model):
        assert_same_frequencies(rotary, ref)
        assert rotary.inv_freq.shape == (int(8 * (factor or 1.0)) // 2,)
        assert not {"inv_freq", "original_inv_freq"} & {n.rpartition(".")[2] for n in model.state_dict()}


def test_no_rotary_emb_without_rope():
    model = build(swapformer.DecoderModel, tiny_config("decoder", position_embedding_type="learned"))
    assert model.rotary_emb is None


@pytest.mark.parametrize("arch", ARCHS)
def test_rotary_buffers_are_recreated_when_loading(arch, tmp_path):
    """transformers' loading leaves non-persistent buffers as torch.empty_like; `_init_weights` refills
    them, so the loaded model has the frequencies and computes what the saved one did."""
    config = rope_config(arch, "yarn", 0.5)
    model = build(LM_CLASSES[arch], config)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, attn_implementation="eager").eval()
    ref = reference(config)
    for rotary in rotary_modules(loaded.base_model):
        assert_same_frequencies(rotary, ref)
    ids, mask = padded_batch(length=20)
    kwargs = dict(decoder_input_ids=ids[:, :6]) if arch == "seq2seq" else {}
    with torch.no_grad():
        assert torch.equal(
            model(ids, attention_mask=mask, **kwargs).logits,
            loaded(ids, attention_mask=mask, **kwargs).logits,
        )


def test_frequencies_stay_fp32_when_the_model_is_cast():
    """`model.to(bfloat16)` would round the frequencies (a position times a rounded frequency is off by
    whole turns on long inputs): they are computed again in fp32 instead."""
    config = rope_config("decoder", "llama3", 0.5)
    model = build(swapformer.DecoderModel, config).to(torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert_same_frequencies(model.rotary_emb, reference(config))


def test_dynamic_frequencies_follow_transformers_update():
    """Dynamic NTK as transformers' `dynamic_rope_update`: rescaled when a forward is longer than any
    since the last reset, kept for shorter ones still past max_position_embeddings, reset under it."""
    config = rope_config("decoder", "dynamic", 0.5)
    model = build(swapformer.DecoderModel, config)
    ref = reference(config)
    for length in (20, 30, 24, 10, 18, 18):
        ids = torch.randint(3, 97, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            model(ids)
            want = ref(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None])
            got = model.rotary_emb(torch.arange(length)[None], torch.float32)
        assert torch.equal(model.rotary_emb.inv_freq, ref.inv_freq), length
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_partial_rotation_is_stablelms():
    """The first int(head_dim * factor) dims rotate in Llama's halves layout, the rest pass unchanged:
    StableLM's split, `apply_rotary_pos_emb` and concatenation."""
    from swapformer.modeling.core.positions import apply_rope

    config = rope_config("decoder", "linear", 0.25, head_dim=16)  # 4 of 16 dims rotate
    rotary = build(swapformer.DecoderModel, config).rotary_emb
    positions = torch.arange(5)[None].expand(2, 5)
    cos, sin = rotary(positions, torch.float32)
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 4, 5, 16)
    q_rot, k_rot = modeling_stablelm.apply_rotary_pos_emb(q[..., :4], k[..., :4], cos, sin)
    assert cos.shape == (2, 5, 4)
    assert torch.equal(apply_rope(q, cos, sin), torch.cat((q_rot, q[..., 4:]), dim=-1))
    assert torch.equal(apply_rope(k, cos, sin), torch.cat((k_rot, k[..., 4:]), dim=-1))


@pytest.mark.parametrize("attn", [b for b in CPU_BACKENDS if b != "eager"])
def test_partial_rotary_on_every_cpu_backend_equals_eager(attn):
    config = rope_config(
        "decoder", "yarn", 0.5, layer_types=["sliding_attention", "full_attention"], sliding_window=3
    )
    model = build(swapformer.DecoderModel, config, attn="eager")
    ids, mask = padded_batch(length=20, padding="left")
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation(attn)
        got = model(ids, attention_mask=mask).last_hidden_state
    assert max_diff(got, want, mask) <= TOL


@pytest.mark.parametrize("scaling", ["default", "yarn"])
@pytest.mark.parametrize("factor", [0.25, 0.5])
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_cached_decoding_with_partial_rotary_equals_the_uncached_forward(arch, factor, scaling):
    model = build(LM_CLASSES[arch], rope_config(arch, scaling, factor, num_key_value_heads=2), attn="sdpa")
    ids, mask = padded_batch(length=12, padding="left" if arch == "decoder" else "right")
    assert max(cached_step_diffs(model, ids, mask, 8)) <= TOL  # past max_position_embeddings=16


@pytest.mark.parametrize(
    "factor, match",
    [
        (0.375, r"partial_rotary_factor'\]=0.375 rotates int\(head_dim=8 \* 0.375\) = 3 dims"),
        (0.1, r"partial_rotary_factor'\]=0.1 rotates int\(head_dim=8 \* 0.1\) = 0 dims"),
        (1.5, r"partial_rotary_factor'\]=1.5 must be in \(0, 1\]"),
        (0.0, r"partial_rotary_factor'\]=0.0 must be in \(0, 1\]"),
        ("half", r"partial_rotary_factor'\] must be a number in \(0, 1\], got 'half'"),
    ],
)
def test_a_factor_that_rotates_no_or_an_odd_number_of_dims_is_refused(factor, match):
    with pytest.raises(TypeError if isinstance(factor, str) else ValueError, match=match):
        rope_config("decoder", "default", factor)


def test_partial_rotary_needs_rope_positions_and_no_latent_attention():
    with pytest.raises(ValueError, match="partial_rotary_factor.*position_embedding_type='learned'"):
        tiny_config("decoder", rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5})
    with pytest.raises(
        ValueError, match=r"partial_rotary_factor'\]=0.5: multi-head latent.*qk_rope_head_dim"
    ):
        swapformer.DecoderConfig(
            vocab_size=97, hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=48,
            position_embedding_type="rope", kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
            v_head_dim=5, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5},
        )  # fmt: skip


def test_an_odd_head_dim_rotates_an_even_part():
    """As in transformers, a head of odd width is fine when the rotated part is even (9 * 0.5 -> 4)."""
    config = rope_config("decoder", "default", 0.5, head_dim=9)
    assert_same_frequencies(build(swapformer.DecoderModel, config).rotary_emb, reference(config))


@pytest.mark.parametrize(
    "option, match",
    [
        (dict(use_qkv_bias=True), "use_qkv_bias=True"),
        (dict(qk_layernorm=True), "qk_layernorm=True"),
        (dict(use_parallel_residual=True), "use_parallel_residual=True"),
        (dict(hidden_dropout=0.1), r"hidden_dropout=0.1 \(on the MLP branch only.*set it to 0.0"),
    ],
)
def test_stablelm_blocks_swapformer_cannot_compute_are_refused(option, match, tmp_path):
    from swapformer.conversion import convert

    config = T.StableLmConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=48,
        **option,
    )
    T.StableLmForCausalLM(config).save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError, match=match):
        convert(tmp_path / "src", tmp_path / "out", log=lambda line: None)
