"""The CPU linear route: fp32 CPU inference of swapformer's projections on oneDNN, behind one seam.

Every projection and head of a swapformer model is a plain `nn.Linear`, so libraries that check module
types (PEFT's GLoRA, quantizers, pruning and export tools test `type(m) is nn.Linear`) see what they see
on Llama (issue 26). The speed route lives here, outside the module classes: the layers call each
projection as `project(module, x)`, which runs torch's oneDNN linear op where the route applies and
is `module(x)` everywhere else, so a PEFT-wrapped, quantized or hooked layer runs its own forward.

torch computes an fp32 `nn.Linear` on CPU with MKL's sgemm. MKL chooses its code by CPU vendor and
runs its AVX2 code on AMD processors even where AVX-512 is there; oneDNN, which ships inside torch
(torch.compile's CPU inference path uses it for linear layers), runs AVX-512 code on them. Measured
on an AMD EPYC (Zen 5, 2 cores): a 4096 x 768 x 3072 product at 352 GFLOP/s against MKL's 187, one
row times a 768 x 30522 matrix (a decoding step's LM head) in 0.27x MKL's time
(benchmarks/cpu_linear.py). So where the oneDNN route applies, `project` calls torch's oneDNN linear
op (`torch.ops.mkldnn._linear_pointwise`, through torch_compat.py) on the Parameters as they are
(nothing is copied or cached: a changed weight is read as it is).

The route applies to a call when all hold:
- the module is exactly `nn.Linear`, with no forward hook or pre-hook (its own or one registered for
  every module: a hook must still fire) and its `forward` not replaced on the instance (Accelerate's
  offloading hooks do that); a subclass, a PEFT layer or a quantized layer is called as a module;
- the route is on: `cpu_linear(route)` (a context manager) or else the environment variable
  SWAPFORMER_CPU_LINEAR says "onednn", or they say "auto" (the default), torch reports AVX-512 for
  this CPU (`torch.backends.cpu.get_cpu_capability()`) and the CPU is AMD's (`cpu_vendor()`); "torch"
  turns it off. On an Intel Xeon with AVX-512, where MKL runs its AVX-512 code, oneDNN did not pay:
  whole forwards 0.94-0.95x and a GPT-2 decoding step 0.81x the speed of torch's route (2026-12-03,
  benchmarks/cpu_linear.py), so "auto" keeps torch's route on Intel. No AVX2-only CPU was
  at hand, so "auto" leaves torch's choice there. Emulated on the Zen 5 (oneDNN held to AVX2 with
  ONEDNN_MAX_CPU_ISA=AVX2; MKL runs its AVX2 code there anyway) oneDNN ran at 0.98-1.35x MKL's speed
  per product from 64 rows up and 1.09-1.17x on whole forwards (docs/benchmarks.md): a small gain,
  measured on one vendor's hardware only, so SWAPFORMER_CPU_LINEAR=onednn is there to opt in;
- torch's own switch for oneDNN is on (`torch.backends.mkldnn.enabled`, e.g. not inside
  `torch.backends.mkldnn.flags(enabled=False)`);
- the input, weight and bias are plain fp32 CPU tensors (a quantized or wrapped weight, a DTensor or
  another tensor subclass goes through `F.linear`, where its own dispatch runs), and the weight is
  stored (out, in) or (in, out) (generate()'s input-major copies): oneDNN takes any other strides on a
  path about 1000x slower;
- no gradient is recorded (the op has no backward: under `no_grad`/`inference_mode`, or when neither
  the input nor a parameter requires grad);
- not under autocast, torch.compile, jit tracing or a functorch transform (they see `F.linear`).

Outputs differ from MKL's by rounding only (another summation order: about 1e-6 relative in fp32).

The MLP's route (`cpu_mlp`) lives here too: without gradients it runs the MLP over row chunks with
in-place activations (see `MLP_CHUNK_BYTES`), so `MLP.forward` stays the plain expression.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch
import torch.nn.functional as F
from torch import nn

from .torch_compat import available, functorch_active, mkldnn_enabled, module_hooked, onednn_linear

ROUTES = ("auto", "onednn", "torch")
ENV = "SWAPFORMER_CPU_LINEAR"

_chosen: contextvars.ContextVar[str | None] = contextvars.ContextVar("swapformer_cpu_linear", default=None)
_default: str | None = None  # the environment's route, resolved at the first call


def _check_route(route, where: str) -> str:
    if route not in ROUTES:
        raise ValueError(
            f"{where} is {route!r}; the CPU linear route must be one of {', '.join(map(repr, ROUTES))} "
            "('auto': oneDNN on CPUs with AVX-512, 'onednn': always, 'torch': torch's own F.linear)"
        )
    if route == "onednn" and not _onednn_available():
        raise ValueError(
            f"{where} is 'onednn', but this torch build has no oneDNN linear op "
            "(torch.backends.mkldnn.is_available() is False); use 'auto' or 'torch'"
        )
    return route


# the private torch names the route reads (torch_compat.py); a torch release without one keeps torch's route
_ROUTE_TOUCH_POINTS = (
    "onednn_linear",
    "functorch_active",
    "mkldnn_enabled",
    "global_forward_hooks",
    "global_forward_pre_hooks",
)


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and all(map(available, _ROUTE_TOUCH_POINTS))


def cpu_linear_route() -> str:
    """The route in force: "onednn" or "torch" ("auto" resolved for this CPU). The environment
    variable is read once, at the first call; `cpu_linear` changes the route at run time."""
    global _default
    route = _chosen.get()  # `cpu_linear` stores it resolved
    if route is None:
        if _default is None:
            _default = _resolve(
                _check_route(os.environ.get(ENV, "auto").strip().lower(), f"the environment variable {ENV}")
            )
        return _default
    return route


def cpu_info(field: str) -> str:
    """A field of the first CPU as Linux reports it ("vendor_id", "model name"), or "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor id ("AuthenticAMD", "GenuineIntel"), or "" where unknown."""
    return cpu_info("vendor_id")


def _resolve(route: str) -> str:
    if route != "auto":
        return route
    # the gain is MKL's vendor dispatch (AVX2 code on AMD); where MKL runs AVX-512 itself, torch's route
    # was as fast or faster (module docstring)
    wide = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return "onednn" if _onednn_available() and wide and cpu_vendor() == "AuthenticAMD" else "torch"


@contextlib.contextmanager
def cpu_linear(route: str):
    """Run the block with the CPU linear route `route` ("auto", "onednn" or "torch"), whatever the
    environment says; e.g. `with swapformer.cpu_linear("torch"):` for MKL's results bit for bit."""
    token = _chosen.set(_resolve(_check_route(route, "cpu_linear(route)")))
    try:
        yield
    finally:
        _chosen.reset(token)


def _plain_fp32(t: torch.Tensor | None) -> bool:
    return t is None or (
        type(t) in (nn.Parameter, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
    )


def onednn_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `F.linear(x, weight, bias)` may run on oneDNN's op here (see the module docstring)."""
    if not (type(x) is torch.Tensor and x.dtype == torch.float32 and x.device.type == "cpu"):
        return False
    if not (_plain_fp32(weight) and _plain_fp32(bias)):
        return False
    # other weight strides (a slice of a larger matrix) take a path of oneDNN about 1000x slower than
    # MKL (measured: 3.4 s against 3.4 ms, 512 x 768 x 768)
    if weight.dim() != 2 or not (weight.is_contiguous() or weight.t().is_contiguous()):
        return False
    if bias is not None and not bias.is_contiguous():
        return False
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return False
    if (
        torch.is_autocast_enabled("cpu")
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or functorch_active()
        or not mkldnn_enabled()
    ):
        return False
    return cpu_linear_route() == "onednn"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, on oneDNN where the route applies."""
    if onednn_applies(x, weight, bias):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def plain_linear(module: nn.Module) -> bool:
    """Whether `module(x)` is `F.linear(x, module.weight, module.bias)` and nothing else: exactly
    `nn.Linear`, no forward hook or pre-hook to fire, `forward` not replaced on the instance."""
    return type(module) is nn.Linear and "forward" not in module.__dict__ and not module_hooked(module)


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, on oneDNN where the route applies (module docstring): the one seam through which
    swapformer's layers call their projections and heads."""
    if plain_linear(module) and onednn_applies(x, module.weight, module.bias):
        return onednn_linear(x, module.weight, module.bias)
    return module(x)


# The MLP's route ---------------------------------------------------------------------------------------

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
    tensor subclasses and when a hook watches a projection."""
    projections = [p for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj) if p is not None]
    if (
        torch.is_grad_enabled()
        or type(x) is not torch.Tensor
        or torch.compiler.is_compiling()
        or any(module_hooked(p) for p in projections)
    ):
        return mlp.compute(x, mlp.act_fn)
    act = mlp.act_in_place or mlp.act_fn
    rows, width = x.numel() // x.shape[-1], mlp.up_proj.out_features
    chunks = -(-rows * width * x.element_size() // MLP_CHUNK_BYTES)
    if chunks <= 1:
        return mlp.compute(x, act)
    step = -(-rows // chunks)
    flat = x.reshape(rows, x.shape[-1])
    if _writable(projections, x) and not onednn_applies(flat, mlp.up_proj.weight, mlp.up_proj.bias):
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
