"""Learned attention sinks (`attention_sinks=True`, modeling/variants/sinks.py).

The reference is transformers' own gpt-oss attention function
(`transformers.models.gpt_oss.modeling_gpt_oss.eager_attention_forward`, which reads `module.sinks`):
swapformer's eager equals it on the same tensors, outputs, weights and gradients. Every backend whose
row has sinks then equals eager in whole models, forward and backward (the sinks' gradients included),
on every pattern, with GQA, padding, the KV cache and recomputed attention maps. The backends whose row
lacks sinks are refused (tests/configuration/test_capabilities.py holds every row to the `sinks` column).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

import swapformer
from swapformer.configuration.backends import BACKENDS
from swapformer.configuration.configuration_swapformer import LAYER_TYPES
from swapformer.modeling.attention.functions import eager_attention_forward

from conftest import (
    ROOT,
    build,
    cached_step_diffs,
    generate_steps,
    max_diff,
    padded_batch,
    pattern_config,
    tiny_config,
)

SINK_BACKENDS = [n for n, c in BACKENDS.items() if c.sinks and "cpu" in c.devices and n != "eager"]


class Heads(torch.nn.Module):
    """What both attention functions read from their module."""

    def __init__(self, heads: int, kv_heads: int, sinks: torch.Tensor):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True
        self.sinks = torch.nn.Parameter(sinks)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_eager_equals_gpt_oss_attention(kv_heads):
    """Same q, k, v, additive mask (causal with left padding: batch row 1 has a fully masked query row)
    and sinks: swapformer's eager and gpt-oss's give the same output, weights and gradients."""
    g = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 4, 6, 8
    q = torch.randn(b, h, t, d, generator=g, requires_grad=True)
    k = torch.randn(b, kv_heads, t, d, generator=g, requires_grad=True)
    v = torch.randn(b, kv_heads, t, d, generator=g, requires_grad=True)
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None].repeat(b, 1, 1, 1)
    allowed[1, :, :, :2] = False  # two left-padding keys in row 1: its query 0 and 1 see nothing
    mask = torch.zeros(b, 1, t, t).masked_fill(~allowed, float("-inf"))
    probe = torch.randn(b, t, h, d, generator=g)
    results = []
    for fn in (eager_attention_forward, gpt_oss_eager):
        module = Heads(h, kv_heads, 2 * torch.randn(h, generator=torch.Generator().manual_seed(1)))
        out, weights = fn(module, q, k, v, mask, scaling=d**-0.5)
        (out * probe).sum().backward()
        results.append((out.detach(), weights.detach(), q.grad, k.grad, v.grad, module.sinks.grad))
        q.grad = k.grad = v.grad = None
    for ours, theirs in zip(*results, strict=True):
        assert max_diff(ours, theirs) <= 1e-5
    out, weights = results[0][:2]
    assert (out[1, :2] == 0).all()  # rows with no key give zeros, as without sinks
    assert (weights.sum(-1) < 1 - 1e-3).any()  # the sinks took part of the mass


def sink_config(arch, layer_type, **overrides):
    options = dict(
        position_embedding_type="learned",
        sliding_window=3,
        global_tokens=1,
        attention_block_size=4,
        attention_sinks=True,
    )
    return pattern_config(arch, layer_type, **(options | overrides))


def build_with_sinks(model_class, config, backend):
    """A model whose sinks are large enough (std 2) to matter, the same for every backend."""
    model = build(model_class, config, attn=backend)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.copy_(2 * torch.randn(p.shape, generator=g))
    return model


def forward_and_grads(model, arch):
    ids, mask = padded_batch(length=12, padding="left" if arch == "decoder" else "right")
    probe = torch.randn(3, 12, 32, generator=torch.Generator().manual_seed(1)) / 32
    model.train()
    out = model(ids, attention_mask=mask).last_hidden_state
    (out * probe).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("backend", SINK_BACKENDS)
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
@pytest.mark.parametrize("arch, kv_heads", [("decoder", 2), ("encoder", 4)])
def test_backend_equals_eager_forward_and_backward(backend, layer_type, arch, kv_heads):
    cls = {"decoder": swapformer.DecoderModel, "encoder": swapformer.EncoderModel}[arch]
    config = sink_config(arch, layer_type, num_key_value_heads=kv_heads)
    ref_out, ref_grads = forward_and_grads(build_with_sinks(cls, config, "eager"), arch)
    out, grads = forward_and_grads(build_with_sinks(cls, config, backend), arch)
    assert max_diff(out, ref_out) <= 1e-5
    assert set(grads) == set(ref_grads)
    assert "layers.0.self_attn.sinks" in grads and ref_grads["layers.0.self_attn.sinks"].abs().max() > 1e-4
    for name, grad in grads.items():
        assert max_diff(grad, ref_grads[name]) <= 1e-4, name
    # the sinks matter: the same model without them differs
    plain = build_with_sinks(
        cls, sink_config(arch, layer_type, num_key_value_heads=kv_heads, attention_sinks=False), "eager"
    )
    assert max_diff(forward_and_grads(plain, arch)[0], ref_out) > 1e-2


@pytest.mark.parametrize("backend", SINK_BACKENDS)
def test_unpadded_causal_batch_equals_eager(backend):
    """No padding: sdpa runs `is_causal` with no mask (the sink key goes first, behind a dummy query row)."""
    config = sink_config("decoder", "full_attention", num_key_value_heads=2)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    results = []
    for name in ("eager", backend):
        model = build_with_sinks(swapformer.DecoderModel, config, name).train()
        out = model(ids).last_hidden_state
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        results.append((out.detach(), *(p.grad for p in model.parameters())))
    for ours, theirs in zip(*results, strict=True):
        assert max_diff(ours, theirs) <= 1e-4


def test_sinks_parameter_as_gpt_oss_names_it():
    """`self_attn.sinks` (H,) in every self-attention layer, none in cross-attention; none without the option."""
    model = build(
        swapformer.Seq2SeqModel, tiny_config("seq2seq", attention_sinks=True, num_key_value_heads=2)
    )
    sinks = {n: p.shape for n, p in model.named_parameters() if n.endswith("sinks")}
    assert sinks == {
        f"{stack}.layers.{i}.self_attn.sinks": torch.Size([4])
        for stack in ("encoder", "decoder")
        for i in range(2)
    }
    plain = build(swapformer.Seq2SeqModel, tiny_config("seq2seq"))
    assert not [n for n, _ in plain.named_parameters() if "sinks" in n]


@pytest.mark.parametrize("backend", ["eager", *SINK_BACKENDS])
def test_cached_decoding_with_sinks(backend):
    """generate() with the cache gives the uncached forward's logits at every step."""
    config = sink_config("decoder", "sliding_global_attention", num_key_value_heads=2)
    model = build_with_sinks(swapformer.DecoderForCausalLM, config, backend)
    ids, mask = padded_batch(batch=2, length=7, padding="left")
    assert max(cached_step_diffs(model, ids, mask, 4)) <= 1e-5


@pytest.mark.parametrize("backend", SINK_BACKENDS)
def test_recomputed_attention_maps_include_the_sinks(backend):
    config = sink_config("encoder", "bigbird_attention")
    ids, mask = padded_batch(length=12)
    maps = []
    for name in ("eager", backend):
        model = build_with_sinks(swapformer.EncoderModel, config, name)
        with torch.no_grad():
            maps.append(torch.stack(model(ids, attention_mask=mask, output_attentions=True).attentions))
    assert max_diff(*maps) <= 1e-5
    assert maps[0][:, 0].sum(-1).max() < 1 - 1e-3  # rows of a real token lose mass to the sink


def test_config_refuses_a_non_bool():
    with pytest.raises(TypeError, match="attention_sinks must be True or False"):
        tiny_config("decoder", attention_sinks="yes")


@pytest.mark.parametrize("backend", [n for n, c in BACKENDS.items() if not c.sinks])
def test_backend_without_sinks_is_refused_with_the_reason(backend):
    config = sink_config("decoder", "full_attention")
    with pytest.raises(ValueError) as info:
        swapformer.DecoderModel._from_config(config, attn_implementation=backend)
    message = str(info.value)
    if BACKENDS[backend].needs and "needs the" in message:
        return  # refused earlier for its missing package (tests/configuration/test_capabilities.py)
    assert message.startswith(f"attn_implementation={backend!r} does not support learned attention sinks")
    assert BACKENDS[backend].no_sinks in message and "'sdpa'" in message


# Streaming sinks (StreamingLLM, https://arxiv.org/abs/2309.17453): a decoder whose layers are
# `sliding_global_attention` with global_tokens=k keeps the first k tokens plus the window in its cache
# (cache.py: GlobalWindowLayer), so generation runs past max_position_embeddings in bounded memory.
SINK_TOKENS, WINDOW = 3, 6


def streaming_config(**overrides):
    options = dict(
        layer_types=["sliding_global_attention"] * 2,
        sliding_window=WINDOW,
        global_tokens=SINK_TOKENS,
        position_embedding_type="rope",
        max_position_embeddings=16,
        num_key_value_heads=2,
    )
    return tiny_config("decoder", **(options | overrides))


@pytest.mark.parametrize("backend, learned", [("eager", False), ("sdpa", True), ("sparse", False)])
def test_streaming_generation_past_trained_length_equals_uncached_oracle(backend, learned):
    """Generate to 2.5x max_position_embeddings: the cache holds k + window - 1 keys per layer, every
    step's logits equal an uncached forward over the whole prefix (the same visible set, recomputed
    without a cache), and that forward's attention maps are non-zero exactly on the first k keys and the
    window (the visible set, checked from its definition)."""
    model = build_with_sinks(
        swapformer.DecoderForCausalLM, streaming_config(attention_sinks=learned), backend
    )
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    steps = 35
    assert max(cached_step_diffs(model, ids, torch.ones_like(ids), steps)) <= 1e-4
    out = model.generate(
        ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, return_dict_in_generate=True
    )
    total = out.sequences.shape[1]
    assert total > 2 * model.config.max_position_embeddings
    for layer in out.past_key_values.layers:
        assert layer.keys.shape[-2] == SINK_TOKENS + WINDOW - 1
    eager = build_with_sinks(
        swapformer.DecoderForCausalLM, streaming_config(attention_sinks=learned), "eager"
    )
    with torch.no_grad():
        maps = eager(out.sequences, output_attentions=True, use_cache=False).attentions
    q, k = torch.arange(total)[:, None], torch.arange(total)[None]
    visible = (k <= q) & ((k < SINK_TOKENS) | (q - k < WINDOW))
    for weights in maps:
        assert torch.equal(weights[0] != 0, visible.expand_as(weights[0]))


def test_streaming_benchmark_smoke(capsys):
    """benchmarks/sinks.py at a tiny size: the streaming cache stops growing once the sink tokens and the
    window are in it, the full cache grows with every token; the table prints every row. No timing."""
    import importlib.util
    import sys

    path = ROOT / "benchmarks" / "sinks.py"
    sys.path.insert(0, str(path.parent))  # the benchmarks import their shared measure.py
    spec = importlib.util.spec_from_file_location("sinks_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = "--tokens 80 --prompt 4 --window 8 --sink-tokens 2 --max-positions 32 --sinks --marks 16 40 80"
    rows = bench.main(argv.split())
    assert [r["tokens"] for r in rows] == [16, 40, 80]
    streaming = [r["streaming"]["cache_mib"] for r in rows]
    full = [r["full"]["cache_mib"] for r in rows]
    assert streaming[0] == streaming[1] == streaming[2]
    assert full[2] == pytest.approx(5 * full[0]) and full[0] > streaming[0]
    assert "| 80 |" in capsys.readouterr().out


def rotate(x: torch.Tensor, shift: int, theta: float = 10000.0) -> torch.Tensor:
    """x (..., D) rotated by `shift` positions of default RoPE (Llama's halves layout), from its definition."""
    d = x.shape[-1]
    angles = shift / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([angles.cos()] * 2).to(x.dtype), torch.cat([angles.sin()] * 2).to(x.dtype)
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * sin


def streaming_oracle_attention(module, query, key, value, mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention of one uncached sequence where query i sees the sink keys (the first
    SINK_TOKENS) at StreamingLLM's positions within the cache: moved up by the tokens a cache of the sink
    tokens + window would have dropped when i arrives, max(0, i - WINDOW + 1 - SINK_TOKENS)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    rows = []
    for i in range(query.shape[2]):
        keys = key.clone()
        keys[:, :, :SINK_TOKENS] = rotate(key[:, :, :SINK_TOKENS], max(0, i - WINDOW + 1 - SINK_TOKENS))
        scores = (query[:, :, i : i + 1] @ keys.transpose(-1, -2)) * scaling + mask[:, :, i : i + 1]
        if module.sinks is not None:
            scores = torch.cat([scores, module.sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
        probs = torch.softmax(scores, dim=-1)[..., : key.shape[2]]
        rows.append(probs @ value)
    return torch.cat(rows, dim=2).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("backend, learned", [("eager", False), ("sdpa", True), ("sparse", False)])
def test_streaming_positions_in_cache_equal_oracle(backend, learned, monkeypatch):
    """streaming_positions="cache": generate() past max_position_embeddings gives, at every step, the
    logits of an uncached forward whose attention (written here from the definition) shows each query
    the sink tokens at their positions within the cache; those differ from absolute positions."""
    config = streaming_config(attention_sinks=learned, streaming_positions="cache")
    model = build_with_sinks(swapformer.DecoderForCausalLM, config, backend)
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    steps = 30
    out = generate_steps(model, ids, steps, output_logits=True)
    oracle = build_with_sinks(swapformer.DecoderForCausalLM, config, "eager")
    plain = build_with_sinks(
        swapformer.DecoderForCausalLM, streaming_config(attention_sinks=learned), "eager"
    )
    with torch.no_grad():
        absolute = plain(out.sequences, use_cache=False).logits
        monkeypatch.setattr(
            "swapformer.modeling.core.plan.eager_attention_forward", streaming_oracle_attention
        )
        expected = oracle(out.sequences, use_cache=False).logits
    got = torch.stack(out.logits, dim=1)  # (1, steps, V): step s predicts token 5 + s
    assert max_diff(got, expected[:, 4 : 4 + steps]) <= 1e-4
    assert max_diff(got, absolute[:, 4 : 4 + steps]) > 1e-3  # the positions matter


def test_streaming_positions_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="streaming_positions='cache'.*position_embedding_type='rope'"):
        streaming_config(streaming_positions="cache", position_embedding_type="alibi")
    with pytest.raises(ValueError, match="streaming_positions='cache'.*'sliding_global_attention' layers"):
        streaming_config(streaming_positions="cache", layer_types=["sliding_attention"] * 2)
    with pytest.raises(ValueError, match="streaming_positions='cache'.*a decoder"):
        tiny_config(
            "encoder",
            streaming_positions="cache",
            position_embedding_type="rope",
            layer_types=["sliding_global_attention"] * 2,
            sliding_window=4,
            global_tokens=1,
        )
    with pytest.raises(ValueError, match="streaming_positions"):
        streaming_config(streaming_positions="window")


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_sinks_compile_fullgraph(backend):
    """A model with learned sinks runs inside torch.compile(fullgraph=True) and gives its eager result."""
    config = sink_config(
        "decoder", "sliding_global_attention", num_key_value_heads=2, position_embedding_type="rope"
    )
    model = build_with_sinks(swapformer.DecoderModel, config, backend)
    ids, mask = padded_batch(length=12, padding="left")
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).last_hidden_state
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(
            ids, attention_mask=mask
        ).last_hidden_state
    torch._dynamo.reset()
    assert max_diff(got, expected) <= 1e-5
