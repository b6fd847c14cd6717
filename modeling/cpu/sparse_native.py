"""The sparse backend's native fp32 CPU kernels (csrc/sparse_native.cpp), compiled on first use.

Why native code: torch's CPU flash kernel, which the PyTorch path calls per chunk of query blocks,
multiplies with MKL's sgemm, and MKL runs its AVX2 code on AMD processors even where AVX-512 is there;
the global keys then need a second segment merged by log-sum-exp, whose thin products wait on memory
(docs/benchmarks.md). The native kernel (`band_attention`) calls oneDNN's brgemm (inside torch; it runs
the CPU's widest instructions) for each query block's band, and scores the global keys in the same
pass with a few vector FMAs per row, so the band and the global keys are one softmax per row. The rows
of the global queries (`global_rows`) run over every key in chunks, with an online softmax. Measured on
an AMD EPYC (Zen 5, 2 cores): the attention core at 8192 tokens, window +-128, in 0.5x the PyTorch
path's time, and 16 global tokens cost about 1.1x the core without them (benchmarks/attention_sparse.py).

The kernels serve a call when all hold:
- the CPU routes are on (`cpu_routes`, SWAPFORMER_CPU_ROUTES; routes.py) and the route is "native": `sparse_cpu(route)` (a context manager) or else the environment variable
  SWAPFORMER_SPARSE_CPU says "native", or they say "auto" (the default) and torch reports AVX2 or
  AVX-512 for this CPU, the kernel's source is here (a model's remote-code files carry none), and a
  C++ compiler and ninja are found; "torch" turns it off. (On AVX2, measured by holding torch and
  oneDNN to AVX2 on the Zen 5: the 0-global core in 0.66x the PyTorch path's time, 16 globals in
  0.68x; no AVX2-only machine was at hand.)
- fp32 CPU tensors (plain tensors, not subclasses), no dropout, no BigBird random keys;
- no gradient is recorded for the query, key, value or a mask (they have no backward: training
  takes the PyTorch path);
- not under torch.compile, jit tracing or a functorch transform.

Building: `torch.utils.cpp_extension.load` compiles the source once per machine, torch version and
vector width (10-30 s here) into `build_directory()`, under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions), with the vector width torch reports for the CPU. A build says so in one
line when it starts (what, where, how to skip it); processes that start at once (DDP ranks, test
workers) take a file lock, so one builds and the others load its library. `swapformer build-kernels`
builds ahead of time (images, clusters); `swapformer env` shows the state. When the build fails, route
"native" raises with the compiler's message; route "auto" warns once and runs the PyTorch path. Where a
compiler or ninja is missing, "auto" runs the PyTorch path and says why once, at the first call the
kernels would have served.

Outputs differ from the PyTorch path's by rounding only (another summation order: below 1e-6 absolute
in fp32 on unit-scale inputs).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from pathlib import Path

import torch

from ..compat.torch_compat import functorch_active
from ..sparse.sparse_layout import BlockLayout
from .routes import cpu_routes_on, routes_off_reason
from .sparse_native_build import (
    ENV,
    SOURCE,
    build_directory,
    compile_and_load,
    compiler,
    library,
    ninja,
    up_to_date,
)
from .sparse_native_call import attend

__all__ = [
    "applies",
    "attend",
    "build",
    "build_directory",
    "library",
    "sparse_cpu",
    "sparse_cpu_route",
    "state",
]

ROUTES = ("auto", "native", "torch")

# the route asked for ("auto", "native" or "torch"): by `sparse_cpu`, else by the environment (read once)
_chosen: contextvars.ContextVar[str | None] = contextvars.ContextVar("swapformer_sparse_cpu", default=None)
_default: str | None = None
_auto: str | None = None  # what "auto" means on this machine, worked out once
_built: bool | None = None  # None: not tried yet; False: the build failed
_unavailable: str | None = None  # why "auto" means the PyTorch path on a CPU the kernels serve
_noticed = False  # the notice about `_unavailable` was given


def _check_route(route, where: str) -> str:
    if route not in ROUTES:
        raise ValueError(
            f"{where} is {route!r}; the sparse CPU kernel route must be one of {', '.join(map(repr, ROUTES))} "
            "('auto': native kernels on CPUs with AVX2 or AVX-512 where they can be built, 'native': always, "
            "'torch': the PyTorch path)"
        )
    if route == "native":
        missing = _missing()
        if missing:
            raise ValueError(f"{where} is 'native', but {missing}; use 'auto' or 'torch'")
    return route


def _missing() -> str | None:
    """Why the native kernels cannot be built here, or None."""
    if not SOURCE.exists():
        return f"the kernel source {SOURCE.name} is not installed beside {Path(__file__).name} (remote-code files carry none)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN, whose brgemm the kernels call (torch.backends.mkldnn.is_available() is False)"
    if compiler() is None:
        return f"no C++ compiler was found ({os.environ.get('CXX', 'c++')!r} is not on PATH; set CXX)"
    if ninja() is None:
        return "ninja was not found (pip install ninja)"
    return None


def _resolve(route: str) -> str:
    global _auto, _unavailable
    if route != "auto":
        return route
    if _auto is None:
        vector = torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AVX2"))
        missing = _missing() if vector else "no AVX2"
        _auto = "native" if missing is None else "torch"
        # a model loaded from remote-code files carries no C++ by design: no notice for that
        _unavailable = missing if vector and SOURCE.exists() else None
    return "torch" if _built is False else _auto  # after a failed build (it warned): the PyTorch path


def _requested() -> str:
    global _default
    route = _chosen.get()
    if route is None:
        if _default is None:
            where = f"the environment variable {ENV}"
            _default = _check_route(os.environ.get(ENV, "auto").strip().lower(), where)
        route = _default
    return route


def sparse_cpu_route() -> str:
    """The route in force: "native" or "torch" ("auto" resolved for this machine; "torch" while the CPU
    routes are off). The environment variables are read once, at the first call; `sparse_cpu` and
    `cpu_routes` change the route at run time."""
    route = _resolve(_requested())
    return route if cpu_routes_on() else "torch"


def sparse_route_in_force() -> str:
    """The route and why, for `swapformer env`: "native (built)", "torch (SWAPFORMER_SPARSE_CPU=torch)",
    "off (SWAPFORMER_CPU_ROUTES=off)"."""
    off = routes_off_reason()
    if off is not None:
        return f"off ({off})"
    route, asked = sparse_cpu_route(), _requested()
    if route == "torch":
        if asked != "auto":
            return f"torch ({ENV}={asked})" if _chosen.get() is None else "torch (sparse_cpu)"
        why = "the build failed" if _built is False else _missing() or "no AVX2"
        return f"torch (auto: {why})"
    return "native (built)" if _built or up_to_date() else "native (compiled at the first use)"


@contextlib.contextmanager
def sparse_cpu(route: str):
    """Run the block with the sparse CPU kernel route `route` ("auto", "native" or "torch"), whatever
    the environment says; e.g. `with swapformer.sparse_cpu("torch"):` for the PyTorch path's results."""
    token = _chosen.set(_check_route(route, "sparse_cpu(route)"))
    try:
        yield
    finally:
        _chosen.reset(token)


def build() -> Path:
    """Compile (unless cached on disk) and load the kernels, once per process; returns the library's
    path. Raises RuntimeError with the compiler's message when that fails (and remembers it: route
    "auto" then runs the PyTorch path)."""
    global _built
    if _built:
        return library()
    try:
        path = compile_and_load()
    except RuntimeError:
        _built = False
        raise
    _built = True
    return path


def state() -> str:
    """The kernels' state in one line, for `swapformer env`."""
    missing = _missing()
    if _built:
        return f"built and loaded ({library()})"
    if _built is False:
        return "the build failed in this process (the PyTorch path runs)"
    if missing is not None:
        return f"cannot be built here: {missing}"
    if up_to_date():
        return f"built ({library()}); loaded at the first sparse forward that uses them"
    return f"not built yet: compiled at the first use (about 10-30 s) into {build_directory()}, or by `swapformer build-kernels`"


def _notice_unavailable() -> None:
    """Under route "auto", once per process: why the kernels do not serve this CPU."""
    global _noticed
    if _noticed or _unavailable is None or _requested() != "auto":
        return
    _noticed = True
    warnings.warn(
        f"swapformer: the sparse backend runs its PyTorch path, not its native CPU kernels (about 2x "
        f"faster at long lengths), because {_unavailable}. Install what is missing, or set {ENV}=torch "
        "to choose the PyTorch path without this notice.",
        stacklevel=4,
    )


def _ready() -> bool:
    """Whether the kernels are loaded, building them on first use. When the build fails, route
    "auto" warns (once: "auto" means the PyTorch path from then on) and answers False; route "native"
    raises."""
    if _built:
        return True
    try:
        build()
    except RuntimeError as error:
        if _requested() == "auto":
            warnings.warn(f"{error} (route 'auto': the PyTorch path runs instead)", stacklevel=3)
            return False
        raise
    return True


def applies(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: BlockLayout, dropout
) -> bool:
    """Whether this sparse attention call runs on the native kernels (module docstring)."""
    if not all(
        type(t) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu"
        for t in (query, key, value)
    ):
        return False
    if dropout or layout.extra_keys is not None:
        return False
    masks = (layout.mask, layout.global_key_mask, layout.global_mask)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, *masks)
    ):
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or functorch_active():
        return False
    if sparse_cpu_route() != "native":
        if cpu_routes_on():
            _notice_unavailable()
        return False
    return _ready()
