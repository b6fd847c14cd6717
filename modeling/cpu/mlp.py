"""MLP row chunking, a CPU route: without gradients, an MLP whose activations take more than one chunk
(routes.py: `Seam.mlp_chunk_bytes`, where the measurements behind it are) runs over row chunks with an in-place activation, its projections written into
buffers made once per call, so that `MLP.forward` stays the plain expression `mlp.compute(x, act)`.
`routes.cpu_mlp`, the seam the MLP calls, makes the cheap checks (gradients, compile, the switch, the
size) and enters `chunked` only past them. Off with the other routes (`cpu_routes(False)`,
SWAPFORMER_CPU_ROUTES=off; routes.py); it has no switch of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..compat.torch_compat import module_hooked
from .linear import plain_linear

# In-place forms of activations whose output may overwrite their input when no gradient is taken.
IN_PLACE = {
    "gelu": torch.ops.aten.gelu_,
    "relu": torch.relu_,
    "silu": lambda x: F.silu(x, inplace=True),
}


def chunked(mlp: nn.Module, x: torch.Tensor, chunk_bytes: int, onednn_in_force) -> torch.Tensor:
    """`mlp.compute(x, act)` without gradients for an `x` of more than one chunk: in row chunks with an
    in-place activation, or one plain pass when a hook watches a projection (it sees one call with the
    whole, untouched output). `chunk_bytes`: activations per chunk (routes.Seam.mlp_chunk_bytes);
    `onednn_in_force(x, weight, bias)`: the linear route's own check."""
    projections = [p for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj) if p is not None]
    if any(module_hooked(p) for p in projections):
        return mlp.compute(x, mlp.act_fn)
    act = mlp.act_in_place or mlp.act_fn
    return _in_chunks(mlp, x, projections, act, chunk_bytes, onednn_in_force)


def _in_chunks(mlp: nn.Module, x: torch.Tensor, projections: list, act, chunk_bytes: int, onednn_in_force):
    """The MLP of `x` without gradients, in row chunks of at most `chunk_bytes` of activations."""
    rows, width = x.numel() // x.shape[-1], mlp.up_proj.out_features
    chunks = -(-rows * width * x.element_size() // chunk_bytes)
    step = -(-rows // chunks)
    flat = x.reshape(rows, x.shape[-1])
    if _writable(projections, x) and not onednn_in_force(flat, mlp.up_proj.weight, mlp.up_proj.bias):
        out = _chunks_into_buffers(mlp, flat, step, act)
    else:
        # a wrapped or quantized projection, or the oneDNN route (whose op takes no output buffer;
        # measured faster this way than one pass): called as a module, each chunk's output copied
        out = None
        for i in range(0, rows, step):
            part = mlp.compute(flat[i : i + step], act)
            out = part.new_empty(rows, part.shape[-1]) if out is None else out
            out[i : i + step] = part
    return out.view(*x.shape[:-1], out.shape[-1])


def _writable(projections: list[nn.Module], x: torch.Tensor) -> bool:
    """Whether every projection is a plain `nn.Linear` with plain weights of x's dtype, so its output
    can be written into a given buffer (not a PEFT wrapper, a quantized weight, an offloaded one,
    autocast)."""
    return not torch.is_autocast_enabled(x.device.type) and all(
        plain_linear(p) and all(type(t) is nn.Parameter and t.dtype == x.dtype for t in p.parameters())
        for p in projections
    )


def _chunks_into_buffers(mlp: nn.Module, flat: torch.Tensor, step: int, act) -> torch.Tensor:
    """The MLP of (N, E) rows `step` at a time, each projection written into a buffer made once."""
    rows, width = flat.shape[0], mlp.up_proj.out_features
    out = flat.new_empty(rows, mlp.down_proj.out_features)
    up = flat.new_empty(step, width)
    gate = None if mlp.gate_proj is None else flat.new_empty(step, width)
    for i in range(0, rows, step):
        part = flat[i : i + step]
        h = _linear_into(mlp.up_proj, part, up[: len(part)])
        if gate is not None:
            h = act(_linear_into(mlp.gate_proj, part, gate[: len(part)])).mul_(h)
        else:
            h = act(h)
        _linear_into(mlp.down_proj, mlp.dropout(h), out[i : i + step])
    return out


def _linear_into(linear: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`linear(x)` written into `out`."""
    if linear.bias is None:
        return torch.mm(x, linear.weight.t(), out=out)
    return torch.addmm(linear.bias, x, linear.weight.t(), out=out)
