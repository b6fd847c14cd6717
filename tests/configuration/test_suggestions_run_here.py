"""Every backend a refusal suggests runs on this machine (issue 28).

A property over the capability table, not a list of cases: every name a user may pass (each row of the
table, each name transformers knows that swapformer refuses, Hub kernel names, a misspelling) is chosen
for models that need different rows (plain, ALiBi, learned sinks). Where the choice is refused, every
backend the message names instead must pass the same choice on the same model, here. On a machine
without CUDA that rules out `sdpa_fa` and `flash_attention_2`; without flash-attn, `flash_attention_2`.
The choice test runs again as on a CUDA machine (torch.cuda.is_available answering yes) with the model's
weights on the CPU, where the CUDA rows are no answer either.
"""

from __future__ import annotations

import re

import pytest
import torch

import swapformer
from swapformer.configuration.backends import BACKENDS, UNSUPPORTED

from conftest import build, padded_batch, tiny_config

HUB_KERNELS = ("kernels-community/flash-attn2", "kernels-community/vllm-flash-attn3")
NAMES = (*BACKENDS, *UNSUPPORTED, *HUB_KERNELS, "flash_attn_2")
MODELS = {
    "plain": {},
    "alibi": dict(position_embedding_type="alibi"),
    "sinks": dict(attention_sinks=True),
}


def suggested(message: str, refused: str) -> list[str]:
    """The backends a refusal names, other than the one refused, in either quoting it uses."""
    quoted = re.findall(r"""['"]([A-Za-z0-9_./-]+)['"]""", message)
    return [n for n in dict.fromkeys(quoted) if n in BACKENDS and n != refused]


def chosen(model, name: str) -> str | None:
    """None if `model` takes backend `name` (then put back on eager), else the refusal's message."""
    try:
        model.set_attn_implementation(name)
    except ValueError as e:
        return str(e)
    model.set_attn_implementation("eager")
    return None


@pytest.fixture(params=["this machine", "CUDA, weights on the CPU"])
def machine(request, monkeypatch):
    if request.param != "this machine":
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA: the case runs as it is")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return request.param


@pytest.mark.parametrize("needs", MODELS)
@pytest.mark.parametrize("name", NAMES)
def test_every_backend_a_choice_refusal_suggests_runs_here(name, needs, machine):
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder", **MODELS[needs]))
    message = chosen(model, name)
    if message is None:
        return  # it runs here: nothing to suggest
    names = suggested(message, name)
    assert names, f"the refusal of {name!r} suggests nothing: {message}"
    refused = {n: chosen(model, n) for n in names}
    assert not any(refused.values()), f"{message}\nsuggests backends refused here: {refused}"


@pytest.mark.parametrize("name", NAMES)
def test_every_backend_a_config_refusal_suggests_runs_here(name):
    """Built into a config (no model yet), a refused name suggests only backends this machine runs."""
    try:
        tiny_config("decoder", attn_implementation=name)
    except ValueError as e:
        message = str(e)
    else:
        return
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    names = suggested(message, name)
    assert names, f"the refusal of {name!r} suggests nothing: {message}"
    refused = {n: chosen(model, n) for n in names}
    assert not any(refused.values()), f"{message}\nsuggests backends refused here: {refused}"


@pytest.mark.parametrize(
    "backend",
    [n for n, c in BACKENDS.items() if "cpu" in c.devices and "cpu" not in c.backward],
)
def test_a_training_refusal_on_cpu_suggests_backends_that_train_here(backend):
    """flex has no backward on the CPU: the backends its refusal names train here (a step runs)."""
    config = tiny_config("decoder")
    model = build(swapformer.DecoderForCausalLM, config, attn=backend).train()
    ids, mask = padded_batch()
    with pytest.raises(ValueError) as info:
        model(ids, attention_mask=mask, labels=ids)
    names = suggested(str(info.value), backend)
    assert names, str(info.value)
    for name in names:
        other = build(swapformer.DecoderForCausalLM, config, attn=name).train()
        other(ids, attention_mask=mask, labels=ids).loss.backward()
        assert all(p.grad is not None for p in other.parameters() if p.requires_grad), name


def test_on_a_cpu_only_machine_flash_attention_2_suggests_cpu_backends():
    """The issue's case, as a user on a laptop sees it."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    message = chosen(model, "flash_attention_2")
    assert message and "sdpa_fa" not in message and "'sdpa'" in message, message
