"""`swapformer env`: the facts a bug report needs, in one block to paste (as `transformers env` and
`accelerate env` print theirs); and `swapformer build-kernels`, which compiles the sparse backend's
native CPU kernels ahead of their first use (images, clusters, CI).

Every section is gathered on its own: a dependency that fails to import, or a touch point a release
removed, shows up as a line of the report instead of stopping it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version

REQUIRED = (
    "torch",
    "transformers",
    "accelerate",
    "peft",
    "tokenizers",
    "evaluate",
    "huggingface_hub",
    "safetensors",
)
OPTIONAL = (
    "datasets",
    "ninja",
    "torchao",
    "optimum-quanto",
    "bitsandbytes",
    "flash-attn",
    "kernels",
    "sentence-transformers",
    "bertviz",
    "matplotlib",
    "tensorboard",
)
# the environment variables that change what swapformer or torch does here
VARIABLES = (
    "SWAPFORMER_CPU_ROUTES",
    "SWAPFORMER_CPU_LINEAR",
    "SWAPFORMER_SPARSE_CPU",
    "SWAPFORMER_AUTO",
    "SWAPFORMER_CACHE_DIR",
    "TORCH_EXTENSIONS_DIR",
    "CXX",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "HF_HUB_OFFLINE",
)


def add_env(subparsers) -> None:
    env = subparsers.add_parser(
        "env",
        description="Print versions, the machine, the speed routes in force and the dependency checks, "
        "for a bug report.",
    )
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(func=_env)


def add_build_kernels(subparsers) -> None:
    kernels = subparsers.add_parser(
        "build-kernels",
        description="Compile the sparse backend's native CPU kernels now (they are otherwise compiled at "
        "their first use) into the cache swapformer env names.",
    )
    kernels.set_defaults(func=_build_kernels)


def _package(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _guarded(gather):
    """`gather()`, or one line saying why it failed (the report goes on)."""
    try:
        return gather()
    except Exception as e:  # a report of a broken environment must still print
        return f"could not be read: {type(e).__name__}: {' '.join(str(e).split())}"


def _machine() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu vendor": _cpu_vendor(),
        "cores": os.cpu_count(),
        "torch CPU capability": torch.backends.cpu.get_cpu_capability(),
        "torch threads": torch.get_num_threads(),
        "oneDNN": torch.backends.mkldnn.is_available(),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info[f"cuda:{i}"] = (
                f"{p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB"
            )
        info["CUDA (torch build)"] = torch.version.cuda
    else:
        info["CUDA devices"] = "none"
    return info


def _cpu_model() -> str:
    from .modeling.cpu.route_choice import cpu_info

    return cpu_info("model name") or platform.processor() or "unknown"


def _cpu_vendor() -> str:
    from .modeling.cpu.route_choice import cpu_vendor

    return cpu_vendor() or "unknown"


def _routes() -> dict:
    """Each CPU speed route, whether it is in force and why (modeling/cpu), and the native kernels' state."""
    from .modeling import cpu
    from .modeling.cpu import sparse_native

    return {**cpu.in_force(), "sparse native kernels": sparse_native.state()}


def _backends() -> dict:
    """Per attention backend: usable here, or why not (from the capability table)."""
    import torch

    from .configuration.backends import BACKENDS, _installed

    cuda = torch.cuda.is_available()
    rows = {}
    for name, caps in BACKENDS.items():
        if not _installed(caps):
            rows[name] = f"needs the {caps.needs} package ({caps.install})"
        elif not ({"cpu", "cuda"} if cuda else {"cpu"}) & set(caps.devices):
            rows[name] = f"needs {' or '.join(caps.devices)}"
        else:
            rows[name] = "ok"
    return rows


def _auto_choices() -> dict:
    """attn_implementation="auto": where its cache is, and each choice cached there for this torch and
    swapformer (entries of other versions are counted, not listed: auto ignores them)."""
    from .modeling.attention import auto_backend, auto_cache
    from .modeling.heads.attention_plan import cached_choices

    current, every = auto_cache.entries(), auto_cache.entries(current=False)
    return {
        "cache": str(auto_cache.cache_file()),
        "mode": os.environ.get(auto_backend.ENV, "measure"),
        "choices": cached_choices() or "none cached",
        "entries of other versions (ignored)": len(every) - len(current),
    }


def _touch_points() -> dict:
    """Each ledger's touch points: "ok" or what is missing. transformers' are checked by importing its
    ledger (it imports them all); the others one by one."""
    rows = {}
    try:
        importlib.import_module("swapformer.modeling.compat.hf_compat")
        rows["transformers (modeling/compat/hf_compat.py)"] = "ok"
    except Exception as e:
        rows["transformers (modeling/compat/hf_compat.py)"] = f"{type(e).__name__}: {e}"
    from .modeling.compat import accelerate_compat, torch_compat

    for name, where in torch_compat.TOUCH_POINTS.items():
        rows[f"torch.{where}"] = _ok(torch_compat.lookup, name)
    for name in accelerate_compat.TOUCH_POINTS:
        rows[f"accelerate {name}"] = _ok(accelerate_compat.resolve, name)
    return rows


def _ok(resolve, name: str) -> str:
    try:
        resolve(name)
    except (ImportError, AttributeError) as e:
        return str(e)
    return "ok"


def report() -> dict:
    from . import __version__

    return {
        "swapformer": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "packages": {name: _package(name) for name in REQUIRED},
        "optional packages": {name: _package(name) for name in OPTIONAL},
        "machine": _guarded(_machine),
        "environment variables": {v: os.environ[v] for v in VARIABLES if v in os.environ} or "none set",
        "speed routes": _guarded(_routes),
        "attention backends": _guarded(_backends),
        "auto backend choices": _guarded(_auto_choices),
        "touch points": _guarded(_touch_points),
    }


def markdown(data: dict) -> str:
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"- {key}:")
            for k, v in value.items():
                lines += (
                    [f"    - {k}:", *(f"        - {item}" for item in v)]
                    if isinstance(v, list)
                    else [f"    - {k}: {v}"]
                )
        else:
            lines.append(f"- {key}: {value}")
    return "\n".join(lines)


def _env(args: argparse.Namespace) -> int:
    data = report()
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print("Copy and paste the text below into your bug report.\n")
        print(markdown(data))
    return 0


def _build_kernels(args: argparse.Namespace) -> int:
    from .modeling.cpu import sparse_native

    missing = sparse_native._missing()
    if missing is not None:
        raise OSError(f"the native kernels cannot be built here: {missing}")
    start = time.perf_counter()
    path = sparse_native.build()
    print(f"sparse native kernels ready in {time.perf_counter() - start:.1f} s: {path}")
    return 0
