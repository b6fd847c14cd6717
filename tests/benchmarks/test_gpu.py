"""GPU checks: every CUDA backend against eager, forward and backward, plus a speed print.

Skipped where there is no CUDA device. On a GPU machine:

    python -m pytest tests/benchmarks/test_gpu.py -s

flash_attention_2 additionally needs the flash-attn package (`pip install 'swapformer[flash]'`).
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

import swapformer
from swapformer.configuration.configuration_swapformer import LAYER_TYPES

from conftest import build, load_benchmark, max_diff, padded_batch, pattern_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LENGTH = 96


# windows and blocks well below LENGTH, so that every pattern leaves keys out
CUDA_SIZES = dict(sliding_window=9, attention_block_size=16, num_key_value_heads=2, hidden_size=64)


def cuda_model(arch, layer_type, dtype):
    model_class = swapformer.EncoderModel if arch == "encoder" else swapformer.DecoderModel
    config = pattern_config(arch, layer_type, max_position_embeddings=128, **CUDA_SIZES)
    return build(model_class, config).to("cuda", dtype)


def run(model, attn, ids, mask):
    model.set_attn_implementation(attn)
    model.zero_grad()
    out = model(ids.cuda(), attention_mask=None if mask is None else mask.cuda()).last_hidden_state
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().float(), grads


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
@pytest.mark.parametrize("attn", ["sdpa", "sparse", "flex_attention"])
def test_cuda_backends_match_eager_fp32(attn, layer_type, arch, report):
    model = cuda_model(arch, layer_type, torch.float32)
    model.train()
    ids, mask = padded_batch(length=LENGTH, padding="right")
    ref, ref_grads = run(model, "eager", ids, mask)
    got, grads = run(model, attn, ids, mask)
    report(f"{attn} {layer_type} {arch} output diff", max_diff(got, ref))
    assert max_diff(got, ref) <= 1e-4  # TF32 may be on for matmuls on Ampere+
    assert max(max_diff(grads[n], ref_grads[n]) for n in ref_grads) <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
@pytest.mark.parametrize("attn", ["flash_attention_2", "sdpa_fa"])
def test_flash_kernels_match_eager(attn, layer_type, dtype, report):
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    if attn == "sdpa_fa" and layer_type != "full_attention":
        pytest.skip("sdpa_fa computes full attention only (the capability table says so)")
    model = cuda_model("decoder", layer_type, dtype)
    ids, _ = padded_batch(length=LENGTH, padding="none")
    ref, _ = run(model, "eager", ids, None)
    got, _ = run(model, attn, ids, None)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 5e-3
    report(f"{attn} {layer_type} {dtype} output diff", max_diff(got, ref))
    assert max_diff(got, ref) <= tolerance * max(1.0, ref.abs().max().item())


def test_sdpa_fa_refuses_padding():
    model = cuda_model("decoder", "full_attention", torch.float16)
    model.set_attn_implementation("sdpa_fa")
    ids, mask = padded_batch(length=LENGTH, padding="left")
    with pytest.raises(ValueError, match="sdpa_fa"):
        model(ids.cuda(), attention_mask=mask.cuda())


def test_speed_print():
    """Not an assertion: prints the 8k-token layer times on this GPU for the README."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from swapformer.modeling.attention.lowering import lower
    from swapformer.modeling.sparse.sparse import sparse_attention_forward

    bench = load_benchmark("attention_sparse")  # its layer pattern: window 129, 1 global, blocks of 64
    n, heads, dim = 8192, bench.HEADS, bench.HEAD_DIM
    q, k, v = (torch.randn(1, heads, n, dim, device="cuda", dtype=torch.float16) for _ in range(3))
    pattern = bench.make_pattern(n, "sliding_global", device="cuda")

    class Module(torch.nn.Module):
        is_causal, num_key_value_groups, training = False, 1, False

    for name, fn in (("sdpa", sdpa_attention_forward), ("sparse", sparse_attention_forward)):
        mask = lower(pattern, name, q.dtype)
        fn(Module(), q, k, v, mask)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            fn(Module(), q, k, v, mask)
        torch.cuda.synchronize()
        print(
            f"\n8k tokens, window 257 + 1 global, fp16: {name} {(time.perf_counter() - start) * 100:.2f} ms"
        )
