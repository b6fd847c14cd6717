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
- the route is "native": `sparse_cpu(route)` (a context manager) or else the environment variable
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
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.utils import logging

from .sparse_globals import global_keys_and_values, put_rows, query_rows
from .sparse_layout import BlockLayout
from .torch_compat import functorch_active

ROUTES = ("auto", "native", "torch")
ENV = "SWAPFORMER_SPARSE_CPU"
SOURCE = Path(__file__).resolve().parent / "csrc" / "sparse_native.cpp"
logger = logging.get_logger(__name__)
_VECTOR = 16  # global keys are padded to a multiple of the widest vector (16 floats)

# the route asked for ("auto", "native" or "torch"): by `sparse_cpu`, else by the environment (read once)
_chosen: contextvars.ContextVar[str | None] = contextvars.ContextVar("swapformer_sparse_cpu", default=None)
_default: str | None = None
_auto: str | None = None  # what "auto" means on this machine, worked out once
_built: bool | None = None  # None: not tried yet; False: the build failed
_unavailable: str | None = None  # why "auto" means the PyTorch path on a CPU the kernels serve
_noticed = False  # the notice about `_unavailable` was given


def _ninja() -> str | None:
    """ninja's path: on PATH, or beside this Python (a virtual environment that is not activated)."""
    found = shutil.which("ninja")
    if found is None:
        beside = Path(sys.executable).parent / "ninja"
        found = str(beside) if beside.exists() else None
    return found


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


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
    if _compiler() is None:
        return f"no C++ compiler was found ({os.environ.get('CXX', 'c++')!r} is not on PATH; set CXX)"
    if _ninja() is None:
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
    """The route in force: "native" or "torch" ("auto" resolved for this machine). The environment
    variable is read once, at the first call; `sparse_cpu` changes the route at run time."""
    return _resolve(_requested())


@contextlib.contextmanager
def sparse_cpu(route: str):
    """Run the block with the sparse CPU kernel route `route` ("auto", "native" or "torch"), whatever
    the environment says; e.g. `with swapformer.sparse_cpu("torch"):` for the PyTorch path's results."""
    token = _chosen.set(_check_route(route, "sparse_cpu(route)"))
    try:
        yield
    finally:
        _chosen.reset(token)


def _flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"]
    if capability == "AVX2":
        return ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2"]
    return []


def _name() -> str:
    return f"swapformer_sparse_native_{torch.backends.cpu.get_cpu_capability().lower()}"


def build_directory() -> Path:
    """Where the kernels are compiled and cached: one folder per torch version and vector width."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(base) / "swapformer" / f"torch-{torch.__version__}" / _name()


def library() -> Path:
    return build_directory() / f"{_name()}.so"


def _up_to_date() -> bool:
    lib = library()
    return lib.exists() and lib.stat().st_mtime >= SOURCE.stat().st_mtime


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One process at a time builds in `directory` (a file lock; others wait, then load its library)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock inside `load` still keeps builds apart
        yield
        return
    with open(directory / "swapformer-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build() -> Path:
    """Compile (unless cached on disk) and load the kernels, once per process; returns the library's
    path. Says so in one line when a compilation starts. Raises RuntimeError with the compiler's
    message when that fails."""
    global _built
    if _built:
        return library()
    from torch.utils.cpp_extension import load

    ninja = _ninja()
    if ninja is not None and shutil.which("ninja") is None:  # torch's build looks for ninja on PATH
        os.environ["PATH"] = f"{Path(ninja).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(directory):
            if not _up_to_date():
                logger.warning(
                    f"swapformer: compiling the sparse backend's native CPU kernels (once per machine and "
                    f"torch version, about 10-30 s) into {directory}. `swapformer build-kernels` does this "
                    f"ahead of time; {ENV}=torch skips them (the PyTorch path)."
                )
            load(
                name=_name(),
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-fopenmp", *_flags()],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
            )
    except Exception as error:
        _built = False
        raise RuntimeError(
            f"swapformer could not build its sparse CPU kernels from {SOURCE} in {directory}: {error}. "
            f"Set {ENV}=torch to run the PyTorch path."
        ) from error
    _built = True
    return library()


def state() -> str:
    """The kernels' state in one line, for `swapformer env`."""
    missing = _missing()
    if _built:
        return f"built and loaded ({library()})"
    if _built is False:
        return "the build failed in this process (the PyTorch path runs)"
    if missing is not None:
        return f"cannot be built here: {missing}"
    if _up_to_date():
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
        _notice_unavailable()
        return False
    return _ready()


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def attend(query, key, value, layout: BlockLayout, scaling: float | None) -> torch.Tensor:
    """The sparse attention of `query` (B, H, T, D) over `key`, `value` (B, K, S, D) with `layout`, on
    the native kernels: (B, T, H, D), the backend's output layout."""
    batch, heads, t, d = query.shape
    n, b = layout.n_blocks, layout.block
    scale = d**-0.5 if scaling is None else scaling
    back = n * b - layout.front - t
    q = F.pad(query, (0, 0, layout.front, back)) if layout.front or back else query
    q = _last_contiguous(q)
    # the keys the bands cover (a cached decoding step: its window only), or all of them for global rows
    lo, hi = 0, key.shape[2]
    if layout.global_rows is None:
        lo = min(max(layout.band_start, 0), hi)
        hi = max(min(layout.band_start + (n - 1) * b + layout.band_length, hi), lo)
    keys, values = key[:, :, lo:hi], _last_contiguous(value[:, :, lo:hi])
    # keys transposed (B, K, D, S): the band of a block is then a column slice brgemm reads directly.
    # A row stride of S + 16 keeps rows off power-of-two distances (cache-set conflicts at S = 8192).
    kt = key.new_empty(batch, key.shape[1], d, hi - lo + 16)[..., : hi - lo]
    kt.copy_(keys.transpose(2, 3))
    empty = key.new_empty(0)
    kgt = vg = gmask = empty
    if layout.global_keys is not None:
        kg, vg = global_keys_and_values(key, value, layout)  # (B, K, Gk, D)
        vg = vg.contiguous()
        pad = -kg.shape[2] % _VECTOR
        kgt = F.pad(kg.transpose(2, 3) * scale, (0, pad)).contiguous()  # (B, K, D, Gp)
        if layout.global_key_mask is not None:
            gmask = _last_contiguous(layout.global_key_mask)
    out = query.new_empty(batch, n * b, heads, d)
    kernels = torch.ops.swapformer_sparse_native
    band_mask = _last_contiguous(layout.mask)
    kernels.band_attention(q, kt, values, band_mask, layout.band_start - lo, kgt, vg, gmask, scale, out)
    out = out[:, layout.front : layout.front + t] if layout.front or back else out
    out = out.contiguous()
    if layout.global_rows is not None:
        q_rows = _last_contiguous(query_rows(query, layout))  # (B, H, R, D)
        rows_out = query.new_empty(batch, q_rows.shape[2], heads, d)
        rows_mask = empty if layout.global_mask is None else _last_contiguous(layout.global_mask)
        kernels.global_rows(q_rows, kt, values, rows_mask, scale, rows_out)
        out = put_rows(out, layout, rows_out)
    return out
