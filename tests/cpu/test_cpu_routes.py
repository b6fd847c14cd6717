"""One switch for the CPU speed routes (modeling/cpu): `cpu_routes(False)` / SWAPFORMER_CPU_ROUTES=off
turns off the oneDNN linear route, MLP chunking, generate()'s decoding weight copies and the native
sparse kernels, over their own switches. The oracle is the plain torch expression: every route's own
switch set to torch's path; with the switch off a forward and generate() equal it bit for bit, equal
the routes-on outputs within fp32 rounding, and no route function runs (each is patched to raise)."""

from __future__ import annotations

import contextlib
import contextvars
import os
import subprocess
import sys

import pytest
import torch

import swapformer
from swapformer.modeling.cpu import mlp, route_choice, routes, weight_copies
from swapformer.modeling.cpu.weight_copies import DecodingWeights
from swapformer.modeling.sparse import sparse as sparse

from conftest import SPARSE_CPU_ROUTES, build, max_diff, padded_batch, pattern_config, route_env_fixture

CLASSES = {
    "encoder": swapformer.EncoderForMaskedLM,
    "decoder": swapformer.DecoderForCausalLM,
    "seq2seq": swapformer.Seq2SeqForConditionalGeneration,
}
NATIVE = "native" in SPARSE_CPU_ROUTES
env_switch = route_env_fixture(routes, "_routes_default", "_default", "Seam.environment")


def watch_routes(monkeypatch, forbid: bool) -> dict[str, int]:
    """Wrap each route's entry (the oneDNN op, MLP chunking, the weight copies, the native attend) to
    count its calls, or to raise when `forbid`."""
    calls = {"onednn linear": 0, "MLP chunks": 0, "decoding copies": 0, "sparse native": 0}

    def watched(name, real):
        def call(*args, **kwargs):
            if forbid:
                raise AssertionError(f"the {name} route ran with the CPU routes off")
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(routes, "onednn_linear", watched("onednn linear", routes.onednn_linear))
    monkeypatch.setattr(mlp, "_in_chunks", watched("MLP chunks", mlp._in_chunks))
    monkeypatch.setattr(
        weight_copies, "input_major_copy", watched("decoding copies", weight_copies.input_major_copy)
    )
    during = watched("decoding copies", DecodingWeights.during.__func__)
    monkeypatch.setattr(DecodingWeights, "during", classmethod(during))
    monkeypatch.setattr(sparse, "sparse_native_attend", watched("sparse native", sparse.sparse_native_attend))
    return calls


def run(model, arch: str) -> list[torch.Tensor]:
    """Logits of a padded batch, and for the generating heads greedy tokens from it."""
    ids, mask = padded_batch(length=20, padding="right" if arch == "encoder" else "left")
    inputs = dict(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        extra = dict(decoder_input_ids=ids[:, :6]) if arch == "seq2seq" else {}
        outputs = [model(**inputs, **extra).logits]
        if arch != "encoder":
            outputs.append(model.generate(**inputs, max_new_tokens=6, do_sample=False))
    return outputs


def all_routes(on: bool):
    """Every route's own switch: its fast path (on) or torch's (off)."""
    stack = contextlib.ExitStack()
    stack.enter_context(swapformer.cpu_linear("onednn" if on else "torch"))
    if NATIVE:
        stack.enter_context(swapformer.sparse_cpu("native" if on else "torch"))
    return stack


@pytest.mark.parametrize("arch", ["encoder", "decoder", "seq2seq"])
def test_switch_off_runs_the_plain_torch_expressions(arch, monkeypatch):
    config = pattern_config(arch, "sliding_global_attention")
    model = build(CLASSES[arch], config, attn="sparse")
    monkeypatch.setattr(routes.Seam, "mlp_chunk_bytes", 4 * config.intermediate_size * 4)  # 4 rows a chunk
    model.decoding_copies = "all"
    calls = watch_routes(monkeypatch, forbid=False)
    with all_routes(on=True):
        fast = run(model, arch)
    expected = {"onednn linear", "MLP chunks"} | ({"sparse native"} if NATIVE else set())
    expected |= {"decoding copies"} if arch != "encoder" else set()
    assert {name for name, n in calls.items() if n} == expected  # the routes ran: the spies see them

    with all_routes(on=False):  # the oracle: each route's own switch on torch's path
        model.decoding_copies = "none"
        monkeypatch.setattr(routes.Seam, "mlp_chunk_bytes", 2**62)
        plain = run(model, arch)
    model.decoding_copies = "all"
    monkeypatch.setattr(routes.Seam, "mlp_chunk_bytes", 4 * config.intermediate_size * 4)
    watch_routes(monkeypatch, forbid=True)
    with all_routes(on=True), swapformer.cpu_routes(False):  # the one switch wins over the others
        off = run(model, arch)
    assert torch.equal(off[0], plain[0])
    assert max_diff(off[0], fast[0]) <= 1e-4 * float(fast[0].abs().max())
    for tokens in (*off[1:], *fast[1:]):
        assert torch.equal(tokens, plain[1])


def test_the_routes_report_torch_while_off_and_each_switch_again_after():
    with swapformer.cpu_linear("onednn"):
        with swapformer.cpu_routes(False):
            assert swapformer.cpu_linear_route() == "torch" and swapformer.sparse_cpu_route() == "torch"
            assert not routes.cpu_routes_on()
            with swapformer.cpu_routes(True):  # hands the choice back to each route's switch
                assert swapformer.cpu_linear_route() == "onednn"
        assert swapformer.cpu_linear_route() == "onednn" and routes.cpu_routes_on()


def test_as_a_call_the_switch_holds_for_the_thread():
    def body():
        swapformer.cpu_routes(False)
        first = routes.cpu_routes_on()
        swapformer.cpu_routes(True)
        return first, routes.cpu_routes_on()

    assert contextvars.copy_context().run(body) == (False, True)
    assert routes.cpu_routes_on()


def test_a_wrong_switch_is_refused_where_it_is_given(env_switch):
    with pytest.raises(TypeError, match=r"cpu_routes\(enabled\) takes True or False, got 'off' \(str\)"):
        swapformer.cpu_routes("off")
    env_switch("maybe")
    with pytest.raises(ValueError, match=r"SWAPFORMER_CPU_ROUTES is 'maybe'; it must be 'on'.*or 'off'"):
        build(swapformer.EncoderModel, pattern_config("encoder", "full_attention"))  # when the model is built


@pytest.mark.skipif(not route_choice.onednn_available(), reason="this torch build has no oneDNN linear op")
def test_the_environment_turns_every_route_off_in_a_fresh_process():
    """SWAPFORMER_CPU_ROUTES=off wins over SWAPFORMER_CPU_LINEAR=onednn, from the first call."""
    code = (
        "import swapformer\n"
        "print(swapformer.cpu_linear_route(), swapformer.sparse_cpu_route())\n"
        "with swapformer.cpu_routes(True):\n"
        "    print(swapformer.cpu_linear_route())\n"
    )
    env = {**os.environ, "SWAPFORMER_CPU_ROUTES": "off", "SWAPFORMER_CPU_LINEAR": "onednn"}
    env.pop("SWAPFORMER_SPARSE_CPU", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:2] == ["torch torch", "onednn"]


@pytest.mark.parametrize("environment", ["on", "off"])
def test_the_seam_reads_the_route_cpu_linear_route_names_under_every_switch(env_switch, environment):
    """`core.layers.project` reads the route as values (`routes.Seam`); they must name what
    `cpu_linear_route()` says in every combination of the environment's switch, `cpu_routes` and
    `cpu_linear` (SWAPFORMER_CPU_ROUTES=off wins over `cpu_linear`, `cpu_routes(True)` over the environment)."""
    env_switch(environment)

    def seam() -> str:
        return routes.Seam.linear.get() or routes.Seam.environment or routes.resolve_environment_route()

    assert seam() == swapformer.cpu_linear_route()
    for enabled in (None, False, True):
        for linear in (None, "torch", "onednn"):
            with contextlib.ExitStack() as stack:
                if enabled is not None:
                    stack.enter_context(swapformer.cpu_routes(enabled))
                if linear is not None:
                    stack.enter_context(swapformer.cpu_linear(linear))
                assert seam() == swapformer.cpu_linear_route(), (environment, enabled, linear)
            assert seam() == swapformer.cpu_linear_route()
