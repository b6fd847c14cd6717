"""One process of tests/training/test_parallel.py's distributed runs (started by torchrun, gloo on CPU).

    python -m torch.distributed.run --nproc_per_node=N tests/parallel_worker.py fsdp ARCH OUT.json
    python -m torch.distributed.run --nproc_per_node=N tests/parallel_worker.py tp ARCH FOLDER OUT.json
    python -m torch.distributed.run --nproc_per_node=N tests/parallel_worker.py tp_each ROOT OUT.json
    python -m torch.distributed.run --nproc_per_node=N tests/parallel_worker.py train_seen DATA RUN STEPS CHARS OUT.json
    python -m torch.distributed.run --nproc_per_node=N tests/parallel_worker.py train_seen_streaming DATA RUN STEPS CHARS ACCUM OUT.json

fsdp: `fully_shard` on every block named by `_no_split_modules`, then on the root; a few SGD steps on a
fixed global batch split over the processes; rank 0 writes the global loss of each step.
tp: `from_pretrained(FOLDER, distributed_config=DistributedConfig(tp_plan="auto"))` (the model's plan); rank 0 writes the
logits' max difference from the unsharded model and how many weights were sharded.
tp_each: tp for every model folder ARCH-... under ROOT in one launch (starting processes is the slow part);
rank 0 writes {folder name: tp's result plus the names of the sharded parameters, aliases included}.
train_seen: `swapformer train`'s `train()` on the tiny run (tests/training_runs.py) with --data DATA into RUN for
STEPS steps on CHARS characters of training text; rank 0 writes, for each rank, the token rows each training forward of that rank read.
train_seen_streaming: the same with --streaming and ACCUM micro-batches a step (tests/training/test_streaming_parallel.py).

The tests start it with `torchrun` below (tests/training/test_parallel.py, tests/variants/test_mla.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from conftest import LM_CLASSES, build, padded_batch, tiny_config
from training_runs import free_port

GLOBAL_BATCH, STEPS = 4, 4
WORKER = Path(__file__).resolve()  # this file, which torchrun starts in each process


def torchrun(world_size: int, *args, out: Path):
    """Run this file in `world_size` processes; what rank 0 wrote to `out`. A launch that
    dies without writing (a gloo abort, "terminate called without an active exception", seen in 1 of a few
    dozen launches here, twice in a row once) is tried again on a fresh port, up to 4 launches; the numbers
    themselves are never retried."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent)}
    failures = []
    for _ in range(4):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={world_size}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{free_port()}",
            str(WORKER),
            *map(str, args),
            str(out),
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode == 0:
            return json.loads(out.read_text())
        failures.append(done.stderr[-6000:])
    raise AssertionError("\n---\n".join(failures))


def global_batch(arch: str) -> dict:
    ids, mask = padded_batch(batch=GLOBAL_BATCH, length=8, padding="right", seed=1)
    labels = ids.masked_fill(mask == 0, -100)
    if arch == "encoder":  # masked LM: predict every third real token
        labels = labels.masked_fill(torch.arange(8) % 3 != 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if arch == "seq2seq":
        batch["decoder_input_ids"] = torch.roll(ids, 1, dims=1)
    return batch


def summed_loss(arch: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if arch == "decoder":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def write(out: str, result) -> None:
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def train_fsdp(arch: str, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    config = tiny_config(arch, position_embedding_type="rope", num_key_value_heads=2)
    model = build(LM_CLASSES[arch], config, attn="sdpa").train()  # same seed: same weights on every rank
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = global_batch(arch)
    labels = batch.pop("labels")
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    counted = labels[:, 1:] if arch == "decoder" else labels
    n_global = int((counted != -100).sum())  # labelled tokens of the whole global batch
    losses = []
    for _ in range(STEPS):
        local = {k: v[rows] for k, v in batch.items()}
        total = summed_loss(arch, model(**local).logits, labels[rows])
        # FSDP2 averages gradients over ranks: scale so that they add up to the global batch's gradient
        (total * world / n_global).backward()
        optimizer.step()
        optimizer.zero_grad()
        total = total.detach()
        dist.all_reduce(total)
        losses.append(float(total) / n_global)
    write(out, losses)


def sharded_and_unsharded(arch: str, folder) -> dict:
    """Logits of the model in `folder` loaded with tp_plan="auto" against the same weights loaded whole."""
    from torch.distributed.tensor import DTensor
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSeq2SeqLM,
        DistributedConfig,
    )

    auto = {
        "encoder": AutoModelForMaskedLM,
        "decoder": AutoModelForCausalLM,
        "seq2seq": AutoModelForSeq2SeqLM,
    }[arch]
    batch = global_batch(arch)
    batch.pop("labels")
    with torch.no_grad():
        sharded = auto.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto")).eval()
        got = sharded(**batch).logits
        want = auto.from_pretrained(folder).eval()(**batch).logits
    names = [n for n, p in sharded.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)]
    n_sharded = sum(isinstance(p, DTensor) for p in sharded.parameters())
    return {"diff": float((got - want).abs().max()), "sharded": n_sharded, "sharded_names": names}


def tensor_parallel(arch: str, folder: str, out: str) -> None:
    write(out, sharded_and_unsharded(arch, folder))


def train_seen(data: str, run: str, steps: str, chars: str, out: str, streaming=False, grad_accum=1) -> None:
    """The rows each rank trains on, step by step: recorded by a forward pre-hook on the model train() builds."""
    from swapformer.training import loop

    from training_runs import tiny_args

    seen, build_model = [], loop.build_model

    def recorded(*args, **kwargs):
        model = build_model(*args, **kwargs)

        def record(module, args, kwargs):
            if module.training:
                seen.append(kwargs["input_ids"].tolist())

        model.register_forward_pre_hook(record, with_kwargs=True)
        return model

    loop.build_model = recorded
    args = tiny_args(
        Path(run),
        Path(data),
        max_steps=int(steps),
        max_train_chars=int(chars),
        save_every=1000,
        grad_accum=grad_accum,
    )
    args.cache_dir, args.overwrite = run + "-cache", True  # a launch tried again finds the first one's folder
    if streaming:
        args.streaming, args.cache_dir = True, None
    rank, world = dist.get_rank(), dist.get_world_size()
    loop.train(args)  # it ends the process group: the ranks meet through files
    Path(f"{out}.{rank}.tmp").write_text(json.dumps(seen))
    os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")  # whole when it appears
    if rank == 0:
        parts = [Path(f"{out}.{r}") for r in range(world)]
        for _ in range(600):
            if all(p.is_file() for p in parts):
                break
            time.sleep(0.1)
        Path(out).write_text(json.dumps([json.loads(p.read_text()) for p in parts]))


def tensor_parallel_each(root: str, out: str) -> None:
    folders = sorted(Path(root).iterdir())
    write(out, {f.name: sharded_and_unsharded(f.name.split("-")[0], f) for f in folders})


if __name__ == "__main__":
    dist.init_process_group("gloo")
    modes = {
        "fsdp": train_fsdp,
        "tp": tensor_parallel,
        "tp_each": tensor_parallel_each,
        "train_seen": train_seen,
        "train_seen_streaming": lambda data, run, steps, chars, accum, out: train_seen(
            data, run, steps, chars, out, streaming=True, grad_accum=int(accum)
        ),
    }
    modes[sys.argv[1]](*sys.argv[2:])
    if dist.is_initialized():  # train_seen's run has ended it
        dist.destroy_process_group()
