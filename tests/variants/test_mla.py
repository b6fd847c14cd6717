"""Multi-head latent attention (DecoderConfig.kv_lora_rank, modeling/variants/mla.py): transformers' DeepseekV3
converts to it and back with the same logits and greedy tokens; the cache keeps latents only; the
absorbed decode equals the decompressed one step by step; backends agree or are refused by the table."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import swapformer
from swapformer.conversion import convert

from conftest import MLA_TINY, ROOT, build
from hf_models import save_source

V = 97


def deepseek_config(**kw):
    """A tiny DeepseekV3 with a dense MLP in every layer; widths all different, so a swapped one fails."""
    values = dict(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=48, first_k_dense_replace=2, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=5, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    return T.DeepseekV3Config(**{**values, **kw})


def mla_config(**kw):
    values = dict(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        **MLA_TINY, norm_type="rmsnorm", mlp_type="gated", hidden_act="silu",
        hidden_dropout=0.0, max_position_embeddings=256, pad_token_id=0,
    )  # fmt: skip
    return swapformer.DecoderConfig(**{**values, **kw})


def mla_model(attn="eager", **kw):
    return build(swapformer.DecoderForCausalLM, mla_config(**kw), attn)


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


CONVERSIONS = {
    "q-latent-interleaved": {},
    "q-direct-halves-bias": dict(q_lora_rank=None, rope_interleave=False, attention_bias=True),
    "yarn-mscale": dict(
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=16,
            mscale=1.0,
            mscale_all_dim=1.0,
            beta_fast=32,
            beta_slow=1,
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", CONVERSIONS, ids=list(CONVERSIONS))
def test_deepseek_v3_converts_and_back_with_the_same_logits_and_greedy_tokens(case, tmp_path, report):
    src = save_source(T.DeepseekV3ForCausalLM, deepseek_config(**CONVERSIONS[case]), tmp_path / "src")
    ours = convert(src, tmp_path / "ours", log=lambda line: None)
    assert ours.target_class == "DecoderForCausalLM" and ours.max_diff <= 1e-5
    hf = T.DeepseekV3ForCausalLM.from_pretrained(src).eval()
    model = T.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(model.model.layers[0].self_attn).__name__ == "LatentAttention"
    ids, mask = batch()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    diff = (got - want)[mask.bool()].abs().max().item()
    report(f"{case}: logits max abs diff", diff)
    assert diff <= 1e-5
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), hf.generate(ids, **kw))  # ours decodes absorbed

    back = convert(tmp_path / "ours", tmp_path / "back", to_hf=True, log=lambda line: None)
    assert back.target_class == "DeepseekV3ForCausalLM" and back.max_diff <= 1e-5
    original = hf.state_dict()
    returned = T.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    assert original.keys() == returned.keys()
    assert all(torch.equal(original[k], returned[k]) for k in original)


def test_mixture_of_experts_layers_are_refused(tmp_path):
    src = save_source(
        T.DeepseekV3ForCausalLM,
        deepseek_config(
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1
        ),
        tmp_path / "src",
    )
    with pytest.raises(Exception, match="first_k_dense_replace=1 < num_hidden_layers=2"):
        convert(src, tmp_path / "out", log=lambda line: None)


def decode(model, ids, mask, steps: int):
    """Prefill `ids`, then feed the greedy token `steps` times; the logits of every step and the cache."""
    cache = T.DynamicCache(config=model.config)
    out = model(ids, attention_mask=mask, cache=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        mask = torch.cat((mask, torch.ones_like(token)), dim=1)
        out = model(token, attention_mask=mask, cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1), cache


@torch.no_grad()
def test_absorbed_decode_equals_decompressed_per_step_and_the_cache_holds_latents_only(report):
    model = mla_model()
    ids, mask = batch()
    absorbed, cache = decode(model, ids, mask, steps=6)
    layer = cache.layers[0]
    assert layer.keys.shape == (2, 1, 11 + 6, 8) and layer.values.shape == (2, 1, 11 + 6, 4)  # R and P wide
    model.config.mla_decode = "decompressed"
    decompressed, _ = decode(model, ids, mask, steps=6)
    diff = (absorbed - decompressed).abs().max().item()
    report("absorbed vs decompressed decode, logits max abs diff", diff)
    assert diff <= 1e-5
    # and both equal the uncached forward over the whole sequence
    tokens = absorbed[:, :-1].argmax(-1)
    full_mask = torch.cat((mask, torch.ones_like(tokens)), dim=1)
    full = model(torch.cat((ids, tokens), dim=1), attention_mask=full_mask).logits[:, 10:]
    assert (full - absorbed).abs().max().item() <= 1e-5


@torch.no_grad()
def test_absorbed_path_returns_the_eager_attention_weights():
    model = mla_model()
    ids, mask = batch()
    cache = T.DynamicCache(config=model.config)
    model(ids[:, :-1], attention_mask=mask[:, :-1], cache=cache)
    step = model(ids[:, -1:], attention_mask=mask, cache=cache, output_attentions=True)
    full = model(ids, attention_mask=mask, output_attentions=True)
    for got, want in zip(step.attentions, full.attentions):
        torch.testing.assert_close(got[:, :, 0], want[:, :, -1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "sparse", "flex_attention"])
@torch.no_grad()
def test_backends_agree_with_eager_on_latent_attention(attn):
    ids, mask = batch()
    want = mla_model("eager")(ids, attention_mask=mask).logits
    got = mla_model(attn)(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=0)


@pytest.mark.parametrize("attn", ["flash_attention_2", "sdpa_fa"])
def test_backends_without_latent_attention_are_refused_by_the_table(attn):
    with pytest.raises(ValueError, match=f"{attn}.*latent_attention.*use one of 'eager', 'sdpa'"):
        mla_model(attn)  # the config's needs are checked before the device and the package


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(qk_rope_head_dim=None), "needs qk_rope_head_dim"),
        (dict(head_dim=8), "head_dim=8 != qk_rope_head_dim=4"),
        (dict(position_embedding_type="alibi"), "needs position_embedding_type='rope'"),
        (dict(layer_types=["sliding_attention"] * 2, sliding_window=4), "full_attention layers only"),
        (dict(mla_decode="fast"), "mla_decode='fast'"),
        (dict(kv_lora_rank=None), "q_lora_rank=12, qk_nope_head_dim=6.*set kv_lora_rank"),
    ],
)
def test_bad_latent_attention_configs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        mla_config(**kw)


def test_defaults_leave_ordinary_attention():
    cfg = swapformer.DecoderConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    assert cfg.kv_lora_rank is None and cfg.head_dim == 8 and cfg.effective_attention_scale == 8**-0.5
    model = swapformer.DecoderForCausalLM(cfg)
    assert type(model.model.layers[0].self_attn).__name__ == "Attention"


def test_mla_benchmark_smoke(capsys):
    """benchmarks/mla.py at a tiny size: the measured cache ratios are the ones the widths predict, and
    both decode modes give the same logits at every context."""
    import importlib.util

    path = ROOT / "benchmarks" / "mla.py"
    spec = importlib.util.spec_from_file_location("mla_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--hidden", "32", "--heads", "4", "--kv-lora-rank", "16", "--q-lora-rank", "24", "--vocab", "50"]
               + ["--contexts", "8", "24", "--prompt", "6", "--rounds", "1"])  # fmt: skip
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line[:4] in ("MHA ", "GQA ", "MLA ") and "decode" not in line
    }
    # per token and layer: MHA 2*4*8 = 64, GQA 2*2*8 = 32, MLA 16 + 4 = 20 numbers; 2 layers, 4 bytes
    assert rows["MHA"][1:4] == ["512", "3.20x", "3.20x"] and rows["MLA"][1] == "160"
    assert rows["GQA"][-3:] == ["256", "1.60x", "1.60x"]
    decode = [line.split() for line in out.splitlines() if line.strip().split(" ")[0] in ("8", "24")]
    assert len(decode) == 2 and all(float(row[-1]) <= 1e-5 for row in decode)


@torch.no_grad()
def test_static_and_int8_caches_hold_latents_and_generate_the_same_tokens():
    from swapformer.modeling.caches.int8_cache import Int8Cache

    model = mla_model("sdpa")
    ids, mask = batch()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    dynamic = model.generate(ids, **kw)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kw), dynamic)
    cache = Int8Cache(model.config)
    assert torch.equal(model.generate(ids, cache=cache, **kw), dynamic)
    assert cache.get_seq_length() == ids.shape[1] + 5


MLA_OPTIONS = dict(MLA_TINY, mlp_type="gated", hidden_act="silu")


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_tensor_parallel_plan_shards_the_up_projections_by_heads(q_lora_rank):
    import re

    from conftest import tiny_config

    config = tiny_config("decoder", **{**MLA_OPTIONS, "q_lora_rank": q_lora_rank})
    model = build(swapformer.DecoderForCausalLM, config)
    names = {name for name, _ in model.named_modules()}
    for rule in model.tp_plan:
        pattern = rule.replace(".", r"\.").replace("*", r"\d+")
        assert any(re.fullmatch(pattern, n) for n in names), f"tp rule {rule} matches no module"
    query = "q_proj" if q_lora_rank is None else "q_b_proj"
    attention = {k.split(".")[-1]: v for k, v in model.tp_plan.items() if "self_attn" in k}
    assert attention == {query: "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"}
    assert "base_model_tp_plan" not in config.to_dict()


@pytest.mark.slow
def test_tensor_parallel_two_processes_with_latent_attention(tmp_path, report):
    """tp_plan="auto" in 2 gloo processes: heads split over ranks, the latent whole on each; unsharded logits."""
    from conftest import tiny_config
    from parallel_worker import torchrun

    config = tiny_config("decoder", **MLA_OPTIONS)
    build(swapformer.DecoderForCausalLM, config).save_pretrained(tmp_path / "model")
    result = torchrun(2, "tp", "decoder", tmp_path / "model", out=tmp_path / "tp.json")
    report("tensor-parallel vs unsharded logits (MLA)", result["diff"])
    assert result["sharded"] >= 6 * config.num_hidden_layers  # q_b, kv_b, o, gate, up, down
    assert result["diff"] <= 1e-5


@pytest.mark.parametrize(
    "cls, target",
    [
        (T.DeepseekV3Model, "DecoderModel"),
        (T.DeepseekV3ForSequenceClassification, "DecoderForSequenceClassification"),
    ],
)
def test_deepseek_v3_base_model_and_classifier_convert_and_back(cls, target, tmp_path):
    src = save_source(cls, deepseek_config(num_labels=3), tmp_path / "src")
    ours = convert(src, tmp_path / "ours", log=lambda line: None)
    assert ours.target_class == target and ours.max_diff <= 1e-5
    back = convert(tmp_path / "ours", tmp_path / "back", to_hf=True, log=lambda line: None)
    assert back.target_class == cls.__name__ and back.max_diff <= 1e-5
    original, returned = (
        cls.from_pretrained(src).state_dict(),
        cls.from_pretrained(tmp_path / "back").state_dict(),
    )
    assert original.keys() == returned.keys() and all(torch.equal(original[k], returned[k]) for k in original)
