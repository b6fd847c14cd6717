"""torch.export and torch.compile(fullgraph=True) of every base model, and generate() with a static
cache under compile as transformers' own generation test runs it (issue 10, item 11).

Compiled and exported outputs are compared with the eager model's (<= 1e-5). Most compile cases use
the `aot_eager` backend: it captures the same full graph (a graph break or a data-dependent branch
fails just as it would under inductor) without minutes of C++ compilation on a CPU; one case per
check runs inductor end to end.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CompileConfig
from transformers.cache_utils import DynamicCache

import swapformer

from conftest import ARCHS, BASE_CLASSES, LM_CLASSES, MIXED_LAYERS, build, max_diff, padded_batch, tiny_config

pytestmark = pytest.mark.slow
TOL = 1e-5


def base_inputs(arch: str, padded: bool) -> dict:
    ids, mask = padded_batch(padding="right" if padded else "none")
    kwargs = {"input_ids": ids}
    if padded:
        kwargs["attention_mask"] = mask
    if arch == "seq2seq":
        kwargs["decoder_input_ids"] = ids[:, :5]
        if padded:
            kwargs["decoder_attention_mask"] = mask[:, :5]
    if arch != "encoder":
        kwargs["use_cache"] = False  # an exported graph returns tensors, not a cache object
    return kwargs


def model_for(arch: str, attn: str, **overrides):
    config = tiny_config(arch, position_embedding_type="rope", num_key_value_heads=2, **overrides)
    return build(BASE_CLASSES[arch], config, attn=attn)


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_torch_export(arch, attn, padded, report):
    model = model_for(arch, attn)
    kwargs = base_inputs(arch, padded)
    with torch.no_grad():
        want = model(**kwargs).last_hidden_state
        program = torch.export.export(model, (), copy.deepcopy(kwargs), strict=False)
        got = program.module()(**kwargs).last_hidden_state
    report("exported vs eager", max_diff(got, want))
    assert max_diff(got, want) <= TOL


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_compile_fullgraph(arch, attn, padded, report):
    check_compiled(model_for(arch, attn), base_inputs(arch, padded), report)


def check_compiled(model, kwargs, report):
    """torch.compile(fullgraph=True) gives eager's last hidden state."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want = model(**kwargs).last_hidden_state
        got = compiled(**kwargs).last_hidden_state
    report("compiled vs eager", max_diff(got, want))
    assert max_diff(got, want) <= TOL


BIGBIRD = dict(
    layer_types=["bigbird_attention", "bigbird_attention"],
    sliding_window=1,
    global_tokens=1,
    attention_block_size=2,
    num_random_blocks=2,
)


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_bigbird_padded_rows_export_and_compile(arch, report):
    """BigBird counts each row's random blocks from its first real token, in the layout of its real
    length: which lengths occur is data, so a traced graph must hold them all. The exported program and
    the fullgraph-compiled model, traced on one padding mask, equal eager on another of the same shape."""
    model = model_for(arch, "sdpa", **BIGBIRD)
    traced_on = base_inputs(arch, True)
    ids, mask = padded_batch(padding="left")  # other rows, other lengths
    other = {**traced_on, "input_ids": ids, "attention_mask": mask}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        program = torch.export.export(model, (), copy.deepcopy(traced_on), strict=False).module()
        compiled(**traced_on)
        diff = 0.0
        for kwargs in (traced_on, other):
            want = model(**kwargs).last_hidden_state
            for got in (program(**kwargs).last_hidden_state, compiled(**kwargs).last_hidden_state):
                diff = max(diff, max_diff(got, want, kwargs["attention_mask"]))
    report("exported and compiled vs eager", diff)
    assert diff <= TOL


def test_compile_fullgraph_inductor_with_cache(report):
    """Inductor end to end, a prefill and a cached step, window layers included."""
    torch._dynamo.reset()
    config = tiny_config(
        "decoder",
        position_embedding_type="rope",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
    )
    model = build(swapformer.DecoderModel, config, attn="sdpa")
    ids, mask = padded_batch(padding="left")
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        eager_cache, compiled_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        want = model(ids, attention_mask=mask, cache=eager_cache).last_hidden_state
        got = compiled(ids, attention_mask=mask, cache=compiled_cache).last_hidden_state
        step_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        want_step = model(ids[:, :1], attention_mask=step_mask, cache=eager_cache).last_hidden_state
        got_step = compiled(ids[:, :1], attention_mask=step_mask, cache=compiled_cache).last_hidden_state
    diff = max(max_diff(got, want, mask), max_diff(got_step, want_step))
    report("inductor vs eager", diff)
    assert diff <= TOL


@pytest.mark.parametrize(
    "arch, attn, backend, layers",
    [
        ("decoder", "sdpa", "inductor", {}),
        ("decoder", "eager", "aot_eager", {}),
        ("seq2seq", "sdpa", "aot_eager", {}),
        ("decoder", "sdpa", "aot_eager", BIGBIRD),  # left-padded rows count random blocks from their start
        # full and windowed layers in one static cache, as Gemma 2 compiles (issue 26): the window layers'
        # keys move every step, inside one graph
        ("decoder", "sdpa", "aot_eager", MIXED_LAYERS),
        ("decoder", "eager", "aot_eager", MIXED_LAYERS),
        ("decoder", "sdpa", "aot_eager", dict(MIXED_LAYERS, layer_types=MIXED_LAYERS["layer_types"][::-1])),
        ("seq2seq", "sdpa", "aot_eager", dict(MIXED_LAYERS, decoder_layer_types=MIXED_LAYERS["layer_types"])),
    ],
    ids=[
        "decoder-sdpa-inductor",
        "decoder-eager-aot_eager",
        "seq2seq-sdpa-aot_eager",
        "decoder-bigbird",
        "decoder-mixed-sdpa",
        "decoder-mixed-eager",
        "decoder-mixed-window-first",
        "seq2seq-mixed",
    ],
)
def test_generate_static_cache_compiled_fullgraph(arch, attn, backend, layers, report):
    """transformers' test_generate_compile_model_forward_fullgraph: two different inputs of the same
    shape, eager with a dynamic cache first, then a static cache whose decoding steps run compiled
    with fullgraph=True and dynamic=False; same tokens and scores, and no recompilation."""
    assert LM_CLASSES[arch]._can_compile_fullgraph
    torch._dynamo.reset()
    config = tiny_config(arch, position_embedding_type="rope", num_key_value_heads=2, **layers)
    model = build(LM_CLASSES[arch], config, attn=attn)
    ids, mask = padded_batch(batch=4, length=7, padding="none" if arch == "seq2seq" else "left")
    if arch == "seq2seq":
        mask[1, 5:] = 0
    inputs = [
        {"input_ids": ids[:2], "attention_mask": mask[:2]},
        {"input_ids": ids[2:], "attention_mask": mask[2:]},
    ]
    graphs = []  # one entry per compilation: the backend is called once per graph it compiles

    def counting_backend(graph, example_inputs, **options):  # options: CompileConfig's mode (CUDA graphs)
        graphs.append(graph)
        return torch._dynamo.lookup_backend(backend)(graph, example_inputs)

    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=counting_backend)
    compile_config._compile_all_devices = True  # compile on CPU too, as transformers' test forces it
    kw = dict(
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        compile_config=compile_config,
    )
    with torch.compiler.set_stance("force_eager"):
        dynamic = [model.generate(**x, **kw) for x in inputs]
    assert not hasattr(model, "_compiled_call")
    static = [model.generate(**x, cache_implementation="static", **kw) for x in inputs]
    assert hasattr(model, "_compiled_call")
    # 2 x 4 compiled decoding steps (the prefill runs eagerly), one graph
    assert len(graphs) == 1
    diff = 0.0
    for d, s in zip(dynamic, static):
        assert torch.equal(d.sequences, s.sequences)
        diff = max(diff, max(max_diff(a, b) for a, b in zip(d.scores, s.scores)))
    report("static compiled vs dynamic eager scores", diff)
    assert diff <= TOL


@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_compiled_forward_generates_with_a_dynamic_cache(arch, report):
    """A compiled forward (torch.compile(model.forward), the common recipe) with generate()'s dynamic
    cache: generate passes position_ids at every step, which a traced forward cannot tell from packed
    rows; the cache must still be extended (regression: the prefill marked it as packed)."""
    torch._dynamo.reset()
    config = tiny_config(arch, position_embedding_type="rope", num_key_value_heads=2)
    model = build(LM_CLASSES[arch], config, attn="sdpa")
    ids, mask = padded_batch(batch=2, length=7, padding="none" if arch == "seq2seq" else "left")
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    kw.update(return_dict_in_generate=True, output_scores=True)
    want = model.generate(ids, **kw)
    model.forward = torch.compile(model.forward, backend="aot_eager")
    got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    diff = max(max_diff(a, b) for a, b in zip(got.scores, want.scores))
    report("compiled forward, dynamic cache vs eager scores", diff)
    assert diff <= TOL


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn"])
def test_compile_fullgraph_with_rope_scaling(rope_type, report):
    """transformers' RoPE init functions run inside the graph (dynamic NTK reads the positions)."""
    rope = {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 4}
    model = model_for("decoder", "sdpa", max_position_embeddings=6, rope_parameters=rope)
    check_compiled(model, base_inputs("decoder", padded=True), report)


CPU_BACKENDS = [n for n, c in swapformer.BACKENDS.items() if "cpu" in c.devices]


@pytest.mark.parametrize("attn", CPU_BACKENDS)
def test_every_backend_is_held_to_its_compile_row(attn):
    """torch.export of a model with a windowed layer: exports (and matches eager) where the table's
    `compile` column lists the CPU, else fails naming the backend."""
    config = tiny_config("decoder", layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    model = build(swapformer.DecoderModel, config, attn=attn)
    kwargs = base_inputs("decoder", padded=True)
    with torch.no_grad():
        if "cpu" not in swapformer.BACKENDS[attn].compile:
            with pytest.raises(
                ValueError, match=f"attn_implementation='{attn}' cannot run inside torch.compile"
            ):
                torch.export.export(model, (), copy.deepcopy(kwargs), strict=False)
            return
        program = torch.export.export(model, (), copy.deepcopy(kwargs), strict=False)
        assert (
            max_diff(program.module()(**kwargs).last_hidden_state, model(**kwargs).last_hidden_state) <= TOL
        )
