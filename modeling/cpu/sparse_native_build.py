"""Compiling and loading the sparse backend's native CPU kernels (csrc/sparse_native.cpp).

The toolchain they need (a C++ compiler, ninja), where they are cached (one folder per torch version
and vector width) and the compilation itself, under a file lock so that processes starting at once
build once. Holds no state: `sparse_native.py` records whether this process built them and decides
when to (its docstring has the whole story).

Every compilation is announced in one line: at once when the library is missing or older than the
source, and after SLOW_LOAD_S when ninja compiles again over a library that looked up to date. ninja
does that when the build command or a header changed since the cached build (another virtual
environment, torch install or CXX sharing the cache), which only ninja's own records show; a load that
compiles nothing takes a fraction of a second.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch
from transformers.utils import logging

SOURCE = Path(__file__).resolve().parent / "csrc" / "sparse_native.cpp"
ENV = "SWAPFORMER_SPARSE_CPU"  # the route's environment variable, named in the build's messages
logger = logging.get_logger(__name__)
SLOW_LOAD_S = 2.0  # a load still running after this long is compiling
AHEAD = f"`swapformer build-kernels` does this ahead of time; {ENV}=torch skips them (the PyTorch path)."


def ninja() -> str | None:
    """ninja's path: on PATH, or beside this Python (a virtual environment that is not activated)."""
    found = shutil.which("ninja")
    if found is None:
        beside = Path(sys.executable).parent / "ninja"
        found = str(beside) if beside.exists() else None
    return found


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


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


def up_to_date() -> bool:
    lib = library()
    return lib.exists() and lib.stat().st_mtime >= SOURCE.stat().st_mtime


@contextlib.contextmanager
def _said_if_slow(message: str):
    """Log `message` if the block still runs after SLOW_LOAD_S."""
    timer = threading.Timer(SLOW_LOAD_S, logger.warning, args=(message,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


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


def compile_and_load() -> Path:
    """Compile the kernels (unless the library on disk is up to date) and load them into torch.ops;
    returns the library's path. Says so in one line when a compilation starts. Raises RuntimeError with
    the compiler's message when that fails."""
    from torch.utils.cpp_extension import load

    found = ninja()
    if found is not None and shutil.which("ninja") is None:  # torch's build looks for ninja on PATH
        os.environ["PATH"] = f"{Path(found).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(directory):
            cached = up_to_date()
            if not cached:
                logger.warning(
                    f"swapformer: compiling the sparse backend's native CPU kernels (once per machine and "
                    f"torch version, about 10-30 s) into {directory}. {AHEAD}"
                )
            again = (
                f"swapformer: compiling the sparse backend's native CPU kernels again (about 10-30 s): the "
                f"build cached in {directory} was made by another environment (paths, torch headers or "
                f"compiler differ). {AHEAD}"
            )
            with _said_if_slow(again) if cached else contextlib.nullcontext():
                load(
                    name=_name(),
                    sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-fopenmp", *_flags()],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    is_python_module=False,
                )
    except Exception as error:
        raise RuntimeError(
            f"swapformer could not build its sparse CPU kernels from {SOURCE} in {directory}: {error}. "
            f"Set {ENV}=torch to run the PyTorch path."
        ) from error
    return library()
