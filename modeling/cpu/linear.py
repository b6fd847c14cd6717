"""The CPU linear route: when fp32 CPU inference of swapformer's projections may run on oneDNN.

The layers call `core.layers.project`, the seam, which reads the route in force as values and calls
`routes.onednn_project` only where it is "onednn": where the route is "torch" (the default on Intel), a
projection runs no code of this package.

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
- the CPU routes are on (`cpu_routes`, SWAPFORMER_CPU_ROUTES; routes.py) and the linear route is on:
  `cpu_linear(route)` (a context manager) or else the environment variable SWAPFORMER_CPU_LINEAR
  says "onednn", or they say "auto" (the default), torch reports AVX-512 for this CPU
  (`torch.backends.cpu.get_cpu_capability()`) and the CPU is AMD's (`route_choice.cpu_vendor()`); "torch"
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
"""

from __future__ import annotations

import torch
from torch import nn

from ..compat.torch_compat import functorch_active, mkldnn_enabled, module_hooked


def _plain_fp32(t: torch.Tensor | None) -> bool:
    return t is None or (
        type(t) in (nn.Parameter, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
    )


def onednn_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `F.linear(x, weight, bias)` may run on oneDNN's op here, the route's switch aside
    (routes.py checks it first: see the module docstring)."""
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
    return not (
        torch.is_autocast_enabled("cpu")
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or functorch_active()
        or not mkldnn_enabled()
    )


def plain_linear(module: nn.Module) -> bool:
    """Whether `module(x)` is `F.linear(x, module.weight, module.bias)` and nothing else: exactly
    `nn.Linear`, no forward hook or pre-hook to fire, `forward` not replaced on the instance."""
    return type(module) is nn.Linear and "forward" not in module.__dict__ and not module_hooked(module)
