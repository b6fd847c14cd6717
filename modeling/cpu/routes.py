"""The switches of the CPU speed routes: one that turns them all off, and the linear route's own.

`cpu_routes(False)` (or SWAPFORMER_CPU_ROUTES=off) turns every route of this package off, whatever the
per-route switches say: the layers' projections are `module(x)`, the MLP is one plain pass, generate()
copies no weights and the sparse backend runs its PyTorch path. It is for a bug report ("does it happen
with the routes off?") and for results that are torch's own expressions bit for bit. With the switch on
(the default), each route follows its own switch: `cpu_linear(route)` / SWAPFORMER_CPU_LINEAR here,
`sparse_cpu(route)` / SWAPFORMER_SPARSE_CPU in sparse_native.py, `model.decoding_copies` in weight_copies.py;
MLP chunking has no switch of its own.

A switch given at run time (a context variable: per thread and asyncio task) wins over the environment,
which is read once, at the first call; a wrong value in the environment fails when a model is built.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch
import torch.nn.functional as F
from torch import nn

from ..compat.torch_compat import onednn_linear
from .linear import onednn_applies, plain_linear
from .mlp import chunked
from .route_choice import auto_linear, check_route, resolve_route

ENV = "SWAPFORMER_CPU_ROUTES"
SWITCH = ("on", "off")

_routes: contextvars.ContextVar[bool | None] = contextvars.ContextVar("swapformer_cpu_routes", default=None)
_routes_default: bool | None = None  # the environment's switch, read at the first call


def cpu_routes_on() -> bool:
    """Whether the CPU speed routes may run (`cpu_routes`, else SWAPFORMER_CPU_ROUTES; default on)."""
    chosen = _routes.get()
    return cpu_routes_default() if chosen is None else chosen


def cpu_routes_default() -> bool:
    """SWAPFORMER_CPU_ROUTES (default on), read at the first call."""
    global _routes_default
    if _routes_default is None:
        value = os.environ.get(ENV, "on").strip().lower()
        if value not in SWITCH:
            raise ValueError(
                f"the environment variable {ENV} is {value!r}; it must be 'on' (the default: each CPU route "
                "follows its own switch) or 'off' (every route off: plain torch)"
            )
        _routes_default = value == "on"
    return _routes_default


def routes_off_reason() -> str | None:
    """Why the routes are off ("SWAPFORMER_CPU_ROUTES=off", "cpu_routes(False)"), or None when on."""
    if cpu_routes_on():
        return None
    return f"{ENV}=off" if _routes.get() is None else "cpu_routes(False)"


class cpu_routes:
    """Turn every CPU speed route on or off, overriding the per-route switches.

    As a call (`swapformer.cpu_routes(False)`) it holds for the current thread from then on; in a `with`
    block (`with swapformer.cpu_routes(False):`) it holds for the block, as `torch.set_grad_enabled`.
    `True` hands the choice back to each route's own switch."""

    def __init__(self, enabled: bool):
        if not isinstance(enabled, bool):
            raise TypeError(
                f"cpu_routes(enabled) takes True or False, got {enabled!r} ({type(enabled).__name__}); "
                "to choose one route, use cpu_linear(route) or sparse_cpu(route)"
            )
        # the seam's value is the route in force once this switch is set (`cpu_linear_route`)
        self._tokens = _routes.set(enabled), Seam.linear.set(cpu_linear_route())

    def __enter__(self) -> cpu_routes:
        return self

    def __exit__(self, *exc) -> None:
        _routes.reset(self._tokens[0])
        Seam.linear.reset(self._tokens[1])


# The linear route's switch -----------------------------------------------------------------------------

LINEAR_ENV = "SWAPFORMER_CPU_LINEAR"

_chosen: contextvars.ContextVar[str | None] = contextvars.ContextVar("swapformer_cpu_linear", default=None)
_default: str | None = None  # the environment's route, resolved at the first call


def _environment_route() -> str:
    global _default
    if _default is None:
        where = f"the environment variable {LINEAR_ENV}"
        _default = resolve_route(check_route(os.environ.get(LINEAR_ENV, "auto").strip().lower(), where))
    return _default


def cpu_linear_route() -> str:
    """The route in force: "onednn" or "torch" ("auto" resolved for this CPU; "torch" while the routes
    are off). The environment variables are read once, at the first call; `cpu_linear` and `cpu_routes`
    change the route at run time."""
    route = _environment_route()  # read even while off: a wrong value fails when a model is built
    if not cpu_routes_on():
        return "torch"
    chosen = _chosen.get()  # `cpu_linear` stores it resolved
    return route if chosen is None else chosen


def linear_route_in_force() -> str:
    """The linear route and why, for `swapformer env`: "torch (auto: Intel CPU)", "off (...)"."""
    off = routes_off_reason()
    if off is not None:
        return f"off ({off})"
    if _chosen.get() is not None:
        return f"{cpu_linear_route()} (cpu_linear)"
    asked = os.environ.get(LINEAR_ENV, "auto").strip().lower()
    if asked != "auto":
        return f"{cpu_linear_route()} ({LINEAR_ENV}={asked})"
    route, why = auto_linear()
    return f"{route} (auto: {why})"


@contextlib.contextmanager
def cpu_linear(route: str):
    """Run the block with the CPU linear route `route` ("auto", "onednn" or "torch"), whatever the
    environment says; e.g. `with swapformer.cpu_linear("torch"):` for MKL's results bit for bit.
    `cpu_routes(False)` overrides it."""
    token = _chosen.set(resolve_route(check_route(route, "cpu_linear(route)")))
    seam_token = Seam.linear.set(cpu_linear_route())  # the route in force inside the block
    try:
        yield
    finally:
        _chosen.reset(token)
        Seam.linear.reset(seam_token)


# Where the layers' seam meets the routes ------------------------------------------------------------------


class Seam:
    """What the seam in the layers (`core.layers.project`, `MLP.forward`) reads of the routes, as values,
    so that a projection on torch's route and an MLP within one chunk run no code of this package:

    - `linear`: a context variable the switches (`cpu_routes`, `cpu_linear`) set beside their own to
      `cpu_linear_route()` as it reads once they are set, or None where no switch is set (then
      `environment` holds).
    - `environment`: the environment's linear route ("torch" while SWAPFORMER_CPU_ROUTES=off), resolved
      by `resolve_environment_route` at the first call.
    - `mlp_chunk_bytes`: the activations an MLP without gradients runs at a time (the comment at `cpu_mlp`)."""

    linear: contextvars.ContextVar[str | None] = contextvars.ContextVar(
        "swapformer_seam_linear", default=None
    )
    environment: str | None = None
    mlp_chunk_bytes: int = 16 * 2**20


def resolve_environment_route() -> str:
    """`Seam.environment`, resolved: the route where no switch is set (`cpu_linear_route` there)."""
    if Seam.environment is None:
        Seam.environment = _environment_route() if cpu_routes_default() else "torch"
    return Seam.environment


def _onednn_route() -> bool:
    """Whether the linear route is "onednn" here: never while compiling (asked first: the switch's context
    variable is not traceable). Read before anything else, so where the route is "torch" a call reads
    nothing more."""
    return not torch.compiler.is_compiling() and cpu_linear_route() == "onednn"


def onednn_in_force(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `F.linear(x, weight, bias)` runs on oneDNN: the route is "onednn" and it applies to this
    call (linear.py)."""
    return _onednn_route() and onednn_applies(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, on oneDNN where the route is in force."""
    if onednn_in_force(x, weight, bias):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` where the "onednn" route is in force (the seam, core.layers.project, calls it only
    then): oneDNN's op for a plain `nn.Linear` it applies to (linear.py), else the module's own call (a
    hooked or wrapped module may have no plain weight to read)."""
    if plain_linear(module) and onednn_applies(x, module.weight, module.bias):
        return onednn_linear(x, module.weight, module.bias)
    return module(x)


# Without gradients the MLP runs `Seam.mlp_chunk_bytes` of intermediate activations at a time: glibc
# hands larger blocks out as fresh mappings, so a whole (T, intermediate) activation page-faults and is
# zero-filled by the kernel on every layer (measured: about as long as the GELU itself, and not spread
# over threads). The chunks are equal, and plain `nn.Linear` projections on torch's route write into
# buffers allocated once per call and reused by every chunk: fresh chunk-sized outputs fault too
# whenever glibc has trimmed its heap (a gated BERT-base MLP at 4096 tokens: 36,737 faults per call
# against 5,124, 9% slower; benchmarks/mlp_chunks.py). On the oneDNN route, whose op takes no output
# buffer, each chunk calls the projections through the seam (`core.layers.project`). A model with
# forward hooks on its projections runs the MLP in one plain pass, so hooks see one call with the whole output. An MLP whose
# activations fit in one chunk is the plain expression (cpu_mlp): nothing to chunk, and so no hook
# to look for on the path every short input and decoding step takes.


def cpu_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`mlp.compute(x, mlp.act_fn)` (layers.MLP): the seam of MLP row chunking (mlp.py), entered only
    without gradients, outside torch.compile, for plain tensors, with the routes on and activations
    over one chunk (`Seam.mlp_chunk_bytes`)."""
    if (
        torch.compiler.is_compiling()  # first: the switch's context variable is not traceable
        or torch.is_grad_enabled()
        or not cpu_routes_on()
        or type(x) is not torch.Tensor
    ):
        return mlp.compute(x, mlp.act_fn)
    if mlp.fits_one_chunk(x):
        return mlp.compute(x, mlp.act_fn)
    return chunked(mlp, x, Seam.mlp_chunk_bytes, onednn_in_force)
