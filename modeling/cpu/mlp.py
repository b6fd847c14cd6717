"""MLP row chunking, a CPU route: without gradients the MLP runs over row chunks with an in-place
activation, its projections written into buffers made once per call (see `MLP_CHUNK_BYTES`), so that
`MLP.forward` stays the plain expression `mlp.compute(x, act)`. Off with the other routes
(`cpu_routes(False)`, SWAPFORMER_CPU_ROUTES=off; routes.py); it has no switch of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..compat.torch_compat import module_hooked
from .linear import plain_linear
from .routes import cpu_routes_on, onednn_in_force, routes_off_reason

# In-place forms of activations whose output may overwrite their input when no gradient is taken.
IN_PLACE = {
    "gelu": torch.ops.aten.gelu_,
    "relu": torch.relu_,
    "silu": lambda x: F.silu(x, inplace=True),
}

# Without gradients the MLP runs this many bytes of intermediate activations at a time: glibc hands
# larger blocks out as fresh mappings, so a whole (T, intermediate) activation page-faults and is
# zero-filled by the kernel on every layer (measured: about as long as the GELU itself, and not spread
# over threads). The chunks are equal, and plain `nn.Linear` projections on torch's route write into
# buffers allocated once per call and reused by every chunk: fresh chunk-sized outputs fault too
# whenever glibc has trimmed its heap (a gated BERT-base MLP at 4096 tokens: 36,737 faults per call
# against 5,124, 9% slower; benchmarks/mlp_chunks.py). On the oneDNN route, whose op takes no output
# buffer, each chunk calls the projections through `project`. A model with forward hooks on its
# projections runs the MLP in one plain pass, so hooks see one call with the whole output.
MLP_CHUNK_BYTES = 16 * 2**20


def cpu_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`mlp.compute(x, act)` (layers.MLP), over row chunks with an in-place activation where no
    gradient is taken (see `MLP_CHUNK_BYTES`); one plain pass with gradients, under torch.compile, for
    tensor subclasses, when a hook watches a projection and while the CPU routes are off."""
    projections = [p for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj) if p is not None]
    if (
        torch.compiler.is_compiling()  # first: the switch's context variable is not traceable
        or torch.is_grad_enabled()
        or not cpu_routes_on()
        or type(x) is not torch.Tensor
        or any(module_hooked(p) for p in projections)
    ):
        return mlp.compute(x, mlp.act_fn)
    return _in_chunks(mlp, x, projections, mlp.act_in_place or mlp.act_fn)


def _in_chunks(mlp: nn.Module, x: torch.Tensor, projections: list[nn.Module], act) -> torch.Tensor:
    """The MLP of `x` without gradients, in row chunks of at most `MLP_CHUNK_BYTES` of activations."""
    rows, width = x.numel() // x.shape[-1], mlp.up_proj.out_features
    chunks = -(-rows * width * x.element_size() // MLP_CHUNK_BYTES)
    if chunks <= 1:
        return mlp.compute(x, act)
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


def chunking_in_force() -> str:
    """Whether MLP chunking is in force and why, for `swapformer env`."""
    off = routes_off_reason()
    if off is not None:
        return f"off ({off})"
    return f"on (without gradients, {MLP_CHUNK_BYTES / 2**20:g} MiB of activations at a time)"


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
