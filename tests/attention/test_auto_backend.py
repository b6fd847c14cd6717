"""attn_implementation="auto" (issue 30): per layer type, the fastest backend the capability table accepts
for the forward at hand, measured on this machine once per situation and cached on disk.

Every test points the cache at its tmp_path (`conftest.auto_cache_dir`): nothing is written to the user's home."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import swapformer
from swapformer.configuration.backends import BACKENDS, check_backend_for_config, check_backend_for_forward
from swapformer.modeling.attention import auto_backend, auto_cache

from conftest import MLA_TINY, ROOT, build, padded_batch, pattern_config, run_python, tiny_config

KINDS = ("full_attention", "sliding_attention", "sliding_global_attention", "bigbird_attention")
ARCH_CLASSES = {"encoder": swapformer.EncoderModel, "decoder": swapformer.DecoderForCausalLM}


def outputs(model, ids, mask):
    out = model(ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


class TestEntryPoints:
    def test_config_from_config_and_set(self, auto_cache_dir):
        config = swapformer.DecoderConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            attn_implementation="auto",
        )
        assert config._attn_implementation == "auto"
        model = AutoModelForCausalLM.from_config(config)
        assert model.config._attn_implementation == "auto"
        model.set_attn_implementation("eager")
        model.set_attn_implementation("auto")
        assert model.config._attn_implementation == "auto"

    def test_inside_a_mapping(self, auto_cache_dir):
        config = pattern_config("encoder", "sliding_attention")
        model = AutoModel.from_config(
            config, attn_implementation={"full_attention": "auto", "sliding_attention": "sdpa"}
        )
        assert model.config.backend_for("full_attention") == "auto"
        ids, mask = padded_batch()
        with torch.no_grad():
            model.eval()(ids, attention_mask=mask)
        plan = model.attention_plan()
        assert plan.row("sliding_attention").requested == "sdpa"
        assert plan.row("full_attention").choices, str(plan)

    def test_saved_folder_keeps_auto(self, auto_cache_dir, tmp_path):
        model = AutoModelForCausalLM.from_config(
            pattern_config("decoder", "sliding_attention"), attn_implementation="auto"
        )
        model.save_pretrained(tmp_path / "saved")
        assert json.loads((tmp_path / "saved" / "config.json").read_text())["attn_implementation"] == "auto"
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
        assert again.config._attn_implementation == "auto"
        other = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="sdpa")
        assert other.config._attn_implementation == "sdpa"
        eager = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager")
        eager.save_pretrained(tmp_path / "eager")
        assert "attn_implementation" not in json.loads((tmp_path / "eager" / "config.json").read_text())

    def test_from_pretrained_with_auto(self, auto_cache_dir, tmp_path):
        build(swapformer.EncoderModel, pattern_config("encoder", "bigbird_attention")).save_pretrained(
            tmp_path
        )
        model = AutoModel.from_pretrained(tmp_path, attn_implementation="auto")
        assert model.config._attn_implementation == "auto"


@pytest.mark.parametrize("arch", ARCH_CLASSES)
@pytest.mark.parametrize("layer_type", KINDS)
def test_auto_equals_eager_inference_and_training(arch, layer_type, auto_cache_dir):
    config = pattern_config(arch, layer_type)
    auto, eager = (build(ARCH_CLASSES[arch], config, attn=a) for a in ("auto", "eager"))
    ids, mask = padded_batch(length=20, padding="right" if arch == "encoder" else "left")
    with torch.no_grad():
        torch.testing.assert_close(outputs(auto, ids, mask), outputs(eager, ids, mask))
    grads = []
    for model in (auto, eager):
        model.train()
        outputs(model, ids, mask).float().pow(2).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)
    plan = auto.attention_plan()
    situations = {
        c.situation["step"] + ("+grad" if c.situation["grad"] else "") for c in plan.row(layer_type).choices
    }
    assert situations == {"prefill", "prefill+grad"}, str(plan)


@pytest.mark.parametrize("layer_type", KINDS)
def test_cached_decoding_equals_eager(layer_type, auto_cache_dir):
    config = pattern_config("decoder", layer_type)
    auto, eager = (build(swapformer.DecoderForCausalLM, config, attn=a) for a in ("auto", "eager"))
    ids, mask = padded_batch(length=12, padding="left")
    runs = [
        m.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        for m in (auto, eager)
    ]
    for got, want in zip(runs[0].logits, runs[1].logits, strict=True):
        torch.testing.assert_close(got, want)
    steps = {c.situation["step"] for c in auto.attention_plan().row(layer_type).choices}
    assert steps == {"prefill", "decode"}


VARIANTS = {
    "seq2seq bigbird": (
        swapformer.Seq2SeqForConditionalGeneration,
        lambda: pattern_config("seq2seq", "bigbird_attention"),
    ),
    "latent attention": (swapformer.DecoderForCausalLM, lambda: tiny_config("decoder", **MLA_TINY)),
    "linformer": (swapformer.EncoderModel, lambda: tiny_config("encoder", linformer_k=8)),
    "sinks, gqa, alibi": (
        swapformer.DecoderForCausalLM,
        lambda: pattern_config(
            "decoder",
            "sliding_global_attention",
            attention_sinks=True,
            num_key_value_heads=2,
            position_embedding_type="alibi",
        ),
    ),  # fmt: skip
    "t5 bias, global projections": (
        swapformer.EncoderModel,
        lambda: pattern_config(
            "encoder",
            "sliding_global_attention",
            position_embedding_type="relative_bias",
            global_projections=True,
        ),
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_twin_measures_every_variant_and_auto_equals_eager(variant, auto_cache_dir):
    """The one-layer twin is built from the stack's own class and config: seq2seq halves, MLA, Linformer,
    sinks, biases and global projections are measured as they run."""
    model_class, make_config = VARIANTS[variant]
    auto, eager = (build(model_class, make_config(), attn=a) for a in ("auto", "eager"))
    ids, mask = padded_batch(
        length=20, padding="left" if model_class is swapformer.DecoderForCausalLM else "right"
    )
    extra = (
        {"decoder_input_ids": ids[:, :7]} if model_class is swapformer.Seq2SeqForConditionalGeneration else {}
    )
    with torch.no_grad():
        got, want = (m(ids, attention_mask=mask, **extra) for m in (auto, eager))
    key = "logits" if hasattr(want, "logits") else "last_hidden_state"
    torch.testing.assert_close(getattr(got, key), getattr(want, key))
    assert all(r.choices and r.choices[0].how == "measured now" for r in auto.attention_plan().rows), str(
        auto.attention_plan()
    )


def test_choice_is_measured_once_and_shown(auto_cache_dir, monkeypatch):
    model = build(swapformer.EncoderModel, pattern_config("encoder", "sliding_global_attention"), attn="auto")
    ids, mask = padded_batch(length=20)
    with torch.no_grad():
        model(ids, attention_mask=mask)
        monkeypatch.setattr(auto_backend, "measure_candidates", _refuse_measuring)
        model(ids, attention_mask=mask)  # the same situation: a dict lookup, no measurement
    choice = model.attention_plan().row("sliding_global_attention").choices[0]
    assert choice.backend in choice.times_ms, choice
    assert choice.times_ms[choice.backend] == min(choice.times_ms.values())
    assert "measured" in str(model.attention_plan())
    saved = json.loads(auto_cache.cache_file().read_text())
    assert [e["choice"] for e in saved["entries"].values()].count(choice.backend) >= 1


def _refuse_measuring(*args, **kwargs):
    raise AssertionError("measured although the choice was known")


SECOND_PROCESS = """
import json, torch, swapformer
from swapformer.modeling.attention import auto_backend
config = swapformer.EncoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    layer_types=["sliding_attention", "full_attention"], sliding_window=5, attention_block_size=8)
model = swapformer.EncoderModel._from_config(config, attn_implementation="auto").eval()
with torch.no_grad():
    model(torch.randint(3, 60, (1, 40)))
rows = {r.layer_type: [c.backend for c in r.choices] for r in model.attention_plan().rows}
print("AUTO", json.dumps({"measured": len(auto_backend.measured_here), "rows": rows}))
"""


def test_a_second_process_reuses_the_cache(auto_cache_dir):
    env = {**os.environ, "SWAPFORMER_CACHE_DIR": str(auto_cache_dir), "OMP_NUM_THREADS": "1"}
    env.pop("SWAPFORMER_AUTO", None)
    first = run_python(SECOND_PROCESS, env=env, tag="AUTO", cwd=ROOT)
    second = run_python(SECOND_PROCESS, env=env, tag="AUTO", cwd=ROOT)
    assert first["measured"] == 2  # one situation per layer type
    assert second["measured"] == 0
    assert second["rows"] == first["rows"]


def test_two_processes_started_together_measure_each_situation_once(auto_cache_dir):
    """Two ranks of one machine: between them each situation is measured once, and they choose alike."""
    env = {**os.environ, "SWAPFORMER_CACHE_DIR": str(auto_cache_dir), "OMP_NUM_THREADS": "1"}
    env.pop("SWAPFORMER_AUTO", None)
    with ThreadPoolExecutor(2) as pool:
        ranks = list(pool.map(lambda _: run_python(SECOND_PROCESS, env=env, tag="AUTO", cwd=ROOT), range(2)))
    assert sum(r["measured"] for r in ranks) == 2, ranks  # one situation per layer type
    assert ranks[0]["rows"] == ranks[1]["rows"]


def test_gpus_of_one_model_share_a_situation(monkeypatch):
    monkeypatch.setattr(auto_backend, "_cuda_name", lambda index: "NVIDIA H100 80GB HBM3")
    assert auto_backend._machine(torch.device("cuda", 0)) == auto_backend._machine(torch.device("cuda", 3))


def test_a_score_matrix_backend_is_not_run_where_its_scores_would_take_gigabytes():
    """eager at 8k keys would hold 12 x 8192^2 scores (3 GiB, 9 in training) while measuring: auto drops it
    unrun there; below the bound, and where it is the last candidate left, it runs."""
    from swapformer.modeling.attention import auto_measure

    ran = []

    def run(name):
        return lambda warm_up=False: ran.append((name, warm_up))

    def situation(bucket, grad):
        return {"bucket": bucket, "grad": grad, "heads": 12, "dtype": "float32", "step": "prefill"}

    for bucket, grad, measured in [
        (4096, False, True),
        (8192, False, False),
        (2048, True, True),
        (4096, True, False),
    ]:
        ran.clear()
        times, dropped = auto_measure._first_runs(
            {"sdpa": run("sdpa"), "eager": run("eager")}, situation(bucket, grad), torch.device("cpu")
        )
        assert ("eager" in times or "eager" in dropped and "first run" in dropped["eager"]) == measured
        assert (("eager", False) in ran) == measured, (bucket, grad, ran)
        if not measured:
            assert dropped["eager"].startswith("not measured: its scores of 12 heads x"), dropped
    ran.clear()
    times, dropped = auto_measure._first_runs(
        {"eager": run("eager")}, situation(8192, True), torch.device("cpu")
    )
    assert "eager" in times and not dropped


def _measured_sliding_encoder():
    """An encoder on auto with sliding and full layers after one forward of 20 tokens: (model, ids, the cache
    file, its JSON as measured)."""
    model = build(swapformer.EncoderModel, pattern_config("encoder", "sliding_attention"), attn="auto")
    ids, _ = padded_batch(batch=1, length=20, padding="none")
    with torch.no_grad():
        model(ids)
    path = auto_cache.cache_file()
    return model, ids, path, json.loads(path.read_text())


def test_a_process_waits_while_another_measures_and_takes_its_choice(auto_cache_dir, monkeypatch):
    """The ranks of a multi-process run meet a situation together: one measures under the machine's lock, the
    others wait and read its entry instead of measuring (so they agree). Here this test plays the process that
    measures: it holds the lock until a thread on the model has looked in the cache and found nothing, then
    writes the entries and lets go; the thread must take them without measuring."""
    model, ids, path, measured = _measured_sliding_encoder()
    for entry in measured["entries"].values():  # a choice this process would not make by itself
        entry["choice"] = next(b for b in [*entry["times_ms"], *entry["dropped"]] if b != entry["choice"])
    path.unlink()
    auto_backend.forget()
    monkeypatch.setattr(auto_backend, "measure_candidates", _refuse_measuring)
    looked, failures = threading.Event(), []
    real_lookup = auto_backend.lookup
    monkeypatch.setattr(auto_backend, "lookup", lambda key: looked.set() or real_lookup(key))

    def other_rank():
        try:
            with torch.no_grad():
                model(ids)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            failures.append(e)

    with auto_cache.measuring_lock():
        thread = threading.Thread(target=other_rank)
        thread.start()
        assert looked.wait(timeout=60)  # it found nothing
        time.sleep(0.5)  # time to read the file again and measure, were it not waiting for the lock
        path.write_text(json.dumps(measured))
    thread.join(timeout=60)
    assert not thread.is_alive() and not failures, failures
    chosen = {c.backend for row in model.attention_plan().rows for c in row.choices}
    assert chosen == {e["choice"] for e in measured["entries"].values()}


def test_an_entry_of_another_torch_version_is_ignored(auto_cache_dir, monkeypatch):
    model, ids, path, saved = _measured_sliding_encoder()
    for entry in saved["entries"].values():
        entry["torch"] = "1.0.0"
        entry["choice"] = "eager"
    path.write_text(json.dumps(saved))
    auto_backend.forget()
    measured = []
    real = auto_backend.measure_candidates
    monkeypatch.setattr(
        auto_backend, "measure_candidates", lambda *a, **k: measured.append(a) or real(*a, **k)
    )
    with torch.no_grad():
        model(ids)
    assert len(measured) == 2
    again = json.loads(path.read_text())["entries"]
    assert {e["torch"] for e in again.values()} == {torch.__version__}


def test_static_measures_nothing(auto_cache_dir, monkeypatch):
    monkeypatch.setenv("SWAPFORMER_AUTO", "static")
    monkeypatch.setattr(auto_backend, "measure_candidates", _refuse_measuring)
    config = pattern_config("encoder", "sliding_global_attention")
    model = build(swapformer.EncoderModel, config, attn="auto")
    eager = build(swapformer.EncoderModel, config, attn="eager")
    ids, mask = padded_batch(length=20)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, attention_mask=mask).last_hidden_state,
            eager(ids, attention_mask=mask).last_hidden_state,
        )
    plan = model.attention_plan()
    assert plan.row("sliding_global_attention").choices[0].backend == "sparse"
    assert plan.row("full_attention").choices[0].backend == "sdpa"
    assert "static order" in str(plan)
    assert not auto_cache.cache_file().exists()


def test_a_wrong_switch_value_is_refused_where_auto_is_chosen(auto_cache_dir, monkeypatch):
    monkeypatch.setenv("SWAPFORMER_AUTO", "fastest")
    with pytest.raises(ValueError, match=r"SWAPFORMER_AUTO='fastest'.*'measure'.*'static'"):
        build(swapformer.EncoderModel, pattern_config("encoder", "sliding_attention"), attn="auto")


SITUATIONS = [
    dict(kind=kind, grad=grad, padded=padded, packed=packed)
    for kind in ("full", "sliding", "sliding_global", "bigbird")
    for grad in (False, True)
    for padded in (False, True)
    for packed in (False, True)
]


@pytest.mark.parametrize("case", SITUATIONS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_candidates_are_what_the_table_accepts(case):
    layer_type = {v: k for k, v in auto_backend.LAYER_TYPE_PATTERN.items()}[case["kind"]]
    config = pattern_config("decoder", layer_type)
    found = auto_backend.candidates(
        config,
        case["kind"],
        "cpu",
        torch.float32,
        grad=case["grad"],
        padded=case["padded"],
        packed=case["packed"],
        custom=False,
        compiling=False,
    )
    assert "eager" in found
    assert "flash_attention_2" not in found and "sdpa_fa" not in found  # CUDA only
    if case["grad"]:
        assert "flex_attention" not in found  # no backward on CPU
    if case["kind"] == "full":
        assert "sparse" not in found  # its full layers run as sdpa: the same kernel, measured once
    for backend in found:
        check_backend_for_config(backend, config, {"cpu"})
        check_backend_for_forward(
            backend,
            case["kind"],
            config,
            "cpu",
            training=case["grad"],
            needs_grad=case["grad"],
            compiling=False,
        )
        caps = BACKENDS[backend]
        assert (caps.padding or not case["padded"]) and (caps.packing or not case["packed"])


@pytest.mark.slow  # torch.compile
def test_a_compiled_model_takes_the_static_order_and_measures_nothing(auto_cache_dir, monkeypatch):
    """Inside torch.compile(fullgraph=True) auto reads only constants: the static order among the backends
    that compile, nothing measured or read from disk while tracing."""
    monkeypatch.setattr(auto_backend, "measure_candidates", _refuse_measuring)
    config = pattern_config("decoder", "sliding_attention")
    auto, eager = (build(swapformer.DecoderModel, config, attn=a) for a in ("auto", "eager"))
    ids = torch.randint(3, 60, (1, 12))
    with torch.no_grad():
        got = torch.compile(auto, fullgraph=True)(ids).last_hidden_state
        torch.testing.assert_close(got, eager(ids).last_hidden_state)
    assert not auto_cache.cache_file().exists()
