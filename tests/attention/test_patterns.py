"""Sparse attention patterns are configuration; every backend computes the same function (eager is
the oracle), forward and backward, with and without padding, MHA and GQA, causal, bidirectional and
cross-attention."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModel

import swapformer
from swapformer.configuration.configuration_swapformer import LAYER_TYPES
from swapformer.modeling.attention import lowering as masks_module
from swapformer.modeling.attention.functions import attention_weights
from swapformer.modeling.sparse.bigbird import random_block_table

from conftest import (
    ROOT,
    SPARSE_CPU_ROUTES,
    build,
    cached_step_diffs,
    max_diff,
    padded_batch,
    pattern_config,
    tiny_config,
)
from pattern_cases import layer_pattern

KINDS = {"decoder": "causal", "encoder": "bidirectional", "seq2seq": "cross"}
LENGTH = 40  # five blocks of 8: windows, globals and random blocks all matter


MODEL = {
    "decoder": swapformer.DecoderModel,
    "encoder": swapformer.EncoderModel,
    "seq2seq": swapformer.Seq2SeqModel,
}


def forward_backward(model, arch, ids, mask, attn):
    """Output and gradients (of the input embeddings and of every weight) under backend `attn`."""
    model.set_attn_implementation(attn)
    model.zero_grad()
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    if arch == "seq2seq":
        dec = model.get_input_embeddings()(ids[:, :24]).detach()
        out = model(
            inputs_embeds=embeds,
            attention_mask=mask,
            decoder_inputs_embeds=dec,
            decoder_attention_mask=mask[:, :24],
        )
    else:
        out = model(inputs_embeds=embeds, attention_mask=mask)
    h = out.last_hidden_state
    valid = mask[:, : h.shape[1]].bool()[..., None]
    # a mean loss over real tokens against a fixed random probe, like a training loss in scale
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(3))
    ((h * probe * valid).sum() / valid.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return h.detach(), embeds.grad.clone(), grads


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("arch", list(KINDS), ids=list(KINDS.values()))
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
@pytest.mark.parametrize("attn", ["sdpa", "sparse"])
def test_backend_matches_eager_forward_and_backward(attn, layer_type, arch, padding, kv_heads):
    if arch == "seq2seq" and padding == "left":
        pytest.skip("decoder inputs of a seq2seq are right-padded by construction")
    model = build(MODEL[arch], pattern_config(arch, layer_type, num_key_value_heads=kv_heads))
    model.train()  # dropouts are zero; the training path is what gradients use
    ids, mask = padded_batch(length=LENGTH, padding=padding)
    ref_out, ref_input_grad, ref_grads = forward_backward(model, arch, ids, mask, "eager")
    out, input_grad, grads = forward_backward(model, arch, ids, mask, attn)
    assert max_diff(out, ref_out) <= 1e-5
    assert max_diff(input_grad, ref_input_grad) <= 1e-4
    assert grads.keys() == ref_grads.keys()
    assert max(max_diff(grads[n], ref_grads[n]) for n in grads) <= 1e-4


@pytest.mark.parametrize("position", ["alibi", "relative_bias", "learned", "sinusoidal"])
@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_sparse_with_position_biases(arch, position):
    model = build(MODEL[arch], pattern_config(arch, "bigbird_attention", position_embedding_type=position))
    ids, mask = padded_batch(length=LENGTH, padding="right")
    ref, ref_in, ref_w = forward_backward(model, arch, ids, mask, "eager")
    out, grad_in, grad_w = forward_backward(model, arch, ids, mask, "sparse")
    assert max_diff(out, ref) <= 1e-5 and max_diff(grad_in, ref_in) <= 1e-4
    assert max(max_diff(grad_w[n], ref_w[n]) for n in ref_w) <= 1e-4


@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_window_covering_the_sequence_equals_full_attention(arch):
    ids, mask = padded_batch(length=LENGTH, padding="right")
    windowed = build(
        MODEL[arch], pattern_config(arch, "sliding_attention", sliding_window=LENGTH), attn="sparse"
    )
    full = build(MODEL[arch], pattern_config(arch, "full_attention", sliding_window=LENGTH), attn="eager")
    with torch.no_grad():
        a = windowed(ids, attention_mask=mask).last_hidden_state
        b = full(ids, attention_mask=mask).last_hidden_state
    assert max_diff(a, b, mask) <= 1e-5


def test_window_is_really_applied():
    """A narrow window changes the result (the parity above is not between two full attentions)."""
    ids, mask = padded_batch(length=LENGTH, padding="none")
    narrow = build(swapformer.EncoderModel, pattern_config("encoder", "sliding_attention"), attn="sparse")
    full = build(swapformer.EncoderModel, pattern_config("encoder", "full_attention"), attn="sparse")
    with torch.no_grad():
        assert max_diff(narrow(ids).last_hidden_state, full(ids).last_hidden_state) > 1e-2


@pytest.mark.parametrize("attn", ["sdpa", "sparse"])
def test_per_batch_global_attention_mask(attn):
    model = build(
        swapformer.EncoderModel, pattern_config("encoder", "sliding_global_attention", global_tokens=0)
    )
    ids, mask = padded_batch(length=LENGTH, padding="right")
    marks = torch.zeros_like(ids)
    marks[0, [0, 17]] = 1
    marks[1, 30] = 1
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, global_attention_mask=marks).last_hidden_state
        model.set_attn_implementation(attn)
        got = model(ids, attention_mask=mask, global_attention_mask=marks).last_hidden_state
        without = model(ids, attention_mask=mask).last_hidden_state
    assert max_diff(got, ref) <= 1e-5
    assert max_diff(got[0], without[0]) > 1e-3  # the marks matter
    assert max_diff(got[2], without[2]) <= 1e-6  # row 2 has none


def test_global_attention_mask_of_wrong_shape():
    model = build(swapformer.EncoderModel, pattern_config("encoder", "sliding_global_attention"))
    with pytest.raises(
        ValueError, match=r"global_attention_mask has shape \(1, 3\); it needs \(batch=1, length=4\)"
    ):
        model(torch.tensor([[5, 6, 7, 8]]), global_attention_mask=torch.ones(1, 3))


RANDOM_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from conftest import build, padded_batch, pattern_config  # the working folder is tests/
    import swapformer
    from swapformer.modeling.sparse.bigbird import random_block_table
    table = random_block_table(7, 12, 12, 3, causal=False)
    model = build(swapformer.EncoderModel, pattern_config("encoder", "bigbird_attention", random_seed=7), attn="sparse")
    ids, mask = padded_batch(length=int(sys.argv[1]))
    with torch.no_grad():
        out = model(ids, attention_mask=mask).last_hidden_state
    print(json.dumps({"table": table.nonzero().tolist(), "out": out.flatten()[::97].tolist()}))
    """
)


def test_random_blocks_are_identical_across_processes():
    tests_dir = ROOT / "tests"  # where conftest.py is
    runs = [
        subprocess.run(
            [sys.executable, "-c", RANDOM_SCRIPT, str(LENGTH)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tests_dir,
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first == second
    assert first["table"] == random_block_table(7, 12, 12, 3, causal=False).nonzero().tolist()


def test_random_layout_follows_the_seed_and_respects_causality():
    a, b = random_block_table(1, 16, 16, 3, causal=False), random_block_table(2, 16, 16, 3, causal=False)
    assert not torch.equal(a, b) and int(a.sum(-1).min()) == 3
    causal = random_block_table(1, 16, 16, 3, causal=True)
    assert not causal.triu(1).any()  # never a block after the query's own
    # a growing causal sequence keeps its earlier draws (cached decoding sees the same layout)
    assert torch.equal(random_block_table(1, 8, 8, 3, causal=True), causal[:8, :8])


@pytest.mark.parametrize("attn", ["sdpa", "sparse"])
@pytest.mark.parametrize("layer_type", LAYER_TYPES[1:])
def test_attention_maps_equal_eager_and_are_zero_where_masked(attn, layer_type):
    model = build(
        swapformer.DecoderModel, pattern_config("decoder", layer_type, num_key_value_heads=2), attn=attn
    )
    ids, mask = padded_batch(length=LENGTH, padding="left")
    with torch.no_grad():
        got = model(ids, attention_mask=mask, output_attentions=True).attentions
        model.set_attn_implementation("eager")
        want = model(ids, attention_mask=mask, output_attentions=True).attentions
    for g, w in zip(got, want):
        assert g.shape == (3, 4, LENGTH, LENGTH)
        assert max_diff(g, w) <= 1e-5
    sparse_layer = got[0]
    window = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril().triu(-4)  # 0 <= q - k < 5
    outside = ~window
    outside[:, :2] = False  # global keys
    outside[:2, :] = False  # global queries
    if layer_type == "bigbird_attention":
        outside[:] = False  # random blocks: checked against eager above
    assert torch.all(sparse_layer[0][:, outside] == 0)  # row 0 is unpadded: globals are indices 0, 1


def test_chunked_weight_recompute_matches_one_chunk():
    model = build(swapformer.EncoderModel, pattern_config("encoder", "bigbird_attention"))
    ids, mask = padded_batch(length=LENGTH, padding="right")
    captured = {}

    def grab(module, args, kwargs, output):
        captured.setdefault("q", module.q_proj(args[0]).view(3, LENGTH, 4, 8).transpose(1, 2))
        captured.setdefault("k", module.k_proj(args[0]).view(3, LENGTH, 4, 8).transpose(1, 2))
        captured.setdefault("pattern", kwargs["plan"].pattern)

    hook = model.layers[0].self_attn.register_forward_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model.set_attn_implementation("sparse")
        model(ids, attention_mask=mask)
        attn = model.layers[0].self_attn
        small = attention_weights(
            attn, captured["q"], captured["k"], captured["pattern"], attn.scaling, chunk=7
        )
        whole = attention_weights(
            attn, captured["q"], captured["k"], captured["pattern"], attn.scaling, chunk=10_000
        )
    hook.remove()
    assert torch.equal(small, whole)


def test_per_layer_backend_mapping(monkeypatch, tmp_path):
    """{layer type: backend} works wherever a backend name does, and each layer runs its backend."""
    layer_types = [
        "full_attention" if i % 3 == 0 else "sliding_attention" for i in range(6)
    ]  # ModernBERT-like
    config = tiny_config(
        "encoder", num_hidden_layers=6, layer_types=layer_types, sliding_window=5, attention_block_size=8
    )
    mapping = {"full_attention": "sdpa", "sliding_attention": "sparse"}
    model = AutoModel.from_config(config, attn_implementation=mapping)
    assert model.config.backend_for("sliding_attention") == "sparse"
    ids, mask = padded_batch(length=LENGTH, padding="right")
    calls = []
    monkeypatch.setitem(
        masks_module.LOWERINGS,
        "sparse",
        lambda p, d, f=masks_module.LOWERINGS["sparse"]: calls.append(p.kind) or f(p, d),
    )
    monkeypatch.setitem(
        masks_module.LOWERINGS,
        "sdpa",
        lambda p, d, f=masks_module.LOWERINGS["sdpa"]: calls.append("sdpa:" + p.kind) or f(p, d),
    )
    model.eval()
    with torch.no_grad():
        got = model(ids, attention_mask=mask).last_hidden_state
    assert sorted(calls) == ["sdpa:full", "sliding"]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
    assert max_diff(got, want) <= 1e-5
    model.set_attn_implementation(mapping)
    assert model.config._attn_implementation == swapformer.PER_LAYER_BACKEND
    model.save_pretrained(tmp_path)
    assert "_attn_layer_backends" not in (tmp_path / "config.json").read_text()
    again = AutoModel.from_pretrained(tmp_path, attn_implementation=mapping)
    assert again.config.backend_for("sliding_attention") == "sparse"


class TestChoiceErrors:
    def test_mapping_must_cover_every_layer_type(self):
        config = pattern_config("encoder", "sliding_attention")
        with pytest.raises(ValueError, match=r"gives no backend for layer types \['full_attention'\]"):
            AutoModel.from_config(config, attn_implementation={"sliding_attention": "sparse"})

    def test_mapping_keys_are_layer_types(self):
        with pytest.raises(ValueError, match="mapping key 'encoder' is not a layer type"):
            AutoModel.from_config(
                pattern_config("encoder", "sliding_attention"), attn_implementation={"encoder": "sdpa"}
            )

    def test_flash_cannot_do_global_or_random_patterns(self):
        model = build(swapformer.EncoderModel, pattern_config("encoder", "bigbird_attention"))
        with pytest.raises(
            ValueError, match="'flash_attention_2' does not support 'bigbird' attention.*'sparse'"
        ):
            model.set_attn_implementation("flash_attention_2")

    def test_cuda_only_backend_on_a_cpu_machine(self):
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        model = build(swapformer.DecoderModel, tiny_config("decoder"))
        with pytest.raises(ValueError, match="'sdpa_fa' runs on CUDA only.*'sdpa' or 'sparse'"):
            model.set_attn_implementation("sdpa_fa")

    def test_flex_refuses_position_bias(self):
        # attention_dropout is refused only in training now
        # (tests/configuration/test_attn_choice.py::TestFlexDropout)
        with pytest.raises(ValueError, match="'flex_attention' does not support position_bias"):
            AutoModel.from_config(
                tiny_config("encoder", position_embedding_type="relative_bias"),
                attn_implementation="flex_attention",
            )

    def test_flex_training_on_cpu_fails_at_the_forward(self):
        model = AutoModel.from_config(tiny_config("encoder"), attn_implementation="flex_attention")
        model.train()
        with pytest.raises(ValueError, match="cannot train on CPU.*'sparse' to train"):
            model(torch.tensor([[5, 6, 7]]))


class TestPatternConfig:
    def test_unknown_layer_type(self):
        with pytest.raises(ValueError, match="Unknown layer_types entry='local'"):
            tiny_config("encoder", layer_types=["local", "full_attention"], sliding_window=4)

    def test_layer_types_length(self):
        with pytest.raises(
            ValueError, match=r"layer_types must list one attention type per layer \(num_hidden_layers=2\)"
        ):
            tiny_config("encoder", layer_types=["full_attention"])

    def test_window_needed(self):
        with pytest.raises(ValueError, match="has 'sliding_attention' layers but sliding_window is None"):
            tiny_config("decoder", layer_types=["sliding_attention", "full_attention"])

    def test_window_larger_than_learned_positions(self):
        with pytest.raises(
            ValueError,
            match=r"sliding_window=64 covers the whole learned position table \(max_position_embeddings=64\)",
        ):
            tiny_config("decoder", layer_types=["sliding_attention"] * 2, sliding_window=64)

    def test_decoder_layer_types_of_seq2seq(self):
        with pytest.raises(
            ValueError,
            match=r"decoder_layer_types must list one attention type per layer \(decoder_layers=3\)",
        ):
            tiny_config("seq2seq", decoder_layers=3, decoder_layer_types=["full_attention"])

    def test_round_trip(self, tmp_path):
        config = pattern_config("seq2seq", "bigbird_attention", random_seed=11)
        config.save_pretrained(tmp_path)
        again = type(config).from_pretrained(tmp_path)
        assert again.to_dict() == config.to_dict() and again.decoder_layer_types == config.decoder_layer_types


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, layer_types, padding",
    [
        ("encoder", ["sliding_global_attention", "bigbird_attention"], "right"),
        ("decoder", ["sliding_attention", "bigbird_attention"], "left"),
    ],
)
def test_flex_matches_eager_forward(arch, layer_types, padding):
    """flex compiles on first use (~20 s on CPU): two shapes only, forward only (no CPU backward)."""
    config = pattern_config(arch, layer_types[0], layer_types=layer_types, num_key_value_heads=2)
    model = build(MODEL[arch], config)
    ids, mask = padded_batch(length=LENGTH, padding=padding)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation("flex_attention")
        got = model(ids, attention_mask=mask, output_attentions=True)
        model.set_attn_implementation("eager")
        want_maps = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert max_diff(got.last_hidden_state, want) <= 1e-5
    assert all(max_diff(g, w) <= 1e-5 for g, w in zip(got.attentions, want_maps))


@pytest.mark.parametrize("attn", ["sparse", "sdpa", "eager"])
@pytest.mark.parametrize("layer_type", LAYER_TYPES[1:])
def test_cached_decoding_equals_uncached_forward(attn, layer_type):
    """Every generated step's logits equal an uncached forward over the prefix; sliding layers run on
    transformers' windowed cache (keys older than the window are dropped)."""
    config = pattern_config("decoder", layer_type, attention_block_size=4, num_key_value_heads=2)
    model = build(swapformer.DecoderForCausalLM, config, attn=attn)
    ids, mask = padded_batch(batch=2, length=9, padding="left")
    assert max(cached_step_diffs(model, ids, mask, 12)) <= 1e-4


@pytest.mark.parametrize("attn", ["sparse", "sdpa"])
def test_seq2seq_with_sliding_decoder_keeps_every_encoder_key(attn):
    config = pattern_config(
        "seq2seq", "sliding_attention", sliding_window=3, position_embedding_type="relative_bias"
    )
    model = build(swapformer.Seq2SeqForConditionalGeneration, config, attn=attn)
    ids, mask = padded_batch(batch=2, length=11, padding="right")
    assert max(cached_step_diffs(model, ids, mask, 8)) <= 1e-4


@pytest.mark.parametrize("position", ["rope", "alibi"])  # alibi: a per-head mask
@pytest.mark.parametrize("layer_type", ["sliding_global_attention", "bigbird_attention"])
def test_sparse_block_chunks_give_the_same_result(layer_type, position, monkeypatch):
    """Without gradients the sparse backend runs a few query blocks per kernel call (and the global
    query rows over as many pieces of the keys); one block per call gives the same result as all
    blocks in one call (the path with gradients), and eager's on the real tokens (GQA with a per-head
    mask under ALiBi: the query heads folded into rows)."""
    from swapformer.modeling.sparse import sparse as sparse

    config = pattern_config("decoder", layer_type, num_key_value_heads=2, position_embedding_type=position)
    model = build(swapformer.DecoderModel, config, attn="sparse")
    ids, mask = padded_batch(length=LENGTH, padding="left")
    real = mask.bool()
    with torch.no_grad():
        eager = build(swapformer.DecoderModel, config)(ids, attention_mask=mask).last_hidden_state
        with swapformer.sparse_cpu("torch"):
            whole = model(ids, attention_mask=mask).last_hidden_state
            assert max_diff(whole[real], eager[real]) <= 1e-5
            monkeypatch.setattr(sparse, "CHUNK_BYTES", 1)  # one block per call
            chunked = model(ids, attention_mask=mask).last_hidden_state
    # other chunks are other matmul shapes, so the BLAS sums in another order: a few ulps, by CPU
    # (1.2e-6 on an Intel Xeon with AVX-512 for BigBird; within 1e-6 on an AMD Zen 5)
    assert max_diff(whole, chunked) <= 4e-6
    with torch.enable_grad():
        grad_path = model(ids, attention_mask=mask).last_hidden_state.detach()
    assert max_diff(grad_path, chunked) <= 4e-6
    if "native" in SPARSE_CPU_ROUTES:  # the native kernels (BigBird's random keys: the PyTorch path)
        with torch.no_grad(), swapformer.sparse_cpu("native"):
            native = model(ids, attention_mask=mask).last_hidden_state
        assert max_diff(native[real], eager[real]) <= 1e-5


@pytest.mark.parametrize("globals_per_row", [[1, 3], [1, 1], [0, 1]], ids=["1-3", "1-1", "0-1"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_sparse_global_segment_merged_by_logsumexp(causal, padding, kv_heads, globals_per_row, monkeypatch):
    """The global keys run as one segment beside each block's band, merged by log-sum-exp; that equals
    dense SDPA with the pattern's mask and the path that copies the global keys behind every block's
    band, outputs (with and without gradients, chunked or not) and gradients, in fp64. Rows without
    any key (causal, left padding) come out 0 on both sparse paths. One global key (1-1, 0-1: the
    second also a row where it is masked) takes the path that skips its softmax and matmul."""
    from swapformer.modeling.attention.lowering import lower
    from swapformer.modeling.sparse import sparse as sparse

    pattern = layer_pattern(causal, padding, globals_per_row)
    layout = lower(pattern, "sparse", torch.float64)
    assert layout.global_keys is not None and layout.global_keys.shape[1] == max(globals_per_row)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 45, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 45, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal = causal
    allowed = pattern.dense_allowed()
    reps = 4 // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1), attn_mask=allowed
    ).transpose(1, 2)
    live = allowed[:, 0].any(-1)  # (B, T)
    assert bool((~live).any()) == (causal and padding == "left")
    probe = torch.randn(ref.shape, dtype=torch.float64) * live[:, :, None, None]
    ref_grads = torch.autograd.grad((ref * probe).sum(), (q, k, v))
    ref = ref.detach()

    def run():
        out = sparse.sparse_attention_forward(module, q, k, v, layout)[0]
        return out.detach(), torch.autograd.grad((out * probe).sum(), (q, k, v))

    merged, merged_grads = run()
    with monkeypatch.context() as m:
        m.setattr(sparse, "_merge_segments", lambda *args: False)
        copied, copied_grads = run()
    for out in (merged, copied):
        assert max_diff(out[live], ref[live]) <= 1e-12
    assert max_diff(merged, copied) <= 1e-12  # rows without keys included: 0 on both
    for got, want, other in zip(merged_grads, ref_grads, copied_grads):
        assert max_diff(got, want) <= 1e-12 and max_diff(got, other) <= 1e-12
    with torch.no_grad():
        whole = sparse.sparse_attention_forward(module, q, k, v, layout)[0]
        monkeypatch.setattr(sparse, "CHUNK_BYTES", 1)  # one block per call
        chunked = sparse.sparse_attention_forward(module, q, k, v, layout)[0]
    assert max_diff(whole, merged) <= 1e-12 and max_diff(chunked, merged) <= 1e-12


@pytest.mark.parametrize(
    "case",
    [
        dict(),
        dict(causal=True),
        dict(padding="left"),
        dict(padding="right", causal=True),
        dict(globals_per_row=[2, 0]),
        dict(globals_per_row=[1, 2], padding="left", causal=True),
        dict(query_offset=13, length=20, causal=True),
        dict(query_offset=20, length=1, causal=True, globals_per_row=[1, 1]),
        dict(query_offset=16, length=9, key_offset=11, causal=True, globals_per_row=[0, 0]),
        dict(query_offset=16, length=9, slots=7, causal=True, padding="left"),
        dict(bias=True, padding="right"),
    ],
)
def test_sparse_band_mask_template_equals_the_predicate(case, monkeypatch):
    """Blocks where only the window decides share one template band mask; the layout (mask, rows
    without keys) equals evaluating the predicate on every block: padding, global keys and queries,
    cached chunks, window caches that dropped keys, empty static-cache slots, position bias."""
    from swapformer.modeling.sparse import sparse_layout as sparse

    options = dict(causal=False, padding="none", globals_per_row=[1, 3]) | case
    pattern = layer_pattern(**options)
    template = sparse._regular_blocks(pattern, *_block_indices(pattern), torch.float32)
    assert template is not None
    fast = sparse.lower_sparse(pattern, torch.float32)
    monkeypatch.setattr(sparse, "_regular_blocks", lambda *args: None)
    slow = sparse.lower_sparse(pattern, torch.float32)
    assert torch.equal(fast.mask, slow.mask)
    assert (fast.dead is None) == (slow.dead is None)
    if fast.dead is not None:
        assert torch.equal(fast.dead, slow.dead)


def _block_indices(pattern):
    b = pattern.block_size
    first = pattern.query_offset // b
    n = -(-(pattern.query_offset - first * b + pattern.query_length) // b)
    start = (torch.arange(n) + first) * b
    left, right = pattern.window - 1, (0 if pattern.causal else pattern.window - 1)
    return start[:, None] + torch.arange(b), start[:, None] - left + torch.arange(b + left + right)
