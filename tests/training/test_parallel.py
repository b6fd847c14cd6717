"""Model parallelism the transformers way (issue 10, item 13): `device_map="auto"` with CPU and disk
offload split at `_no_split_modules`, FSDP2 sharded per block over gloo, and the tensor/pipeline
plans naming swapformer's modules."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM
from transformers.integrations.tensor_parallel import replace_layer_number_by_wildcard, verify_tp_plan
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import swapformer
from swapformer.configuration.configuration_swapformer import per_head_tables

from conftest import ARCHS, LM_CLASSES, build, max_diff, padded_batch, tiny_config
from parallel_worker import torchrun

AUTO = {"encoder": AutoModelForMaskedLM, "decoder": AutoModelForCausalLM, "seq2seq": AutoModelForSeq2SeqLM}


def inputs_for(arch: str) -> dict:
    ids, mask = padded_batch(padding="left" if arch == "decoder" else "right")
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if arch == "seq2seq":
        kwargs.update(decoder_input_ids=ids[:, :5], decoder_attention_mask=torch.ones(3, 5, dtype=torch.long))
    return kwargs


@pytest.mark.parametrize("arch", ARCHS)
def test_device_map_auto_with_cpu_and_disk_offload(arch, tmp_path, report):
    """Too little memory for the model: accelerate keeps whole blocks (`_no_split_modules`) in memory and
    puts the rest on disk; the logits are the plain model's."""
    config = tiny_config(arch, position_embedding_type="rope", num_key_value_heads=2, hidden_size=64)
    model = build(LM_CLASSES[arch], config, attn="sdpa")
    model.save_pretrained(tmp_path / "model")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    offloaded = (
        AUTO[arch]
        .from_pretrained(
            tmp_path / "model",
            device_map="auto",
            max_memory={"cpu": int(0.7 * size)},  # not all the weights fit in memory
            offload_folder=tmp_path / "offload",
            attn_implementation="sdpa",
        )
        .eval()
    )
    # On a CPU-only machine accelerate keeps the embeddings in memory and the stack(s) of blocks on disk,
    # for Llama as for swapformer; a block is never split (`_no_split_modules`).
    placements = set(offloaded.hf_device_map.values())
    assert placements == {"cpu", "disk"}, offloaded.hf_device_map
    for name in offloaded.hf_device_map:
        assert not any(part in name for part in (".self_attn", ".mlp", "_proj", "_norm")), name
    assert any(p.device.type == "meta" for p in offloaded.parameters())  # really offloaded
    kwargs = inputs_for(arch)
    with torch.no_grad():
        want, got = model(**kwargs).logits, offloaded(**kwargs).logits
    report("offloaded vs plain logits", max_diff(got, want))
    assert max_diff(got, want) <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_parallel_plans_name_existing_modules(arch):
    """Every rule of the tensor-parallel and pipeline plans matches modules of the model, as Llama's do."""
    config = tiny_config(arch, mlp_type="gated", hidden_act="silu")
    model = build(LM_CLASSES[arch], config)
    names = {name for name, _ in model.named_modules()}
    assert model.supports_tp_plan
    for rule in model.tp_plan:
        pattern = rule.replace(".", r"\.").replace("*", r"\d+")
        assert any(re.fullmatch(pattern, n) for n in names), f"tp rule {rule} matches no module"
    for name in model.pp_plan:
        assert name in names, f"pp stage {name} is not a module"
    assert set(model._no_split_modules) == {"Block"}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_fsdp2_two_processes_train_like_one(arch, tmp_path, report):
    """FSDP2 (`fully_shard` on each `_no_split_modules` block, then the root) over gloo in 2 CPU processes:
    the same global batch gives the same losses, step by step, as 1 process."""
    one = torchrun(1, "fsdp", arch, out=tmp_path / "one.json")
    two = torchrun(2, "fsdp", arch, out=tmp_path / "two.json")
    diff = max(abs(a - b) for a, b in zip(one, two))
    report(f"losses {one} vs {two}; max diff", diff)
    assert len(one) == len(two) == 4 and one[0] != one[-1]
    assert diff <= 1e-5


def tp_cases() -> dict[str, tuple[str, dict]]:
    """Every shape the tensor-parallel plan takes (issue 26), by label: each architecture x a gated MLP or not x
    (the encoder-decoder's) shared or separate embeddings x the output projection tied to an input embedding
    or not."""
    cases = {}
    for arch, mlp, shared, tied in itertools.product(ARCHS, ("gated", "mlp"), (True, False), (True, False)):
        options = {"mlp_type": mlp, "tie_word_embeddings": tied}
        words = [arch, mlp]
        if arch == "seq2seq":  # only the encoder-decoder has two embeddings to share
            options["shared_embeddings"] = shared
            words.append("shared" if shared else "separate")
        elif not shared:
            continue
        cases["-".join([*words, "tied" if tied else "untied"])] = (arch, options)
    # self-attention with a table over all heads stays whole on every rank (per_head_tables)
    for arch, option in (
        ("decoder", {"position_embedding_type": "alibi"}),
        ("decoder", {"attention_sinks": True}),
        ("encoder", {"position_embedding_type": "relative_bias"}),
        ("seq2seq", {"position_embedding_type": "relative_bias"}),
    ):
        cases["-".join([arch, *map(str, option.values())]).replace("True", "sinks")] = (arch, option)
    return cases


TP_CASES = tp_cases()
# The dim of a weight (vocab, hidden) or (out, in) that each style splits over ranks.
WEIGHT_SHARD_DIM = {"embedding_rowwise": 0, "colwise": 0, "colwise_gather_output": 0, "rowwise": 1}


def tp_model(arch: str, options: dict):
    config = tiny_config(
        arch, **{"position_embedding_type": "rope", "num_key_value_heads": 2, "hidden_act": "silu", **options}
    )
    return build(LM_CLASSES[arch], config)


def planned_styles(model) -> dict[str, str | None]:
    """The style model.tp_plan gives each module (by its first name: an alias of `shared` is `shared`), matched
    as transformers expands the plan: the module's name with its layer numbers as `*`."""
    return {
        name: model.tp_plan.get(replace_layer_number_by_wildcard(name)) for name, _ in model.named_modules()
    }


def required_styles(model) -> dict[str, str]:
    """What must be sharded and how: each attention and MLP projection by heads or inner width (q, k, v, gate,
    up by columns, o and down by rows), the LM head by vocabulary gathering its output, and each token
    embedding by vocabulary rows, the head's layout, as transformers does for Llama."""
    head = model.get_output_embeddings()
    whole_self_attention = per_head_tables(model.config)
    required = {}
    for name, module in model.named_modules():
        if whole_self_attention and ".self_attn." in name:
            continue
        if isinstance(module, torch.nn.Linear) and re.search(r"\.(self_attn|cross_attn|mlp)\.", name):
            required[name] = "rowwise" if name.endswith(("o_proj", "down_proj")) else "colwise"
        elif module is head:
            required[name] = "colwise_gather_output"
        elif isinstance(module, torch.nn.Embedding) and name.endswith(("embed_tokens", "shared")):
            required[name] = "embedding_rowwise"
    return required


def logged(logger_name: str, fn) -> str:
    with CaptureLogger(hf_logging.get_logger(logger_name)) as captured:
        fn()
    return captured.out


@pytest.mark.parametrize("arch, options", TP_CASES.values(), ids=TP_CASES)
def test_tensor_parallel_plan_holds_exactly_the_modules_that_exist(arch, options):
    """transformers' own checks find no rule that matches nothing: `verify_tp_plan`, which from_pretrained runs
    on the state dict, and the `tp_plan` setter's check over modules and parameters. Every module that must be
    sharded is, and a weight tied to another is split along the same dim in both places."""
    model = tp_model(arch, options)
    plan = dict(model.tp_plan)
    out = logged(
        "transformers.distributed.tensor_parallel", lambda: verify_tp_plan(list(model.state_dict()), plan)
    )
    assert "rules were not applied" not in out, out
    out = logged("transformers.distributed.mixin", lambda: setattr(model, "tp_plan", plan))
    assert "match nothing" not in out, out
    styles = planned_styles(model)
    wrong = {
        name: (styles[name], style) for name, style in required_styles(model).items() if styles[name] != style
    }
    assert not wrong, f"(planned, required) styles differ: {wrong}"
    names = {id(module): name for name, module in reversed(list(model.named_modules()))}  # first names win
    for target, source in model.all_tied_weights_keys.items():
        modules = [names[id(model.get_submodule(key.rpartition(".")[0]))] for key in (target, source)]
        dims = [WEIGHT_SHARD_DIM.get(styles[name]) for name in modules]
        assert dims[0] == dims[1], f"tied {target} -> {source}: {modules} are split along dims {dims}"


@pytest.mark.slow
def test_tensor_parallel_two_processes_every_combination(tmp_path, report):
    """`from_pretrained(distributed_config=DistributedConfig(tp_plan="auto"))` in 2 gloo processes, one launch
    for all of TP_CASES: the plan shards what `required_styles` names, and the logits are those of the unsharded
    model loaded from the same weights."""
    required = {}
    for label, (arch, options) in TP_CASES.items():
        model = tp_model(arch, options)
        model.save_pretrained(tmp_path / "models" / label)
        required[label] = {f"{name}.weight" for name in required_styles(model)}
    results = torchrun(2, "tp_each", tmp_path / "models", out=tmp_path / "tp.json")
    assert set(results) == set(TP_CASES)
    for label, result in results.items():
        report(f"{label}: tensor-parallel vs unsharded logits", result["diff"])
    failed = {label: result["diff"] for label, result in results.items() if not result["diff"] <= 1e-5}
    assert not failed, f"logits differ from the unsharded model's by more than 1e-5: {failed}"
    whole = {
        label: sorted(required[label] - set(result["sharded_names"])) for label, result in results.items()
    }
    assert not any(whole.values()), f"left whole on every rank: {whole}"


LONGFORMER_LIKE = dict(
    layer_types=["sliding_global_attention"] * 2, sliding_window=2, global_tokens=1, global_projections=True
)


@pytest.mark.parametrize("arch", ["encoder", "seq2seq"])
def test_global_projections_are_in_the_tensor_parallel_plan(arch):
    """Longformer's own projections of global tokens are sharded by heads like q/k/v: every rule names modules
    of the model, the plan is per config (absent without the option) and is never saved."""
    config = tiny_config(arch, **LONGFORMER_LIKE)
    model = build(LM_CLASSES[arch], config)
    names = {name for name, _ in model.named_modules()}
    global_rules = [rule for rule in model.tp_plan if "_global_proj" in rule]
    assert len(global_rules) == 3, model.tp_plan
    for rule in global_rules:
        assert model.tp_plan[rule] == "colwise"
        pattern = rule.replace(".", r"\.").replace("*", r"\d+")
        assert any(re.fullmatch(pattern, n) for n in names), f"tp rule {rule} matches no module"
    assert "base_model_tp_plan" not in config.to_dict()
    plain = build(LM_CLASSES[arch], tiny_config(arch))
    assert not any("_global_proj" in rule for rule in plain.tp_plan)


@pytest.mark.slow
def test_tensor_parallel_shards_global_projections(tmp_path, report):
    """tp_plan="auto" in 2 processes shards q/k/v_global_proj too and keeps the unsharded logits."""
    config = tiny_config("encoder", **LONGFORMER_LIKE)
    build(LM_CLASSES["encoder"], config).save_pretrained(tmp_path / "model")
    result = torchrun(2, "tp", "encoder", tmp_path / "model", out=tmp_path / "tp.json")
    report("tensor-parallel vs unsharded logits (global projections)", result["diff"])
    assert result["sharded"] >= 7 * config.num_hidden_layers + 3 * config.num_hidden_layers
    assert result["diff"] <= 1e-5


def test_plans_are_on_the_configs():
    assert swapformer.DecoderConfig.base_model_tp_plan["layers.*.self_attn.q_proj"] == "colwise"
    assert swapformer.Seq2SeqConfig.base_model_tp_plan["decoder.layers.*.cross_attn.o_proj"] == "rowwise"
