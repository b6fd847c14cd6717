"""What the linear route's names mean on this machine: the names a switch may take, what "auto" picks here
and why (oneDNN on AMD CPUs with AVX-512; linear.py says what was measured), and the CPU's vendor and model
for `swapformer env`. routes.py holds the switches and the seam; it asks here once, when a route is
chosen, never per call.
"""

from __future__ import annotations

import torch

from ..compat.torch_compat import available

ROUTES = ("auto", "onednn", "torch")
# the private torch names the route reads (torch_compat.py); a torch release without one keeps torch's route
_ROUTE_TOUCH_POINTS = (
    "onednn_linear",
    "functorch_active",
    "mkldnn_enabled",
    "global_forward_hooks",
    "global_forward_pre_hooks",
)


def check_route(route, where: str) -> str:
    if route not in ROUTES:
        raise ValueError(
            f"{where} is {route!r}; the CPU linear route must be one of {', '.join(map(repr, ROUTES))} "
            "('auto': oneDNN on CPUs with AVX-512, 'onednn': always, 'torch': torch's own F.linear)"
        )
    if route == "onednn" and not onednn_available():
        raise ValueError(
            f"{where} is 'onednn', but this torch build has no oneDNN linear op "
            "(torch.backends.mkldnn.is_available() is False); use 'auto' or 'torch'"
        )
    return route


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and all(map(available, _ROUTE_TOUCH_POINTS))


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


def auto_linear() -> tuple[str, str]:
    """What "auto" means here and why: the gain is MKL's vendor dispatch (AVX2 code on AMD); where MKL
    runs AVX-512 itself, torch's route was as fast or faster (linear.py)."""
    if not onednn_available():
        return "torch", "no oneDNN linear op in this torch"
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return "torch", "no AVX-512"
    vendor = cpu_vendor()
    if vendor == "AuthenticAMD":
        return "onednn", "AMD CPU with AVX-512"
    return "torch", {"GenuineIntel": "Intel CPU", "": "CPU vendor unknown"}.get(vendor, f"{vendor} CPU")


def resolve_route(route: str) -> str:
    return auto_linear()[0] if route == "auto" else route
