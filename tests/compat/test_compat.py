"""Touch points with dependencies other than transformers (Accelerate, torch, ...): one contract test
each, and the promise that a release dropping a name stops only the feature that needs it.

transformers' touch points have their own file (test_hf_compat.py).
"""

from __future__ import annotations

import re

import accelerate
import accelerate.utils
import pytest
import torch

from swapformer.modeling.compat import accelerate_compat as accelerate_compat
from swapformer.modeling.compat import torch_compat as torch_compat
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
        ImportError, match=re.escape(f"accelerate {accelerate.__version__} has no accelerate.utils.is_fp8")
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


# torch -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("touch_point", sorted(torch_compat.TOUCH_POINTS))
def test_torch_touch_points_exist(touch_point):
    try:
        torch_compat.lookup(touch_point)
    except AttributeError as e:
        pytest.fail(f"torch touch point {touch_point}: {e}")


def test_a_missing_torch_name_is_reported_with_the_version_and_the_name(monkeypatch):
    monkeypatch.setitem(torch_compat.TOUCH_POINTS, "gone", "_C._no_such_function")
    with pytest.raises(
        AttributeError, match=re.escape(f"torch {torch.__version__} has no torch._C._no_such_function")
    ):
        torch_compat.lookup("gone")
    assert not torch_compat.available("gone")


def test_flash_cpu_returns_the_output_and_log_sum_exp_sdpa_computes():
    """The sparse backend merges segments with the kernel's log-sum-exp: check both against a reference."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g) for _ in range(3))
    out, lse = torch_compat.flash_cpu(q, k, v, scale=0.3)[:2]
    scores = (q @ k.transpose(-1, -2)) * 0.3
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.reshape(2, 3, 7), torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


def test_flash_cpu_backward_gives_autograd_gradients():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 2, 5, 8, generator=g)
    out, lse = torch_compat.flash_cpu(q.detach(), k.detach(), v.detach(), scale=0.5)[:2]
    dq, dk, dv = torch_compat.flash_cpu_backward(
        grad, q.detach(), k.detach(), v.detach(), out, lse, 0.0, False, scale=0.5
    )[:3]
    torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5).backward(grad)
    for mine, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_onednn_linear_equals_f_linear():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    torch.testing.assert_close(torch_compat.onednn_linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_functorch_and_mkldnn_state_readers_follow_torch_switches():
    assert torch_compat.functorch_active() is False
    seen = []
    torch.func.vmap(lambda x: seen.append(torch_compat.functorch_active()) or x)(torch.ones(2))
    assert seen == [True]
    with torch.backends.mkldnn.flags(enabled=False):
        assert torch_compat.mkldnn_enabled() is False
    assert torch_compat.mkldnn_enabled() is torch.backends.mkldnn.is_available()


def test_hook_readers_see_public_registrations():
    module = torch.nn.Linear(2, 2)
    assert not torch_compat.module_hooked(module)
    handle = module.register_forward_pre_hook(lambda m, args: None)
    assert torch_compat.module_hooked(module)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: None)
    assert torch_compat.global_forward_hooks_registered() and torch_compat.module_hooked(module)
    handle.remove()
    assert not torch_compat.module_hooked(module)


def test_traceable_wrapper_subclass_check():
    assert torch_compat.is_traceable_wrapper_subclass(torch.ones(2)) is False
