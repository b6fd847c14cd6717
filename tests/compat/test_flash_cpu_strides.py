"""The ledger's CPU flash op (`torch_compat.flash_cpu`, `flash_cpu_backward`) on inputs whose last
dimension has a stride other than 1: torch's private op reads each row as contiguous memory whatever
that stride says, so the ledger's functions hand it rows that are (issue 31). Reference: the public
`F.scaled_dot_product_attention` and its autograd gradients on the same values."""

from __future__ import annotations

import torch

from swapformer.modeling.compat import torch_compat

from conftest import max_diff, odd_strides


def test_flash_cpu_reads_strided_rows_as_their_values():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g) for _ in range(3))
    mask = torch.randn(2, 1, 7, 7, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    for name in "qkv":
        args = [odd_strides(x) if x_name == name else x for x_name, x in zip("qkv", (q, k, v))]
        assert args["qkv".index(name)].stride(-1) == 2
        out = torch_compat.flash_cpu(*args, attn_mask=mask, scale=0.3)[0]
        assert max_diff(out, want) <= 1e-5, name


def test_flash_cpu_backward_reads_strided_rows_as_their_values():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 2, 5, 8, generator=g)
    torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5).backward(grad)
    out, lse = torch_compat.flash_cpu(q.detach(), k.detach(), v.detach(), scale=0.5)[:2]
    strided = [odd_strides(x) for x in (grad, q.detach(), k.detach(), v.detach(), out)]
    got = torch_compat.flash_cpu_backward(*strided, lse, 0.0, False, scale=0.5)[:3]
    for name, mine, ref in zip(("dq", "dk", "dv"), got, (q.grad, k.grad, v.grad)):
        assert max_diff(mine, ref) <= 1e-5, name
