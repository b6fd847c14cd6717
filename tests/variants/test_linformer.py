"""Linformer (config.linformer_k, modeling/variants/linformer.py) against a reference written from the paper's
definition (Wang et al. 2020, https://arxiv.org/abs/2006.04768, eq. 7):

    head = softmax(Q (E K)^T / sqrt(d)) (F V),  E, F: (k, n)

in plain torch here, from the module's own weights: nothing of swapformer's attention code is used.
Padded keys and values are zeroed before the projection and a sequence of n_in tokens uses the first
n_in columns of E and F (the choices modeling/variants/linformer.py documents).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

import swapformer

from conftest import ROOT, build, max_diff, padded_batch, tiny_config
from remote_code_check import load_without_swapformer

TOL = 1e-5
SHARINGS = ("layerwise", "key_value", "headwise")


def linformer_config(**overrides):
    options = dict(position_embedding_type="learned", linformer_k=5) | overrides
    return tiny_config("encoder", **options)


def reference_attention(attn, x, valid, e, f):
    """One layer's self-attention output (B, T, E) from the definition: Q, K, V from the module's
    projections, padded K and V rows zeroed, K' = E[:, :T] K, V' = F[:, :T] V, per head
    softmax(Q K'^T / sqrt(d)) V', heads concatenated, then o_proj."""
    b, t, _ = x.shape
    h, d = attn.num_heads, attn.head_dim
    q = torch.nn.functional.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(b, t, h, d).transpose(1, 2)
    k = torch.nn.functional.linear(x, attn.k_proj.weight, attn.k_proj.bias)
    v = torch.nn.functional.linear(x, attn.v_proj.weight, attn.v_proj.bias)
    k, v = k * valid[:, :, None], v * valid[:, :, None]  # (B, T, K * D), padding zeroed
    kv_heads = k.shape[-1] // d
    k = k.view(b, t, kv_heads, d).transpose(1, 2)
    v = v.view(b, t, kv_heads, d).transpose(1, 2)
    k, v = e[:, :t] @ k, f[:, :t] @ v  # (B, K, k, D)
    groups = h // kv_heads
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    probs = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(b, t, h * d)
    return attn.o_proj(out)


def projections(model, sharing, layer):
    w = model.linformer.weight
    if sharing == "layerwise":
        return w[0], w[0]
    if sharing == "key_value":
        return w[layer], w[layer]
    return w[2 * layer], w[2 * layer + 1]


@pytest.mark.parametrize("backend", ["eager", "sdpa", "sparse"])
@pytest.mark.parametrize("sharing", SHARINGS)
def test_attention_equals_the_definition(sharing, backend):
    """Each layer's attention output equals the reference, on padded rows, for every sharing and backend
    the capability table says runs Linformer (GQA: 2 kv heads for 4 query heads)."""
    config = linformer_config(linformer_sharing=sharing, num_key_value_heads=2)
    model = build(swapformer.EncoderModel, config, attn=backend)
    ids, mask = padded_batch(length=12)
    seen = {}
    hooks = [
        layer.self_attn.register_forward_hook(
            lambda m, args, out, i=i: seen.__setitem__(i, (args[0], out[0]))
        )
        for i, layer in enumerate(model.layers)
    ]
    with torch.no_grad():
        model(ids, attention_mask=mask)
        for i, layer in enumerate(model.layers):
            x, got = seen[i]
            want = reference_attention(layer.self_attn, x, mask.float(), *projections(model, sharing, i))
            assert max_diff(got, want, mask) <= TOL, (sharing, backend, i)
    for hook in hooks:
        hook.remove()
    # the parameter holds one, L or 2L matrices of (k, n)
    assert model.linformer.weight.shape == ({"layerwise": 1, "key_value": 2, "headwise": 4}[sharing], 5, 64)


def test_shapes_and_backends_agree_with_rope():
    """RoPE (keys rotated, then projected): eager, sdpa and sparse agree, weights are (B, H, T, k)."""
    config = linformer_config(position_embedding_type="rope", linformer_sharing="headwise")
    ids, mask = padded_batch(length=12)
    outs = {}
    for backend in ("eager", "sdpa", "sparse"):
        model = build(swapformer.EncoderForMaskedLM, config, attn=backend)
        with torch.no_grad():
            outs[backend] = model(ids, attention_mask=mask, output_attentions=True)
        assert outs[backend].logits.shape == (3, 12, config.vocab_size)
        assert [a.shape for a in outs[backend].attentions] == [(3, 4, 12, 5)] * 2
    for backend in ("sdpa", "sparse"):
        assert max_diff(outs[backend].logits, outs["eager"].logits) <= TOL
        for a, b in zip(outs[backend].attentions, outs["eager"].attentions):
            assert max_diff(a, b) <= TOL
    assert torch.allclose(outs["eager"].attentions[0].sum(-1), torch.ones(3, 4, 12))


def test_right_padding_changes_nothing():
    """Zeroed padding adds nothing to E K and F V: a right-padded row equals the row alone."""
    model = build(swapformer.EncoderModel, linformer_config())
    ids, mask = padded_batch(length=12)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).last_hidden_state
        for row in range(3):
            n = int(mask[row].sum())
            alone = model(ids[row : row + 1, :n]).last_hidden_state
            assert max_diff(batch[row : row + 1, :n], alone) <= TOL, row


def test_linformer_changes_the_function():
    """The option acts: the same weights without the projection give other outputs."""
    ids, mask = padded_batch(length=12)
    with torch.no_grad():
        low = build(swapformer.EncoderModel, linformer_config())(ids, attention_mask=mask).last_hidden_state
        full = build(swapformer.EncoderModel, linformer_config(linformer_k=None))(ids, attention_mask=mask)
    assert max_diff(low, full.last_hidden_state, mask) > 1e-2


def test_gradients_match_between_backends_and_reach_the_projections():
    """Training forward: gradients of every weight, E and F included, equal eager's on sdpa."""
    ids, mask = padded_batch(length=12)
    probe = torch.randn(3, 12, 32, generator=torch.Generator().manual_seed(1)) / 32
    grads = {}
    for backend in ("eager", "sdpa"):
        model = build(swapformer.EncoderModel, linformer_config(linformer_sharing="headwise"), attn=backend)
        model.train()
        (model(ids, attention_mask=mask).last_hidden_state * probe).sum().backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    g = grads["eager"]["linformer.weight"]
    assert g is not None and g[:, :, :12].abs().amax(dim=(1, 2)).min() > 0  # every E and F learns
    assert torch.equal(g[:, :, 12:], torch.zeros_like(g[:, :, 12:]))  # columns past the input: none
    for name, grad in grads["eager"].items():
        assert max_diff(grads["sdpa"][name], grad) <= 1e-5, name


def test_projection_gradcheck():
    """Exact gradients of the projection and attention (fp64 gradcheck through the encoder layer, on sdpa:
    eager's softmax runs in fp32)."""
    config = linformer_config(
        num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=2, intermediate_size=8
    )
    model = build(swapformer.EncoderModel, config, attn="sdpa").double()
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    weight = model.linformer.weight.detach().clone().requires_grad_(True)
    del model.linformer.weight  # a plain tensor in its place: gradcheck differentiates it

    def f(embeds, weight):
        model.linformer.weight = weight
        return model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state

    embeds = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (embeds, weight))


def test_config_refuses_what_linformer_cannot_do():
    cases = [
        (swapformer.DecoderConfig, {}, "a decoder is causal"),
        (swapformer.Seq2SeqConfig, dict(decoder_start_token_id=1), "an encoder-decoder's decoder is causal"),
        (
            swapformer.EncoderConfig,
            dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3),
            "'sliding_attention' layers",
        ),
        (swapformer.EncoderConfig, dict(position_embedding_type="alibi"), "position_embedding_type='alibi'"),
        (swapformer.EncoderConfig, dict(linformer_k=65), "linformer_k=65 exceeds max_position_embeddings=64"),
        (swapformer.EncoderConfig, dict(linformer_sharing="all"), "linformer_sharing='all'"),
    ]
    for cls, options, message in cases:
        base = dict(num_hidden_layers=2, max_position_embeddings=64, linformer_k=5) | options
        with pytest.raises(ValueError, match=message.replace("(", r"\(")) as info:
            cls(**base)
        assert "linformer" in str(info.value)
    with pytest.raises(TypeError, match="linformer_k must be an int"):
        swapformer.EncoderConfig(linformer_k=2.5)
    # the fix each message names works
    swapformer.EncoderConfig(max_position_embeddings=64, linformer_k=5)
    swapformer.DecoderConfig(linformer_k=None)


def test_batch_refusals():
    model = build(swapformer.EncoderModel, linformer_config())
    with pytest.raises(ValueError, match="Linformer projects at most max_position_embeddings=64"):
        model(inputs_embeds=torch.randn(1, 65, 32), position_ids=torch.zeros(1, 65, dtype=torch.long))
    rope = build(swapformer.EncoderModel, linformer_config(position_embedding_type="rope"))
    with pytest.raises(ValueError, match="Linformer projects at most max_position_embeddings=64"):
        rope(torch.ones(1, 65, dtype=torch.long))
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    with pytest.raises(ValueError, match="cannot keep packed sequences apart"):
        model(torch.arange(3, 15)[None], position_ids=packed)


def test_flex_is_refused_with_the_tables_reason():
    with pytest.raises(ValueError) as info:
        build(swapformer.EncoderModel, linformer_config(), attn="flex_attention")
    message = str(info.value)
    assert message.startswith("attn_implementation='flex_attention' does not support Linformer"), message
    assert "'eager', 'sdpa', 'sparse'" in message
    model = build(swapformer.EncoderModel, linformer_config(), attn="sdpa")
    with pytest.raises(ValueError, match="flex_attention"):
        model.set_attn_implementation("flex_attention")
    assert model.config._attn_implementation == "sdpa"


def test_save_and_load(tmp_path):
    from transformers import AutoModelForMaskedLM

    model = build(swapformer.EncoderForMaskedLM, linformer_config(linformer_sharing="key_value"), attn="sdpa")
    ids, mask = padded_batch(length=12)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["linformer_k"], saved["linformer_sharing"]) == (5, "key_value")
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.model.linformer.weight, model.model.linformer.weight)
    with torch.no_grad():
        assert max_diff(loaded(ids, attention_mask=mask).logits, want) <= TOL


def test_remote_code_loads_without_swapformer(tmp_path):
    """The tests/conversion/test_remote_code.py check on a Linformer encoder: a Python where swapformer
    cannot be imported loads the folder with trust_remote_code=True and gives the same logits on sdpa and
    eager."""
    model = build(swapformer.EncoderForMaskedLM, linformer_config(linformer_sharing="headwise"), attn="sdpa")
    ids, mask = padded_batch(padding="right")
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    assert (folder / "linformer.py").exists()
    result = load_without_swapformer(folder, "AutoModelForMaskedLM", "encoder", tmp_path, ids, mask, logits)
    assert result["sdpa"] <= TOL and result["eager"] <= TOL


def test_trainer_step_updates_the_projections(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = build(swapformer.EncoderForMaskedLM, linformer_config(), attn="sdpa").train()
    before = model.model.linformer.weight.detach().clone()
    data = [{"input_ids": list(range(3, 15)), "labels": list(range(3, 15))} for _ in range(4)]
    args = TrainingArguments(
        tmp_path / "out",
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = (model.model.linformer.weight - before).abs()
    assert changed[..., :12].amax() > 0 and changed[..., 12:].amax() == 0


@pytest.mark.slow
def test_benchmark_smoke(capsys):
    """benchmarks/linformer.py at tiny size: every case has a time and a memory figure, full attention is
    its own reference (ratio 1), and the printed table has every row. Slow: ~35 s on a loaded machine,
    most of it the memory child's imports."""
    import importlib.util

    path = ROOT / "benchmarks" / "linformer.py"
    if str(path.parent) not in sys.path:  # the benchmarks import their shared measure.py
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("linformer_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    size = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64)
    rows = bench.table([32, 64], rounds=1, size=size, k=8)
    assert [(r["n"], r["variant"], r["backend"]) for r in rows] == list(bench.cases([32, 64]))
    assert len(rows) == 8
    for r in rows:
        assert r["ms"] > 0 and r["mib"] >= 0
        if r["variant"] == "full":
            assert r["time_ratio"] == 1.0
    model = bench.model_for(64, "linformer", "sdpa", size=size, k=8)
    assert model.linformer.weight.shape == (1, 8, 64)
    bench.print_table(rows, 8)
    out = capsys.readouterr().out
    assert out.count("| linformer |") == 4 and "linformer_k=8" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only backends")
@pytest.mark.parametrize("backend", ["sdpa_fa", "flash_attention_2"])
def test_cuda_backends_equal_eager(backend):
    """The table's CUDA rows: the projected rows need no mask, so FlashAttention kernels run Linformer
    (padded batch, bfloat16, compared with eager in bfloat16). Not run on CPU-only machines."""
    if backend == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    ids, mask = padded_batch(length=12)
    ids, mask = ids.cuda(), mask.cuda()
    outs = {}
    for name in ("eager", backend):
        model = build(swapformer.EncoderModel, linformer_config()).to("cuda", torch.bfloat16)
        model.set_attn_implementation(name)
        with torch.no_grad():
            outs[name] = model(ids, attention_mask=mask).last_hidden_state
    assert max_diff(outs[backend], outs["eager"], mask) <= 5e-2


def test_converting_back_to_transformers_is_refused(tmp_path):
    """A converted BERT given Linformer has no BERT counterpart: --to-hf refuses, naming Linformer."""
    from transformers import AutoModelForMaskedLM, BertConfig, BertForMaskedLM

    from swapformer.conversion.checkpoint import ConversionError, convert

    bert = BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48
    )
    BertForMaskedLM(bert).save_pretrained(tmp_path / "bert")
    convert(tmp_path / "bert", tmp_path / "ours", log=lambda s: None)
    AutoModelForMaskedLM.from_pretrained(tmp_path / "ours", linformer_k=8).save_pretrained(tmp_path / "lin")
    with pytest.raises(ConversionError, match=r"uses Linformer \(linformer_k=8\)"):
        convert(tmp_path / "lin", tmp_path / "back", to_hf=True, log=lambda s: None)
    assert not (tmp_path / "back").exists()
