"""Every place swapformer reaches into torch beyond its documented public API.

A sibling of `hf_compat.py` (transformers) and `accelerate_compat.py`; `tests/compat/test_compat.py` holds one
contract test per touch point, and a test that fails when a private torch name is used in any other
module. Each name serves a speed route that has a public fallback, so when a torch release drops one,
`available()` says so and the route stays on torch's public path (with the reason in `swapformer env`).

Touch points:
    ops.aten._scaled_dot_product_flash_attention_for_cpu (+ _backward)
        the CPU flash kernel of `F.scaled_dot_product_attention`, called directly by the sparse backend
        for its log-sum-exp output (merging segments), which the public function does not return. It
        reads each row of a tensor's last dimension as contiguous memory whatever its stride says (the
        public function checks this before choosing it); `flash_cpu` and `flash_cpu_backward` copy a
        tensor whose last-dimension stride is not 1
    ops.mkldnn._linear_pointwise
        oneDNN's linear op, the CPU linear route (cpu/linear.py)
    _C._are_functorch_transforms_active
        whether vmap/grad transforms are active: the speed routes stand aside under them
    _C._get_mkldnn_enabled
        the state `torch.backends.mkldnn.flags(enabled=...)` sets (no public getter)
    nn.modules.module._global_forward_hooks / _global_forward_pre_hooks, Module._forward_hooks /
    Module._forward_pre_hooks
        hooks registered with `register_module_forward_hook` or `Module.register_forward_hook` (public)
        have no public reader; a route that bypasses a module's forward runs only when none is registered
    utils._python_dispatch.is_traceable_wrapper_subclass
        whether a weight is a tensor subclass such as torchao's quantized tensors (benchmarks/int8.py
        counts the bytes of their inner tensors)
    C++: at::native::cpublas::brgemm
        oneDNN's batch-reduce GEMM, used by the sparse backend's native kernels (cpu/csrc/sparse_native.cpp);
        checked by building the kernels (`swapformer env`, tests/cpu/test_sparse_native.py)
"""

from __future__ import annotations

import torch
from torch import nn

# name -> how to reach it from `torch`, as the contract test checks them
TOUCH_POINTS = {
    "flash_cpu": "ops.aten._scaled_dot_product_flash_attention_for_cpu",
    "flash_cpu_backward": "ops.aten._scaled_dot_product_flash_attention_for_cpu_backward",
    "onednn_linear": "ops.mkldnn._linear_pointwise",
    "functorch_active": "_C._are_functorch_transforms_active",
    "mkldnn_enabled": "_C._get_mkldnn_enabled",
    "global_forward_hooks": "nn.modules.module._global_forward_hooks",
    "global_forward_pre_hooks": "nn.modules.module._global_forward_pre_hooks",
    "is_traceable_wrapper_subclass": "utils._python_dispatch.is_traceable_wrapper_subclass",
}


def lookup(touch_point: str):
    """The object behind `touch_point`, or an AttributeError naming torch's version and the name."""
    obj = torch
    try:
        for part in TOUCH_POINTS[touch_point].split("."):
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError) as e:  # torch.ops raises RuntimeError for an unknown op
        raise AttributeError(
            f"torch {torch.__version__} has no torch.{TOUCH_POINTS[touch_point]} ({e}), which swapformer's "
            f"{touch_point!r} route uses; that route stays on torch's public path"
        ) from None
    return obj


def available(touch_point: str) -> bool:
    try:
        lookup(touch_point)
    except AttributeError:
        return False
    return True


def _dense_rows(args) -> list:
    """`args` with each tensor whose last dimension is strided (q, k or v sliced along it, e.g. heads
    interleaved in a fused projection) copied: the flash op would read its rows as contiguous memory.
    A copy only where needed; a size-1 last dimension is read at offset 0 whatever its stride."""
    return [
        a.contiguous()
        if isinstance(a, torch.Tensor) and a.dim() and a.shape[-1] > 1 and a.stride(-1) != 1
        else a
        for a in args
    ]


def flash_cpu(*args, **kwargs):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_dense_rows(args), **kwargs)


def flash_cpu_backward(*args, **kwargs):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*_dense_rows(args), **kwargs)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def functorch_active() -> bool:
    return torch._C._are_functorch_transforms_active()


def mkldnn_enabled() -> bool:
    return torch._C._get_mkldnn_enabled()


def global_forward_hooks_registered() -> bool:
    """Whether a module forward hook or pre-hook is registered for every module of the process."""
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def module_hooked(module: nn.Module) -> bool:
    """Whether `module` has a forward hook or pre-hook of its own, or one registered for every module:
    a route that computes the module's output without calling it must then call it instead."""
    return bool(module._forward_hooks or module._forward_pre_hooks) or global_forward_hooks_registered()


def is_traceable_wrapper_subclass(t) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as check

    return check(t)
