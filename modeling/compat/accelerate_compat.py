"""Every place swapformer reaches into Accelerate beyond what its documentation promises.

A sibling of `hf_compat.py` (transformers) and `torch_compat.py` (torch); `tests/compat/test_compat.py` holds
one contract test per touch point and a test that no other module imports these names. Nothing in
modeling/ imports this module: training/ does, lazily, only when the feature that needs a name is asked
for, so an Accelerate release that drops one stops that feature alone, with a message naming the
release and the name, and never a default run (accelerate 1.16 dropped `is_msamp_available`, and
a module-level import of it stopped every `swapformer train`).

Touch points:
    accelerate.utils.is_fp8_available   whether an fp8 recipe package Accelerate supports is installed
                                        (read only for --mixed-precision fp8)
    AcceleratorState._reset_state       forget the mixed precision of an earlier Accelerator in this
                                        process (a second `train()` call in a notebook or the tests)
"""

from __future__ import annotations

import importlib

PACKAGE = "accelerate"

# (module, attribute) per touch point, the way the contract test checks them
TOUCH_POINTS = {
    "is_fp8_available": ("accelerate.utils", "is_fp8_available"),
    "AcceleratorState._reset_state": ("accelerate.state", "AcceleratorState._reset_state"),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version(PACKAGE)
    except PackageNotFoundError:
        return "(not installed)"


def resolve(touch_point: str):
    """The object behind `touch_point`, or an ImportError naming Accelerate's version and the name."""
    module_name, attribute = TOUCH_POINTS[touch_point]
    try:
        obj = importlib.import_module(module_name)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"accelerate {version()} has no {module_name}.{attribute}, which swapformer uses for "
            f"{touch_point!r} ({e}); install an accelerate version swapformer supports "
            "(pyproject.toml) or report this with the output of `swapformer env`"
        ) from None
    return obj


def fp8_unavailable() -> str:
    """Why Accelerate cannot run fp8 recipes with what is installed here, or "" when it can."""
    try:
        available = resolve("is_fp8_available")()
    except ImportError as e:
        return f"swapformer cannot check whether fp8 recipes are installed: {e}"
    if not available:
        return "fp8 needs transformer_engine or torchao installed (pip install torchao)"
    return ""


def reset_accelerator_state() -> None:
    """Forget an earlier Accelerator's state in this process, keeping the distributed part (PartialState)."""
    resolve("AcceleratorState._reset_state")()
