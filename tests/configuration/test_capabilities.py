"""Every backend behaves as its row of the capability table says (configuration/backends.py: BACKENDS).

For each backend that runs on the CPU and each feature column that can be exercised here, a tiny model
runs the feature. Where the row says yes, the backend runs and gives eager's result (eager is the
reference). Where it says no, the choice or the forward raises a ValueError that names the backend,
and every backend the message offers instead has the feature in its row; the first of those that runs
on the CPU then runs the same case and gives eager's result (the way out works). So a feature marked
unsupported that silently works fails here, and so does one marked supported that breaks.

CUDA-only backends are refused on the CPU with the table's message. The `compile` column is exercised
by tests/cpu/test_compile.py (parametrised over the same column); CUDA rows by tests/benchmarks/test_gpu.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import swapformer
from swapformer.configuration.backends import BACKENDS, PATTERNS, Capabilities

from conftest import build, cached_step_diffs, max_diff, padded_batch, tiny_config

TOL = 1e-5
LAYER_TYPE = {"full": "full_attention", "sliding": "sliding_attention"}
LAYER_TYPE.update({p: f"{p}_attention" for p in PATTERNS if p not in LAYER_TYPE})
CLASSES = {
    "encoder": swapformer.EncoderModel,
    "decoder": swapformer.DecoderModel,
    "seq2seq": swapformer.Seq2SeqModel,
}


def config(arch, pattern="sliding", **overrides):
    """Layer 0 has `pattern`, layer 1 is full, so one forward runs both kinds of mask."""
    options = dict(
        layer_types=[LAYER_TYPE[pattern], "full_attention"],
        sliding_window=3,
        global_tokens=1,
        attention_block_size=4,
        num_random_blocks=1,
    )
    if arch == "seq2seq":
        options["decoder_layer_types"] = [LAYER_TYPE[pattern], "full_attention"]
    return tiny_config(arch, **(options | overrides))


def forward(model, arch, ids, mask, **kwargs):
    if arch == "seq2seq":
        return model(
            ids, attention_mask=mask, decoder_input_ids=ids[:, :6], decoder_attention_mask=mask[:, :6]
        )
    return model(ids, attention_mask=mask, **kwargs)


def hidden(arch, padding="right", dtype=torch.float32, **overrides) -> Callable:
    """A case: last hidden states of a padded batch (every position: fully masked rows are 0 on all)."""

    def run(backend):
        model = build(CLASSES[arch], config(arch, **overrides), attn=backend).to(dtype)
        ids, mask = padded_batch(length=12, padding=padding)
        with torch.no_grad():
            return forward(model, arch, ids, mask).last_hidden_state

    return run


def packed(backend):
    """One row holding three sequences, marked by restarting position_ids."""
    model = build(swapformer.DecoderModel, config("decoder"), attn=backend)
    ids = torch.arange(3, 15)[None]
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        return model(ids, position_ids=positions).last_hidden_state


def custom_mask(backend):
    """A 4D attention_mask: two packed documents in one row, through a window + global layer and a full
    one. A CUDA-only row is put in place without the device check: the forward refuses the mask before
    any kernel runs."""
    on_cpu = "cpu" in BACKENDS[backend].devices
    model = build(
        swapformer.DecoderModel, config("decoder", "sliding_global"), attn=backend if on_cpu else "eager"
    )
    model.config._attn_implementation_internal = backend
    ids = torch.arange(3, 15)[None]
    mask = torch.block_diag(torch.ones(5, 5), torch.ones(7, 7)).bool().tril()[None, None]
    with torch.no_grad():
        return model(ids, attention_mask=mask).last_hidden_state


def maps(backend):
    """The attention maps of every layer (recomputed where the kernel has none)."""
    model = build(swapformer.EncoderModel, config("encoder", "sliding_global"), attn=backend)
    ids, mask = padded_batch(length=12)
    with torch.no_grad():
        return torch.stack(model(ids, attention_mask=mask, output_attentions=True).attentions)


def dropout(backend):
    """A training forward with attention_dropout: it must act (differ from the eval forward, which
    is compared with eager's)."""
    model = build(swapformer.EncoderModel, config("encoder", attention_dropout=0.5), attn=backend).train()
    ids, mask = padded_batch(length=12)
    with torch.no_grad():
        trained = model(ids, attention_mask=mask).last_hidden_state
        evaluated = model.eval()(ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(trained).all() and max_diff(trained, evaluated) > 1e-3, "dropout did not act"
    return evaluated


def decoding(backend):
    """generate() with the cache: each step's logits minus the uncached forward's, then the uncached
    logits themselves (compared with eager's)."""
    model = build(swapformer.DecoderForCausalLM, config("decoder", "sliding_global"), attn=backend)
    ids, mask = padded_batch(batch=2, length=7, padding="left")
    assert max(cached_step_diffs(model, ids, mask, 3)) <= TOL, "cached steps differ from the uncached forward"
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def gradients(backend):
    """Gradients of every weight in a training forward (dropouts 0), flattened."""
    model = build(swapformer.EncoderModel, config("encoder", "bigbird"), attn=backend).train()
    ids, mask = padded_batch(length=12)
    probe = torch.randn(3, 12, 32, generator=torch.Generator().manual_seed(1)) / 32  # gradients of size ~1
    (model(ids, attention_mask=mask).last_hidden_state * probe).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@dataclass(frozen=True)
class Case:
    feature: str  # the table's column
    label: str
    supported: Callable[[Capabilities], bool]
    run: Callable[[str], torch.Tensor]
    tol: float = TOL


CASES = [
    *(
        Case("patterns", p, lambda c, p=p: p in c.patterns, hidden("encoder", pattern=p, global_tokens=2))
        for p in PATTERNS
    ),
    Case("causal", "causal", lambda c: c.causal, hidden("decoder", padding="left", pattern="bigbird")),
    Case(
        "bidirectional",
        "bidirectional",
        lambda c: c.bidirectional,
        hidden("encoder", pattern="sliding_global"),
    ),
    Case("cross_attention", "cross_attention", lambda c: c.cross_attention, hidden("seq2seq")),
    Case("padding", "left padding", lambda c: c.padding, hidden("decoder", padding="left")),
    Case("packing", "packing", lambda c: c.packing, packed),
    Case("custom_mask", "4D mask", lambda c: c.custom_mask, custom_mask),
    Case("gqa", "gqa", lambda c: c.gqa, hidden("encoder", pattern="sliding_global", num_key_value_heads=2)),
    Case("dropout", "dropout in training", lambda c: c.dropout, dropout),
    *(
        Case(
            "position_bias", kind, lambda c: c.position_bias, hidden("encoder", position_embedding_type=kind)
        )
        for kind in ("alibi", "relative_bias")
    ),
    Case(
        "linformer",
        "linformer",
        lambda c: c.linformer,
        hidden("encoder", pattern="full", position_embedding_type="learned", linformer_k=5),
    ),
    Case(
        "output_attentions",
        "output_attentions",
        lambda c: c.output_attentions in ("native", "recomputed"),
        maps,
    ),
    Case("kv_cache", "decoding", lambda c: c.kv_cache, decoding),
    Case("backward", "backward on cpu", lambda c: "cpu" in c.backward, gradients),
    Case(
        "sinks",
        "learned sinks",
        lambda c: c.sinks,
        hidden("decoder", padding="left", pattern="bigbird", num_key_value_heads=2, attention_sinks=True),
    ),
    Case(
        "dtypes", "bfloat16", lambda c: "bfloat16" in c.dtypes, hidden("encoder", dtype=torch.bfloat16), 5e-2
    ),
]


# flex compiles a kernel per shape on the CPU (5-40 s each, ~5 min for every case here): its runs of
# these cases, each with new shapes, are left to the tests that already run them; its refusals all run.
FLEX_ELSEWHERE = {
    "gqa": "tests/attention/test_pattern_oracle.py::test_flex_equals_the_oracle (2 kv heads)",
    "packing": "tests/attention/test_packing.py::test_flex_packed_row_equals_each_sequence_alone",
    "decoding": "tests/caches/test_generate.py::test_flex_attention_decoding_equals_uncached_forward",
    "4D mask": "tests/attention/test_custom_masks.py::test_flex_attention_equals_eager_on_a_4d_mask",
    "cross_attention": "not run anywhere: 3 compiles, ~70 s on the CPU (a gap, reported)",
}


def parameters():
    for backend, caps in BACKENDS.items():
        if "cpu" not in caps.devices:
            continue
        for case in CASES:
            flex_run = backend == "flex_attention" and case.supported(caps)
            if flex_run and case.label in FLEX_ELSEWHERE:
                continue
            yield pytest.param(
                backend, case, id=f"{backend}-{case.label}", marks=[pytest.mark.slow] if flex_run else []
            )


@pytest.fixture(scope="module")
def eager_results():
    return {}


def eager(case: Case, results: dict) -> torch.Tensor:
    if case.label not in results:
        results[case.label] = case.run("eager")
    return results[case.label]


def offered(message: str, backend: str) -> list[str]:
    """The backends a refusal offers instead, in its order."""
    return [
        n for n in dict.fromkeys(re.findall(r"'([a-z_0-9]+)'", message)) if n in BACKENDS and n != backend
    ]


@pytest.mark.parametrize("backend, case", list(parameters()))
def test_backend_does_what_its_row_says(backend, case, eager_results):
    if case.supported(BACKENDS[backend]):
        got = case.run(backend)
        assert max_diff(got, eager(case, eager_results)) <= case.tol, (
            f"{backend} supports {case.feature} ({case.label}) by its row but does not match eager"
        )
        return
    check_refusal(backend, case, eager_results)


def check_refusal(backend: str, case: Case, eager_results: dict) -> None:
    """The case raises the table's ValueError naming `backend`; every backend it offers instead has the
    feature, and the first that runs on the CPU gives eager's result."""
    with pytest.raises(ValueError) as info:
        case.run(backend)
    message = str(info.value)
    assert message.startswith(f"attn_implementation={backend!r}"), message
    alternatives = offered(message, backend)
    assert alternatives, f"the refusal offers no backend instead: {message}"
    for name in alternatives:
        assert case.supported(BACKENDS[name]), f"{message}\noffers {name!r}, whose row lacks {case.feature}"
    way_out = next(n for n in alternatives if "cpu" in BACKENDS[n].devices)
    assert max_diff(case.run(way_out), eager(case, eager_results)) <= case.tol


@pytest.mark.parametrize("backend", [n for n, c in BACKENDS.items() if not c.custom_mask])
def test_rows_without_custom_masks_refuse_one_in_the_forward(backend, eager_results):
    """The 4D mask is a fact of the batch, refused when the forward sees it, also by the CUDA-only rows."""
    check_refusal(backend, next(c for c in CASES if c.feature == "custom_mask"), eager_results)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("backend", [n for n, c in BACKENDS.items() if "cpu" not in c.devices])
def test_cuda_only_backend_is_refused_on_cpu(backend, eager_results):
    caps = BACKENDS[backend]
    model = build(swapformer.DecoderModel, config("decoder", "full"))
    with pytest.raises(ValueError) as info:
        model.set_attn_implementation(backend)
    assert model.config._attn_implementation == "eager"  # nothing changed
    message = str(info.value)
    devices = " or ".join(d.upper() for d in caps.devices)
    assert message.startswith(f"attn_implementation={backend!r} runs on {devices} only"), message
    causal = next(c for c in CASES if c.label == "causal")
    for name in offered(message, backend):  # every backend offered runs here
        assert max_diff(causal.run(name), eager(causal, eager_results)) <= TOL, name
