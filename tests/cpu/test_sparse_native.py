"""The sparse backend's native fp32 CPU kernels (modeling/cpu/sparse_native.py, cpu/csrc/sparse_native.cpp):
they build here, equal dense SDPA with the pattern's mask and the PyTorch path on drawn layers, serve
exactly the calls the module docstring names, and their route is chosen and refused as documented.
The pattern oracle's property tests (test_pattern_oracle.py) run them too, on every drawn model."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import swapformer
from swapformer.modeling.attention.lowering import lower
from swapformer.modeling.cpu import sparse_native
from swapformer.modeling.sparse import sparse as sparse

from conftest import (
    SPARSE_CPU_ROUTES,
    build,
    cached_step_diffs,
    max_diff,
    odd_strides,
    padded_batch,
    pattern_config,
    route_env_fixture,
)
from pattern_cases import layer_pattern, sparse_layer_pattern

needs_native = pytest.mark.skipif(
    "native" not in SPARSE_CPU_ROUTES,
    reason=f"native kernels cannot be built here: {sparse_native._missing()}",
)


env_route = route_env_fixture(sparse_native, "_default", "_auto")


def test_native_kernels_build_here():
    """On a machine with a C++ compiler and ninja (CI's), the kernels build and load; where they
    cannot, the reason is named (and the tests that need them are skipped with it)."""
    missing = sparse_native._missing()
    if missing is not None:
        pytest.skip(missing)
    sparse_native.build()
    assert hasattr(torch.ops.swapformer_sparse_native, "band_attention")


@st.composite
def layers(draw):
    """One sparse layer's pattern and inputs: batch 1-3 with padding on either side, heads with GQA,
    head dims that do and do not fill a vector, blocks of 1-96 rows (96: two row tiles; 1 with windows
    of 1-3: masks one key wide), windows, causal or not, 0-20 leading global tokens per row (up to two
    vectors of global keys), a cached chunk (queries after earlier keys), a per-head position bias, and
    whether q, k, v and the masks are strided views (`odd_strides`)."""
    batch = draw(st.integers(1, 3))
    kv_heads, groups = draw(st.sampled_from([(1, 1), (2, 1), (2, 2), (1, 4)]))
    head_dim = draw(st.sampled_from([8, 16, 24, 64, 80]))
    block = draw(st.sampled_from([1, 8, 16, 64, 96]))
    length = draw(st.integers(1, 260))
    past = draw(st.sampled_from([0, 0, 7, 150]))  # 150: the bands start past key 0
    causal = draw(st.booleans())
    window = draw(st.integers(1, 90 if block > 1 else 3))
    total = past + length
    key_valid = torch.ones(batch, total, dtype=torch.bool)
    for row in range(batch):
        pad = draw(st.integers(0, total // 3))
        if draw(st.booleans()):
            key_valid[row, :pad] = False
        else:
            key_valid[row, total - pad :] = False
    counts = torch.tensor([draw(st.integers(0, 20)) for _ in range(batch)])
    real = key_valid.long().cumsum(-1) - 1
    glob = key_valid & (real < counts[:, None])
    bias = draw(st.booleans())
    slopes = torch.linspace(-1.0, 2.0, kv_heads * groups) * 0.05
    extra = {}
    if bias:
        positions = torch.arange(total)[None].expand(batch, -1)
        extra = dict(
            bias_fn=lambda q, k: (q - k).float()[..., None] * slopes,
            query_pos=positions[:, past:],
            key_pos=positions,
        )
    glob = glob if bool(glob.any()) else None
    pattern = sparse_layer_pattern(batch, length, causal, window, block, key_valid, glob, past=past, **extra)
    seed = draw(st.integers(0, 2**16))
    return pattern, kv_heads, groups, head_dim, seed, draw(st.booleans())


@needs_native
@settings(max_examples=200, deadline=None, derandomize=True)
@given(case=layers())
def test_native_equals_dense_sdpa_and_the_pytorch_path(case):
    """On every drawn layer the native kernels' output equals SDPA with the pattern's dense additive
    mask on rows that see a key (1e-5), and the PyTorch path's everywhere (rows without any key: 0
    on both); also when q, k, v and the layout's masks are strided views."""
    pattern, kv_heads, groups, head_dim, seed, strided = case
    gen = torch.Generator().manual_seed(seed)
    heads, t, s = kv_heads * groups, pattern.query_length, pattern.key_length
    q = torch.randn(pattern.batch, heads, t, head_dim, generator=gen)
    k, v = (torch.randn(pattern.batch, kv_heads, s, head_dim, generator=gen) for _ in range(2))
    layout = lower(pattern, "sparse", torch.float32)
    if strided:
        q, k, v = (odd_strides(x) for x in (q, k, v))
        masks = {name: getattr(layout, name) for name in ("mask", "global_key_mask", "global_mask")}
        layout = replace(layout, **{name: odd_strides(m) for name, m in masks.items() if m is not None})
    with torch.no_grad():
        with swapformer.sparse_cpu("native"):
            native = sparse.sparse_attention_forward(None, q, k, v, layout)[0]
        with swapformer.sparse_cpu("torch"):
            torch_path = sparse.sparse_attention_forward(None, q, k, v, layout)[0]
        additive = pattern.additive(torch.float32)
        dense = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=additive
        ).transpose(1, 2)
    live = pattern.dense_allowed()[:, 0].any(-1)  # (B, T) rows that see at least one key
    assert native.shape == torch_path.shape == (pattern.batch, t, heads, head_dim)
    assert max_diff(native[live], dense[live]) <= 1e-5
    assert max_diff(native, torch_path) <= 1e-5
    assert bool((native[~live] == 0).all())


@needs_native
def test_native_kernels_serve_exactly_the_documented_calls(monkeypatch):
    """fp32 CPU inference runs the kernels; a recorded gradient, dropout, fp64, BigBird's random keys
    or route "torch" take the PyTorch path (which the `calls` counter does not see)."""
    calls = []
    real_attend = sparse_native.attend
    monkeypatch.setattr(
        sparse, "sparse_native_attend", lambda *a, **kw: calls.append(1) or real_attend(*a, **kw)
    )

    layout = lower(layer_pattern(False, "right", [2, 3]), "sparse", torch.float32)
    q = torch.randn(2, 4, 45, 8, requires_grad=True)
    k, v = torch.randn(2, 4, 45, 8), torch.randn(2, 4, 45, 8)

    def run(route="native", dropout=0.0, dtype=torch.float32, grad=False, layout=layout):
        with swapformer.sparse_cpu(route), torch.set_grad_enabled(grad):
            sparse.sparse_attention_forward(
                None,
                q.detach().to(dtype).requires_grad_(grad),
                k.to(dtype),
                v.to(dtype),
                layout,
                dropout=dropout,
            )
        served, calls[:] = bool(calls), []
        return served

    assert run()
    assert not run(grad=True)
    assert not run(dropout=0.1)
    assert not run(dtype=torch.float64)
    assert not run(route="torch")
    assert run()
    config = pattern_config("encoder", "bigbird_attention")  # its layouts carry random keys
    model = build(swapformer.EncoderModel, config, attn="sparse")
    ids, mask = padded_batch(length=40, padding="right")
    with torch.no_grad(), swapformer.sparse_cpu("native"):
        model(ids, attention_mask=mask)
    assert not calls


def test_route_from_the_environment_and_its_errors(env_route, monkeypatch):
    """Route "auto" resolves by the CPU (AVX2 or AVX-512 and a buildable kernel: native); "torch" is
    the PyTorch path; a wrong value, or "native" where the kernels cannot be built, fails naming the
    variable, the value and the choices."""
    env_route("torch")
    assert swapformer.sparse_cpu_route() == "torch"
    for capability, vector in (("AVX512", True), ("AVX2", True), ("DEFAULT", False)):
        monkeypatch.setattr(
            torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability
        )
        env_route("auto")
        expected = "native" if vector and sparse_native._missing() is None else "torch"
        assert swapformer.sparse_cpu_route() == expected, capability
    monkeypatch.undo()
    env_route("fast")
    with pytest.raises(ValueError, match=r"SWAPFORMER_SPARSE_CPU is 'fast'.*'auto', 'native', 'torch'"):
        swapformer.sparse_cpu_route()
    with pytest.raises(ValueError, match=r"sparse_cpu\(route\) is 'onednn'"):
        with swapformer.sparse_cpu("onednn"):
            pass
    env_route("native")
    monkeypatch.setattr(sparse_native, "SOURCE", sparse_native.SOURCE.with_name("missing.cpp"))
    with pytest.raises(
        ValueError, match=r"SWAPFORMER_SPARSE_CPU is 'native', but the kernel source missing.cpp"
    ):
        swapformer.sparse_cpu_route()
    env_route("auto")
    assert swapformer.sparse_cpu_route() == "torch"  # no source (remote-code files): the PyTorch path


def test_a_failed_build_warns_under_auto_and_raises_under_native(env_route, monkeypatch):
    """When compiling fails, route "auto" warns once, naming the cause and the way to silence it, and
    runs the PyTorch path (same outputs); route "native" raises the compiler's message."""
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise OSError("c++: fatal error: no input files")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(sparse_native, "_built", None)
    monkeypatch.setattr(sparse_native, "_missing", lambda: None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")

    layout = lower(layer_pattern(True, "left", [1, 2]), "sparse", torch.float32)
    q, k, v = torch.randn(2, 4, 45, 8), torch.randn(2, 4, 45, 8), torch.randn(2, 4, 45, 8)
    env_route("auto")
    with torch.no_grad():
        with pytest.warns(UserWarning, match=r"could not build.*no input files.*SWAPFORMER_SPARSE_CPU=torch"):
            got = sparse.sparse_attention_forward(None, q, k, v, layout)[0]
        with sparse_native.sparse_cpu("torch"):
            want = sparse.sparse_attention_forward(None, q, k, v, layout)[0]
        assert torch.equal(got, want)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the second call is quiet
            sparse.sparse_attention_forward(None, q, k, v, layout)
        monkeypatch.setattr(sparse_native, "_built", None)
        with sparse_native.sparse_cpu("native"), pytest.raises(RuntimeError, match=r"no input files"):
            sparse.sparse_attention_forward(None, q, k, v, layout)


@needs_native
def test_a_model_on_native_kernels_equals_eager_and_generates_the_same():
    """Model level: a window + global encoder on `sparse` gives eager's outputs on the native kernels;
    a sliding-window decoder's cached steps through the kernels give the uncached forward's logits, and
    greedy generation matches the PyTorch path token for token."""
    config = pattern_config("encoder", "sliding_global_attention", num_key_value_heads=2)
    ids, mask = padded_batch(length=40, padding="left")
    real = mask.bool()
    with torch.no_grad():
        eager = build(swapformer.EncoderModel, config)(ids, attention_mask=mask).last_hidden_state
        with swapformer.sparse_cpu("native"):
            native = build(swapformer.EncoderModel, config, attn="sparse")(
                ids, attention_mask=mask
            ).last_hidden_state
    assert max_diff(native[real], eager[real]) <= 1e-5
    config = pattern_config("decoder", "sliding_attention")
    model = build(swapformer.DecoderForCausalLM, config, attn="sparse")
    ids, mask = padded_batch(length=20, padding="left")
    with swapformer.sparse_cpu("native"):
        assert max(cached_step_diffs(model, ids, mask, 8)) <= 1e-4
    prompt, prompt_mask = padded_batch(length=12, padding="left")
    outs = {}
    for route in ("native", "torch"):
        with swapformer.sparse_cpu(route):
            outs[route] = model.generate(
                input_ids=prompt, attention_mask=prompt_mask, max_new_tokens=8, do_sample=False
            )
    assert torch.equal(outs["native"], outs["torch"])


def test_the_environment_is_read_in_a_fresh_process():
    """SWAPFORMER_SPARSE_CPU=torch in a new process: the route is "torch" from the first call."""
    env = {**os.environ, "SWAPFORMER_SPARSE_CPU": "torch"}
    code = "import swapformer; print(swapformer.sparse_cpu_route())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch"
