"""INT8: weights through transformers' quantization integrations (torchao on CPU, quanto, bitsandbytes
on CUDA) and the int8 KV cache (`modeling/caches/int8_cache.py`), each against the fp32 model or cache.

Tolerances. Absmax int8 rounding of a vector moves each element by at most half a step, the step
being max|x| / 127; for Gaussian vectors the rms error is 0.4% of the rms for 8 elements and 0.6% for
64-128 (computed). The int8 cache rounds only stored keys and values (head dim 8 here): measured
0.19-0.35% relative L2 on the logits; bound CACHE_RTOL = 1%. int8 weights with int8 activations round
both operands of every product (about 0.9% per product) in six projections per block, and the errors
add in quadrature over the blocks: about 2% expected, measured 1.2-2.5% (torchao) and 1.2-1.6%
(quanto, weights only) on these scrambled tiny models (weights of std 1/sqrt(fan_in), nothing damped);
bound WEIGHT_RTOL = 5%. Wrong bookkeeping (a token missing, duplicated or from another row) moves the
logits by tens of percent.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from swapformer.configuration.backends import BACKENDS
from swapformer.configuration.configuration_swapformer import LAYER_TYPES
from swapformer.modeling.caches.int8_cache import QMAX, Int8Cache, Int8Rows, int8_cache

from conftest import (
    LM_CLASSES,
    build,
    generate_steps,
    load_benchmark,
    padded_batch,
    pattern_config,
    tiny_config,
    uncached_step_logits,
)

DECODING = [n for n, c in BACKENDS.items() if c.kv_cache and "cpu" in c.devices and n != "flex_attention"]
CACHE_RTOL = 1e-2  # relative L2 of logits, int8 cache vs no cache (measured <= 0.35%)
WEIGHT_RTOL = 5e-2  # relative L2 of logits, int8 weights (+ activations) vs fp32 (measured <= 2.5%)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def windowed_lm(layer_type, attn="sdpa"):
    config = pattern_config(
        "decoder",
        layer_type,
        sliding_window=4,
        attention_block_size=4,
        num_random_blocks=3,
        num_key_value_heads=2,
    )
    return build(LM_CLASSES["decoder"], config, attn=attn)


# ---- the int8 rows --------------------------------------------------------------------------------


def test_int8_rows_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, generator=g)
    x[0, 0, 0] *= 100  # an outlier vector has its own scale
    x[1, 2, 3] = 0  # an all-zero vector stays zero
    rows = Int8Rows.quantize(x)
    assert rows.data.dtype == torch.int8 and rows.data.shape == x.shape and rows.scale.shape == (2, 3, 5, 1)
    assert int(rows.data.abs().max()) == QMAX
    error = (rows.dequantize(torch.float32) - x).abs()
    step = x.abs().amax(-1, keepdim=True) / QMAX
    assert bool((error <= step / 2 * (1 + 1e-5)).all())
    assert float(rows.dequantize(torch.float32)[1, 2, 3].abs().max()) == 0.0
    assert rows.nbytes == x.numel() + 4 * x[..., :1].numel()
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        Int8Rows.quantize(torch.ones(2, 3))


# ---- the int8 cache against transformers' fp32 cache ----------------------------------------------


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_int8_cache_keeps_what_the_fp32_cache_keeps(layer_type):
    """Step by step with the same tokens, every layer of an Int8Cache keeps as many tokens and reports
    the same mask sizes as the fp32 DynamicCache (transformers' window layer, swapformer's window +
    global layer), and the first layer's stored keys and values are the fp32 cache's within half an
    int8 step (its inputs are the same tokens; later layers see the earlier layers' rounding)."""
    model = windowed_lm(layer_type)
    ids, mask = padded_batch(batch=3, length=9, padding="left")
    fp32, int8 = DynamicCache(config=model.config), Int8Cache(model.config)
    steps = [ids] + [
        torch.randint(3, 90, (3, 1), generator=torch.Generator().manual_seed(i)) for i in range(12)
    ]
    seen = mask
    with torch.no_grad():
        for i, step in enumerate(steps):
            if i:
                seen = torch.cat([seen, torch.ones(3, 1, dtype=seen.dtype)], dim=1)
            model(step, attention_mask=seen, cache=fp32, use_cache=True)
            model(step, attention_mask=seen, cache=int8, use_cache=True)
            for a, b in zip(int8.layers, fp32.layers):
                assert isinstance(a, type(b)), (type(a), type(b))
                assert a._stored() == b.keys.shape[-2]
                assert a.get_mask_sizes(1) == b.get_mask_sizes(1)
                assert a.get_seq_length() == b.get_seq_length()
            for got, want in (
                (int8.layers[0].keys, fp32.layers[0].keys),
                (int8.layers[0].values, fp32.layers[0].values),
            ):
                step_size = want.abs().amax(-1, keepdim=True) / QMAX
                assert bool(((got - want).abs() <= step_size / 2 * (1 + 1e-4) + 1e-7).all())
    assert int8.layers[0]._qkeys.data.dtype == torch.int8
    fp32_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in fp32.layers)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert int8.nbytes * 4 * head_dim == fp32_bytes * (head_dim + 4)


def check_against_uncached(model, ids, mask, new_tokens, cache):
    """generate() with `cache` (greedy) against the logits of an uncached forward over each step's prefix."""
    out = generate_steps(model, ids, new_tokens, attention_mask=mask, output_logits=True, cache=cache)
    refs = [uncached_step_logits(model, ids, mask, out.sequences, step) for step in range(new_tokens)]
    # the prompt's forward reads nothing back from the cache: exactly the uncached logits
    assert (out.logits[0] - refs[0]).abs().max() <= 1e-5
    diffs = [rel(got, want) for got, want in zip(out.logits, refs)]
    assert max(diffs) <= CACHE_RTOL, diffs
    assert max(diffs[1:]) > 0  # the cached steps did read int8 keys back
    uncached = generate_steps(model, ids, new_tokens, attention_mask=mask, use_cache=False)
    assert torch.equal(out.sequences, uncached.sequences)
    return out


@pytest.mark.parametrize("attn", DECODING)
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_int8_cache_generation_follows_the_uncached_model(layer_type, attn):
    """Greedy tokens equal uncached generation; every step's logits within CACHE_RTOL of an uncached
    forward over the same prefix, on every backend that decodes on a CPU and every cache layer type."""
    model = windowed_lm(layer_type, attn)
    ids, mask = padded_batch(batch=3, length=9, padding="left")
    cache = Int8Cache(model.config)
    check_against_uncached(model, ids, mask, 12, cache)
    kept = {
        "full_attention": 20,
        "bigbird_attention": 20,
        "sliding_attention": 3,
        "sliding_global_attention": 9,
    }
    assert cache.layers[0]._stored() == kept[layer_type]


def test_int8_cache_in_encoder_decoder_generation():
    """int8_cache pairs int8 self-attention and cross-attention caches for an encoder-decoder model."""
    model = build(LM_CLASSES["seq2seq"], tiny_config("seq2seq"), attn="sdpa")
    ids, mask = padded_batch(batch=3, length=9, padding="right")
    cache = int8_cache(model.config)
    check_against_uncached(model, ids, mask, 8, cache)
    assert cache.cross_attention_cache.layers[0]._stored() == ids.shape[1]
    assert cache.self_attention_cache.layers[0]._qkeys.data.dtype == torch.int8


def test_int8_cache_beam_search_reorders_the_int8_rows():
    model = windowed_lm("full_attention")
    ids, mask = padded_batch(batch=2, length=7, padding="left")
    kw = dict(
        attention_mask=mask, max_new_tokens=6, min_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0
    )
    int8 = model.generate(ids, cache=Int8Cache(model.config), **kw)
    fp32 = model.generate(ids, **kw)
    assert torch.equal(int8, fp32)
    cache = Int8Cache(model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
    before = cache.layers[1].keys
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[1].keys, before.flip(0))
    cache.crop(-3)  # assisted decoding's rollback
    assert cache.get_seq_length() == ids.shape[1] - 3
    assert torch.equal(cache.layers[1].keys, before.flip(0)[..., :-3, :])


def test_int8_cache_refuses_a_layer_type_it_has_no_layer_for():
    config = copy.deepcopy(tiny_config("decoder"))
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(
        ValueError, match=r"layer 1, whose fp32 cache layer is LinearAttentionLayer.*DynamicCache"
    ):
        Int8Cache(config)


@pytest.mark.slow
def test_int8_cache_with_flex_attention():
    """flex_attention decodes on a CPU too (it compiles per step shape, hence slow)."""
    model = windowed_lm("sliding_attention", "flex_attention")
    ids, mask = padded_batch(batch=2, length=7, padding="none")
    check_against_uncached(model, ids, mask, 3, Int8Cache(model.config))


# ---- int8 weights through transformers' quantization integrations ---------------------------------

WEIGHT_ARCHS = {
    "decoder": "AutoModelForCausalLM",
    "encoder": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
}


def saved_fp32(arch, tmp_path):
    model = build(LM_CLASSES[arch], tiny_config(arch, hidden_size=64, intermediate_size=128), attn="sdpa")
    model.save_pretrained(tmp_path / "fp32")
    return model, tmp_path / "fp32"


def linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}


@pytest.mark.parametrize("arch", list(WEIGHT_ARCHS))
def test_torchao_int8_weights_load_run_generate_and_save(arch, tmp_path):
    """from_pretrained(quantization_config=TorchAoConfig(int8 dynamic activations, int8 weights)) on a
    CPU: every projection holds an int8 tensor, logits are within WEIGHT_RTOL of fp32 with the same
    top-1 token almost everywhere, generate() runs, and the saved int8 model loads back identical."""
    import transformers
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8Tensor
    from transformers import TorchAoConfig

    auto = getattr(transformers, WEIGHT_ARCHS[arch])
    fp32, folder = saved_fp32(arch, tmp_path)
    config = TorchAoConfig(Int8DynamicActivationInt8WeightConfig())
    model = auto.from_pretrained(folder, quantization_config=config, attn_implementation="sdpa")
    assert linears(model) and all(type(m.weight) is Int8Tensor for m in linears(model).values())
    assert all(m.weight.qdata.dtype == torch.int8 for m in linears(model).values())
    ids, mask = padded_batch(batch=3, length=12, padding="right" if arch != "decoder" else "left")
    kw = {"decoder_input_ids": ids[:, :6]} if arch == "seq2seq" else {}
    with torch.no_grad():
        want, got = fp32(ids, attention_mask=mask, **kw).logits, model(ids, attention_mask=mask, **kw).logits
    real = mask.bool() if arch != "seq2seq" else torch.ones(got.shape[:2], dtype=torch.bool)
    assert 0 < rel(got[real], want[real]) <= WEIGHT_RTOL
    assert (got.argmax(-1) == want.argmax(-1))[real].float().mean() >= 0.9
    if arch != "encoder":
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert out.shape[0] == 3
    model.save_pretrained(tmp_path / "int8")
    again = auto.from_pretrained(tmp_path / "int8")
    assert all(type(m.weight) is Int8Tensor for m in linears(again).values())
    with torch.no_grad():
        assert torch.equal(again(ids, attention_mask=mask, **kw).logits, got)


def test_quanto_int8_weights_run_but_transformers_does_not_save_them(tmp_path):
    """QuantoConfig(weights="int8") loads and runs (weight-only int8); transformers 5.24 refuses to
    save a quanto model ("not serializable")."""
    from optimum.quanto import QLinear
    from transformers import AutoModelForCausalLM, QuantoConfig

    fp32, folder = saved_fp32("decoder", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=QuantoConfig(weights="int8"))
    assert all(type(m) is QLinear for m in linears(model).values())
    ids, mask = padded_batch(batch=3, length=12, padding="left")
    with torch.no_grad():
        assert (
            0
            < rel(model(ids, attention_mask=mask).logits, fp32(ids, attention_mask=mask).logits)
            <= WEIGHT_RTOL
        )
    assert model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0).shape == (3, 16)
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes 8-bit needs CUDA")
def test_bitsandbytes_int8_weights_on_cuda(tmp_path):
    """BitsAndBytesConfig(load_in_8bit=True) on a GPU: LLM.int8() linears, logits near fp32, generate,
    and save / load of the 8-bit model."""
    bnb = pytest.importorskip("bitsandbytes", reason="the bitsandbytes package (pip install bitsandbytes)")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    fp32, folder = saved_fp32("decoder", tmp_path)
    fp32 = fp32.to("cuda")
    config = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map="cuda")
    assert all(isinstance(m, bnb.nn.Linear8bitLt) for m in linears(model).values())
    ids, mask = (t.to("cuda") for t in padded_batch(batch=3, length=12, padding="left"))
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        assert 0 < rel(got, fp32(ids, attention_mask=mask).logits) <= WEIGHT_RTOL
    assert model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0).shape == (3, 16)
    model.save_pretrained(tmp_path / "int8")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "int8", device_map="cuda")
    with torch.no_grad():
        assert rel(again(ids, attention_mask=mask).logits, got) <= 1e-3


# ---- benchmarks/int8.py at tiny size --------------------------------------------------------------


@pytest.mark.slow
def test_int8_benchmark_smoke(tmp_path, capsys):
    """benchmarks/int8.py on a 4-step `swapformer train` run: its fp32 perplexity is the run's own
    validation perplexity (it rebuilds the same batches), the fp32 cache token by token gives it too,
    and the table has every variant with the int8 cache about 4x smaller."""
    import json
    import random

    from swapformer.training.args import TrainArgs
    from swapformer.training.loop import train

    rng = random.Random(0)
    words = [f"w{i}" for i in range(200)]
    data = tmp_path / "texts"
    data.mkdir()
    for i in range(12):
        (data / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(800)))
    out = tmp_path / "run"
    model_options = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    args = TrainArgs(
        output_dir=str(out), data=[str(data)], no_progress=True, vocab_size=600, seq_len=32, batch_size=4,
        max_steps=4, warmup_steps=1, save_every=4, eval_every=4, val_fraction=0.2, set=model_options,
    )  # fmt: skip
    metrics = train(args)
    bench = load_benchmark("int8")
    rows = bench.run(out, bench.validation_batches(out), prompt_len=8, new=4, rounds=1, max_batches=None)
    fp32 = rows[0]
    assert fp32["ppl"] == pytest.approx(metrics["val_perplexity"], rel=1e-4)
    assert fp32["ppl_cached"] == pytest.approx(fp32["ppl"], rel=1e-4)
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    for r in rows[1:]:
        assert r["ppl"] == pytest.approx(fp32["ppl"], rel=0.05) and r["ppl"] != fp32["ppl"]
    by_name = {r["variant"]: r for r in rows}
    assert by_name["int8 cache"]["cache_kib"] / fp32["cache_kib"] == pytest.approx((8 + 4) / 32)  # head dim 8
    assert by_name["int8 weights"]["weights_mib"] < fp32["weights_mib"]
    assert by_name["int8 weights (quanto)"]["weights_mib"] < fp32["weights_mib"]
    bench.print_table(rows, 4, 8)
    table = capsys.readouterr().out
    assert all(f"| {name} |" in table for name in bench.VARIANTS)
    assert json.loads((out / "training_args.json").read_text())["max_steps"] == 4
