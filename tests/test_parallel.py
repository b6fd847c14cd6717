"""Model parallelism the transformers way (issue 10, item 13): `device_map="auto"` with CPU and disk
offload split at `_no_split_modules`, FSDP2 sharded per block over gloo, and the tensor/pipeline
plans naming swapformer's modules."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

import swapformer

from conftest import ARCHS, LM_CLASSES, build, max_diff, padded_batch, tiny_config

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


WORKER = Path(__file__).with_name("parallel_worker.py")


def torchrun(world_size: int, *args, out: Path):
    """Run tests/parallel_worker.py in `world_size` processes; what rank 0 wrote to `out`. A launch that
    dies without writing (a gloo abort, "terminate called without an active exception", seen in 1 of a few
    dozen launches here, twice in a row once) is tried again on a fresh port, up to 4 launches; the numbers
    themselves are never retried."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    failures = []
    for _ in range(4):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={world_size}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{_free_port()}",
            str(WORKER),
            *map(str, args),
            str(out),
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode == 0:
            return json.loads(out.read_text())
        failures.append(done.stderr[-6000:])
    raise AssertionError("\n---\n".join(failures))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


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


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_two_processes(arch, tmp_path, report):
    """`from_pretrained(distributed_config=DistributedConfig(tp_plan="auto"))` in 2 processes shards the attention and MLP projections by the
    plans (heads split over ranks) and gives the unsharded logits; tied output embeddings included."""
    config = tiny_config(
        arch, position_embedding_type="rope", num_key_value_heads=2, mlp_type="gated", hidden_act="silu"
    )
    build(LM_CLASSES[arch], config).save_pretrained(tmp_path / "model")
    result = torchrun(2, "tp", arch, tmp_path / "model", out=tmp_path / "tp.json")
    report("tensor-parallel vs unsharded logits", result["diff"])
    layers = config.num_hidden_layers + (config.decoder_layers if arch == "seq2seq" else 0)
    assert result["sharded"] >= 7 * layers  # q, k, v, o, gate, up, down of every block (and their biases)
    assert result["diff"] <= 1e-5


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
