"""The CPU linear route (modeling/cpu/linear.py): `project(module, x)` runs fp32 CPU inference of a plain
`nn.Linear` on oneDNN where its route applies and is `module(x)` everywhere else, with `F.linear` as the
oracle for values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import swapformer
from swapformer.modeling.core.layers import project
from swapformer.modeling.cpu import route_choice
from swapformer.modeling.cpu import routes as routes_module
from swapformer.modeling.cpu.routes import cpu_linear, cpu_linear_route
from swapformer.modeling.cpu.weight_copies import DecodingWeights, input_major_copy

from conftest import build, max_diff, route_env_fixture, tiny_config

ONEDNN_OP = "mkldnn::_linear_pointwise"

pytestmark = pytest.mark.skipif(
    not route_choice.onednn_available(), reason="this torch build has no oneDNN linear op"
)


def ops_run(fn) -> set[str]:
    """The names of the ops `fn()` ran (torch.profiler)."""
    with torch.profiler.profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_diff(a, b) / max(float(b.abs().max()), 1e-30)


env_route = route_env_fixture(routes_module, "_default", "Seam.environment", env="LINEAR_ENV")


@pytest.mark.parametrize(
    "x_shape, bias, layout",
    [
        ((5, 24), True, "contiguous"),
        ((2, 7, 24), True, "contiguous"),
        ((2, 7, 24), False, "contiguous"),
        ((24,), True, "contiguous"),
        ((0, 24), True, "contiguous"),
        ((3, 7, 24), True, "strided input"),
        ((3, 7, 24), True, "input-major weight"),  # DecodingWeights' copies
    ],
)
def test_onednn_route_equals_f_linear(x_shape, bias, layout):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*x_shape)
    if layout == "strided input":
        x = torch.randn(*x_shape[:-1], 2 * x_shape[-1])[..., ::2]
    if layout == "input-major weight":
        with torch.no_grad():
            layer._parameters["weight"] = nn.Parameter(input_major_copy(layer.weight), requires_grad=False)
    with torch.no_grad(), cpu_linear("onednn"):
        expected = F.linear(x, layer.weight, layer.bias)
        ops = ops_run(lambda: project(layer, x))
        out = project(layer, x)
    assert ONEDNN_OP in ops
    assert out.shape == expected.shape and out.dtype == expected.dtype
    if out.numel():
        assert relative_diff(out, expected) <= 1e-6


def projected(route: str, grad_mode) -> tuple[set[str], torch.Tensor, torch.Tensor]:
    """A seeded nn.Linear(24, 40) on x (3, 24), projected on `route` under `grad_mode` (torch.no_grad,
    torch.inference_mode): the ops the projection ran, its output, and F.linear's output."""
    torch.manual_seed(0)
    layer, x = nn.Linear(24, 40), torch.randn(3, 24)
    with grad_mode(), cpu_linear(route):
        ops = ops_run(lambda: project(layer, x))
        out = project(layer, x)
        expected = F.linear(x, layer.weight, layer.bias)
    return ops, out, expected


def test_torch_route_is_f_linear_bit_for_bit():
    ops, out, expected = projected("torch", torch.no_grad)
    assert ONEDNN_OP not in ops
    assert torch.equal(out, expected)


@pytest.mark.parametrize("needs_grad", ["input", "weight"])
def test_recorded_gradients_go_through_f_linear(needs_grad):
    """The oneDNN op has no backward: wherever a gradient is recorded the layer is F.linear, and its
    gradients are F.linear's."""
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    layer.weight.requires_grad_(needs_grad == "weight")
    layer.bias.requires_grad_(needs_grad == "weight")
    x = torch.randn(3, 24, requires_grad=needs_grad == "input")
    with cpu_linear("onednn"):
        assert ONEDNN_OP not in ops_run(lambda: project(layer, x))
        out = project(layer, x)
        out.square().sum().backward()
    leaf = x if needs_grad == "input" else layer.weight
    got = leaf.grad.clone()
    leaf.grad = None
    F.linear(x, layer.weight, layer.bias).square().sum().backward()
    assert out.requires_grad and torch.equal(got, leaf.grad)


def test_grad_enabled_without_anything_requiring_it_still_uses_onednn():
    torch.manual_seed(0)
    layer = nn.Linear(24, 40).requires_grad_(False)
    x = torch.randn(3, 24)
    with cpu_linear("onednn"):
        assert torch.is_grad_enabled() and ONEDNN_OP in ops_run(lambda: project(layer, x))


@pytest.mark.parametrize(
    "case", ["float64", "autocast", "mkldnn disabled", "weight subclass", "strided weight"]
)
def test_cases_outside_the_route_are_f_linear(case):
    torch.manual_seed(0)
    layer, x = nn.Linear(24, 40), torch.randn(3, 24)
    if case == "float64":
        layer, x = layer.double(), x.double()
    if case == "strided weight":  # a slice of a larger matrix: oneDNN's slow path, refused
        with torch.no_grad():
            layer.weight = nn.Parameter(torch.randn(40, 48)[:, :24])
    if case == "weight subclass":

        class Marked(torch.Tensor):
            pass

        with torch.no_grad():
            layer.weight = nn.Parameter(layer.weight.detach().as_subclass(Marked))
    contexts = {
        "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        "mkldnn disabled": lambda: torch.backends.mkldnn.flags(enabled=False),
    }
    with torch.no_grad(), cpu_linear("onednn"), contexts.get(case, torch.no_grad)():
        ops = ops_run(lambda: project(layer, x))
        out = project(layer, x)
        expected = F.linear(x, layer.weight, layer.bias)
    assert ONEDNN_OP not in ops
    assert out.dtype == expected.dtype and torch.equal(
        out.as_subclass(torch.Tensor), expected.as_subclass(torch.Tensor)
    )
    if case == "autocast":
        assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("hook", ["forward", "pre", "global forward", "global pre"])
def test_a_hooked_linear_is_called_as_a_module(hook):
    """Its hooks fire once, see the output `project` returns, and a pre-hook's changed input is used."""
    torch.manual_seed(0)
    layer, x = nn.Linear(24, 40), torch.randn(3, 24)
    seen = []

    def forward_hook(module, args, output):
        seen.append(output)

    def pre_hook(module, args):
        seen.append(args[0])
        return (2 * args[0],)

    register = {
        "forward": lambda: layer.register_forward_hook(forward_hook),
        "pre": lambda: layer.register_forward_pre_hook(pre_hook),
        "global forward": lambda: nn.modules.module.register_module_forward_hook(forward_hook),
        "global pre": lambda: nn.modules.module.register_module_forward_pre_hook(pre_hook),
    }
    handle = register[hook]()
    try:
        with torch.no_grad(), cpu_linear("onednn"):
            ops = ops_run(lambda: project(layer, x))
            seen.clear()
            out = project(layer, x)
    finally:
        handle.remove()
    assert ONEDNN_OP not in ops and len(seen) == 1
    if hook.endswith("pre"):
        assert seen[0] is x and torch.equal(out, F.linear(2 * x, layer.weight, layer.bias))
    else:
        assert seen[0] is out and torch.equal(out, F.linear(x, layer.weight, layer.bias))


class Doubled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def _lora(layer):
    from peft import LoraConfig, get_peft_model

    holder = nn.Sequential()
    holder.add_module("proj", layer)
    config = LoraConfig(r=2, target_modules=["proj"], init_lora_weights=False)
    return get_peft_model(holder, config).base_model.model.proj


def _replaced_forward(layer):
    """An instance whose forward is replaced, as Accelerate's offloading hooks replace it."""
    original = layer.forward
    layer.forward = lambda x: original(x) + 1
    return layer


@pytest.mark.parametrize(
    "make", [Doubled, _lora, _replaced_forward], ids=["subclass", "peft lora", "replaced forward"]
)
def test_other_modules_run_their_own_forward(make):
    """`project` is `module(x)` for anything but a plain nn.Linear, whatever the route."""
    torch.manual_seed(0)
    x = torch.randn(3, 24)
    module = make(nn.Linear(24, 40)) if make is not Doubled else Doubled(24, 40)
    with torch.no_grad():
        expected = module(x)
        with cpu_linear("onednn"):
            out = project(module, x)
    assert torch.equal(out, expected)
    assert not torch.equal(out, F.linear(x, module.weight, module.bias))


def test_environment_variable_chooses_the_route(env_route, monkeypatch):
    env_route("torch")
    assert cpu_linear_route() == "torch"
    env_route("onednn")
    assert cpu_linear_route() == "onednn"
    with cpu_linear("torch"):  # the context manager wins over the environment
        assert cpu_linear_route() == "torch"
    assert cpu_linear_route() == "onednn"
    cases = (
        ("AVX2", "AuthenticAMD", "torch"),
        ("AVX512", "AuthenticAMD", "onednn"),
        ("AVX512", "GenuineIntel", "torch"),  # MKL runs AVX-512 there itself
        ("AVX512", "", "torch"),
        ("DEFAULT", "AuthenticAMD", "torch"),
    )
    for capability, vendor, route in cases:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(route_choice, "cpu_vendor", lambda v=vendor: v)
        env_route(None)  # unset: "auto"
        assert cpu_linear_route() == route, (capability, vendor)
        with cpu_linear("auto"):
            assert cpu_linear_route() == route


def test_a_wrong_route_is_refused_where_it_is_given(env_route):
    env_route("mkl")
    with pytest.raises(ValueError, match=r"SWAPFORMER_CPU_LINEAR is 'mkl'.*'auto', 'onednn', 'torch'"):
        build(swapformer.EncoderModel, tiny_config("encoder"))  # when the model is built
    with pytest.raises(ValueError, match=r"cpu_linear\(route\) is 'fast'.*'auto', 'onednn', 'torch'"):
        with cpu_linear("fast"):
            pass


def test_onednn_route_forced_without_onednn_is_refused(monkeypatch):
    monkeypatch.setattr(route_choice, "onednn_available", lambda: False)
    with pytest.raises(ValueError, match="no oneDNN linear op.*use 'auto' or 'torch'"):
        with cpu_linear("onednn"):
            pass


@pytest.mark.parametrize("arch", ["encoder", "decoder", "seq2seq"])
def test_models_run_their_linears_on_the_route(arch):
    """Whole models: the oneDNN route gives the torch route's outputs and reaches every projection
    (no MKL product is left), each of them a plain nn.Linear."""
    classes = {
        "encoder": swapformer.EncoderForMaskedLM,
        "decoder": swapformer.DecoderForCausalLM,
        "seq2seq": swapformer.Seq2SeqForConditionalGeneration,
    }
    model = build(classes[arch], tiny_config(arch, mlp_type="gated" if arch == "decoder" else "mlp"))
    ids = torch.randint(3, 60, (2, 9))
    inputs = dict(input_ids=ids, decoder_input_ids=ids[:, :5]) if arch == "seq2seq" else dict(input_ids=ids)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        with cpu_linear("torch"):
            reference = model(**inputs).logits
        with cpu_linear("onednn"):
            ops = ops_run(lambda: model(**inputs))
            fast = model(**inputs).logits
    assert ONEDNN_OP in ops and "aten::addmm" not in ops and "aten::mm" not in ops
    assert relative_diff(fast, reference) <= 1e-5


def test_mlp_row_chunks_on_the_onednn_route(monkeypatch):
    """The chunked MLP (no gradients, long inputs) on the oneDNN route equals one plain pass."""

    config = tiny_config("encoder")
    mlp = build(swapformer.EncoderModel, config).layers[0].mlp
    x = torch.randn(2, 37, config.hidden_size)
    with torch.enable_grad():
        whole = mlp(x).detach()
    monkeypatch.setattr(
        routes_module.Seam, "mlp_chunk_bytes", 5 * config.intermediate_size * x.element_size()
    )
    with torch.no_grad(), cpu_linear("onednn"):
        ops = ops_run(lambda: mlp(x))
        chunked = mlp(x)
    assert ONEDNN_OP in ops and "aten::addmm" not in ops
    assert relative_diff(chunked, whole) <= 1e-6


def test_generate_copies_no_weights_on_the_onednn_route(monkeypatch):
    """decoding_copies="auto" copies the weights input-major on torch's route (where it pays) and not
    on the oneDNN route (which reads the (out, in) layout at full speed)."""
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    chosen = []
    real = DecodingWeights.during.__func__

    def spy(cls, model, choice=None):
        chosen.append(choice)
        return real(cls, model, choice)

    monkeypatch.setattr(DecodingWeights, "during", classmethod(spy))
    prompt = torch.randint(3, 60, (1, 4))
    outputs = {}
    for route in ("torch", "onednn"):
        with torch.no_grad(), cpu_linear(route):
            outputs[route] = model.generate(
                prompt, max_new_tokens=DecodingWeights.MIN_NEW_TOKENS, do_sample=False, pad_token_id=0
            )
    assert chosen == ["all", "none"]
    assert torch.equal(outputs["torch"], outputs["onednn"])


def test_inference_mode_uses_onednn():
    ops, out, expected = projected("onednn", torch.inference_mode)
    assert ONEDNN_OP in ops and out.is_inference()
    assert relative_diff(out, expected) <= 1e-6
