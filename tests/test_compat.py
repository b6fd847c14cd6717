"""Touch points with dependencies other than transformers (Accelerate, torch, ...): one contract test
each, and the promise that a release dropping a name stops only the feature that needs it.

transformers' touch points have their own file (test_hf_compat.py).
"""

from __future__ import annotations

import accelerate
import accelerate.utils
import pytest

from swapformer.modeling import accelerate_compat
from swapformer.training import launch


@pytest.mark.parametrize("touch_point", sorted(accelerate_compat.TOUCH_POINTS))
def test_accelerate_touch_points_exist(touch_point):
    module, attribute = accelerate_compat.TOUCH_POINTS[touch_point]
    try:
        accelerate_compat.resolve(touch_point)
    except ImportError as e:  # the message the user would see, naming the release and the name
        pytest.fail(f"accelerate touch point {touch_point}: {e}")
    assert callable(accelerate_compat.resolve(touch_point)), (
        f"accelerate {accelerate.__version__}: {attribute}"
    )


def test_a_missing_accelerate_name_is_reported_with_the_version_and_the_name(monkeypatch):
    monkeypatch.delattr(accelerate.utils, "is_fp8_available")
    with pytest.raises(
        ImportError, match=rf"accelerate {accelerate.__version__} has no accelerate\.utils\.is_fp8"
    ):
        accelerate_compat.resolve("is_fp8_available")
    why = accelerate_compat.fp8_unavailable()
    assert why.startswith("swapformer cannot check whether fp8 recipes are installed: accelerate ")


def test_a_default_run_never_reads_an_fp8_helper(monkeypatch):
    """The accelerate 1.16 break: a helper only fp8 needs went missing and stopped every run."""

    def missing(touch_point):
        raise ImportError(f"{touch_point} is gone")

    monkeypatch.setattr(accelerate_compat, "resolve", missing)
    for precision in ("no", "bf16"):
        launch.check_precision(precision)  # no error
