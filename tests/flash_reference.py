"""transformers' flash_attention_2 path on the CPU: the flash-attn kernels replaced by plain-torch
implementations of their contract (`flash_attn_varlen_func`, `flash_attn_func`), for the packing tests
(tests/attention/test_packing.py) and the pattern oracle's flash cases (tests/attention/test_pattern_oracle.py).
A test takes the `reference_flash` fixture (conftest.py loads this module as a plugin) and puts its model on
the path with `on_flash`."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch


def reference_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    deterministic=False,
):
    """flash_attn_varlen_func in plain torch: q (total_q, H, D), k and v (total_k, K, D); each
    sequence attends within itself, causal masks aligned bottom-right, window (left, right)."""
    assert dropout_p == 0.0 and cu_seqlens_q.dtype == torch.int32
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]]
        ks = k[cu_seqlens_k[i] : cu_seqlens_k[i + 1]].repeat_interleave(groups, dim=1)
        vs = v[cu_seqlens_k[i] : cu_seqlens_k[i + 1]].repeat_interleave(groups, dim=1)
        assert len(qs) <= max_seqlen_q and len(ks) <= max_seqlen_k
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
        qi = torch.arange(len(qs))[:, None] + len(ks) - len(qs)
        kj = torch.arange(len(ks))[None, :]
        allowed = torch.ones(len(qs), len(ks), dtype=torch.bool)
        if causal:
            allowed &= kj <= qi
        if window_size[0] >= 0:
            allowed &= kj >= qi - window_size[0]
        if window_size[1] >= 0:
            allowed &= kj <= qi + window_size[1]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[cu_seqlens_q[i] : cu_seqlens_q[i + 1]] = torch.einsum("hqk,khd->qhd", probs, vs)
    return out


def reference_dense(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False
):
    """flash_attn_func: (B, T, H, D) rows of one sequence each."""
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(0, b * t + 1, t, dtype=torch.int32)
    cu_k = torch.arange(0, b * s + 1, s, dtype=torch.int32)
    out = reference_varlen(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        cu_q,
        cu_k,
        t,
        s,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
    )
    return out.view_as(q)


@pytest.fixture
def reference_flash(monkeypatch):
    """transformers' flash_attention_2 path with the kernels replaced by the references above; records
    the varlen calls."""
    from transformers import modeling_flash_attention_utils as fa

    calls = []

    def varlen(*args, **kwargs):
        calls.append(kwargs)
        return reference_varlen(*args, **kwargs)

    varlen.__signature__ = inspect.signature(reference_varlen)
    monkeypatch.setattr(
        fa, "_lazy_imports", lambda *a, **k: (reference_dense, varlen, None, fa._pad_input, fa._unpad_input)
    )
    monkeypatch.setattr(fa, "_loaded_implementation", None)
    # The reference kernels run on the CPU, with gradients: say so in the capability table for this test,
    # or the forward's checks refuse flash_attention_2 on a CPU tensor.
    from swapformer.configuration import backends

    flash = backends.BACKENDS["flash_attention_2"]
    cpu_flash = dataclasses.replace(flash, devices=("cpu", *flash.devices), backward=("cpu", *flash.backward))
    monkeypatch.setitem(backends.BACKENDS, "flash_attention_2", cpu_flash)
    return calls


def on_flash(model):
    """Put a built model on transformers' flash_attention_2 function without the CUDA check."""
    model.config._attn_implementation_internal = "flash_attention_2"
    return model
