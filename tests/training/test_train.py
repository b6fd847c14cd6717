"""`swapformer train`: each architecture end to end on tiny configs, exact resume, 1 vs 2 processes,
the perplexity metric against a hand computation, the model card, failures before and during training."""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM, AutoTokenizer

from swapformer.cli import main
from swapformer.training.args import TrainArgs, TrainArgumentError
from swapformer.training.corpus import split_documents, stdlib_documents
from swapformer.training.data import BlockOrder
from swapformer.training.evaluation import load_metric, model_log_probs, target_counts, unigram_log_probs
from swapformer.training.launch import check_launch
from swapformer.training.loop import train
from swapformer.training.objectives import SpanCorruption, make_objective
from swapformer.training.preflight import check_run
from swapformer.training.step import TrainingDiverged
from swapformer.training.tokenizer import train_tokenizer

from conftest import max_diff, run_python
from training_runs import (
    TINY_MODEL,
    TINY_RUN,
    accelerate_launch,
    kill_after_step,
    losses,
    tiny_args,
    tiny_argv,
    wait_for_step,
)

AUTO = {
    "decoder": AutoModelForCausalLM,
    "encoder": AutoModelForMaskedLM,
    "encoder-decoder": AutoModelForSeq2SeqLM,
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory, text_folder) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    texts = [p.read_text() for p in sorted(text_folder.glob("*.txt"))]
    train_tokenizer(texts, 600).save_pretrained(folder)
    return folder


# subprocesses: one thread each, and CPU even where a GPU exists (they are compared with CPU runs)
CPU_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


# The metric ----------------------------------------------------------------------------------------


def test_perplexity_metric_matches_a_hand_computation(report):
    g = torch.Generator().manual_seed(0)
    rows, hand_sum, hand_n = [], 0.0, 0
    for length in (5, 3, 0, 7):
        logits = torch.randn(length, 6, generator=g, dtype=torch.float64).tolist()
        targets = torch.randint(6, (length,), generator=g).tolist()
        row = []
        for z, t in zip(logits, targets):
            p = math.exp(z[t]) / sum(math.exp(v) for v in z)  # softmax by hand
            row.append(math.log(p))
            hand_sum += -math.log(p)
            hand_n += 1
        rows.append(row)
    metric = load_metric()
    metric.add_batch(log_probs=rows[:2])
    metric.add_batch(log_probs=rows[2:])
    result = metric.compute()
    hand = math.exp(hand_sum / hand_n)
    report("perplexity: metric - hand", result["perplexity"] - hand)
    assert result["num_tokens"] == hand_n == 15
    assert result["perplexity"] == pytest.approx(hand, rel=1e-12)
    with pytest.raises(ValueError, match="log-probabilities"):
        load_metric().compute(log_probs=[[0.5]])


def test_model_perplexity_is_exp_of_its_loss_and_unigram_baseline_is_add_one(report):
    import swapformer

    cfg = swapformer.DecoderConfig(
        vocab_size=50, **TINY_MODEL, max_position_embeddings=16, hidden_dropout=0.0
    )
    torch.manual_seed(0)
    model = swapformer.DecoderForCausalLM(cfg).eval()
    ids = torch.randint(50, (3, 10), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    rows = model_log_probs(model, [batch], shift=True)
    result = load_metric().compute(log_probs=rows)
    with torch.no_grad():
        loss = model(**batch).loss.item()
    report("log perplexity - model loss", math.log(result["perplexity"]) - loss)
    assert result["num_tokens"] == 3 * 9
    assert math.log(result["perplexity"]) == pytest.approx(loss, abs=1e-5)

    causal = make_objective(None, TrainArgs().resolved())  # targets: tokens 1.. of each block
    counts = target_counts(torch.tensor([[3, 0, 0, 1, 2]]), causal, 5, None)
    assert counts.tolist() == [2, 1, 1, 0, 0]
    val = [{"labels": torch.tensor([[0, 4, 1, -100]])}]
    (row,) = unigram_log_probs(counts, val, shift=False)
    assert row == pytest.approx([math.log(3 / 9), math.log(1 / 9), math.log(2 / 9)])


# Data and objectives ---------------------------------------------------------------------------------


def test_split_and_block_order_are_deterministic():
    docs = stdlib_documents()
    train_a, val_a = split_documents(docs, 0.05, 200_000, 20_000)
    train_b, val_b = split_documents(list(reversed(docs)), 0.05, 200_000, 20_000)
    assert [d.name for d in train_a] == [d.name for d in train_b]
    assert [d.name for d in val_a] == [d.name for d in val_b]
    assert not {d.name for d in train_a} & {d.name for d in val_a}
    order = BlockOrder(10, seed=3)
    epoch0 = order.indices(0, 10)
    assert sorted(epoch0.tolist()) == list(range(10))  # every block once per epoch
    assert torch.equal(order.indices(7, 6), torch.cat([epoch0[7:], BlockOrder(10, seed=3).indices(10, 3)]))


def test_block_order_is_torch_randperm_of_the_seed_held_in_int32():
    """The order kept in int32 (half the memory of a large corpus's permutation) is the int64 randperm
    the epochs have always read, so a run reads the same blocks."""
    for n, seed in ((10, 3), (1_000, 0), (100_003, 42)):
        order = BlockOrder(n, seed)
        for epoch in (0, 1):
            reference = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
            got = order.indices(epoch * n, n)
            assert got.dtype == torch.int64 and torch.equal(got, reference)
        assert order._perm(1).element_size() == 4


def test_span_corruption_hides_spans_that_the_target_restores(saved_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(saved_tokenizer)
    args = TrainArgs(arch="encoder-decoder", seq_len=40).resolved()
    objective = make_objective(tokenizer, args)
    blocks = torch.randint(200, 500, (3, 40), generator=torch.Generator().manual_seed(0))
    batch = objective(blocks, torch.Generator().manual_seed(1))
    lengths = SpanCorruption.lengths_for(args)
    assert batch["input_ids"].shape == (3, lengths["encoder input"])
    assert batch["labels"].shape == (3, lengths["decoder target"])
    sentinels = set(objective.sentinels.tolist())
    for inp, tgt, original in zip(batch["input_ids"].tolist(), batch["labels"].tolist(), blocks.tolist()):
        spans, current = {}, None
        for t in tgt[:-1]:
            if t in sentinels:
                current = spans.setdefault(t, [])
            else:
                current.append(t)
        restored = [x for t in inp[:-1] for x in (spans[t] if t in sentinels else [t])]
        assert restored == original


def test_masked_lm_chooses_15_percent_and_replaces_80_10_10(saved_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(saved_tokenizer)
    objective = make_objective(tokenizer, TrainArgs(arch="encoder").resolved())
    blocks = torch.randint(200, 500, (400, 100), generator=torch.Generator().manual_seed(0))
    batch = objective(blocks, torch.Generator().manual_seed(1))
    chosen = batch["labels"] != -100
    assert torch.equal(batch["labels"][chosen], blocks[chosen])
    assert torch.equal(batch["input_ids"][~chosen], blocks[~chosen])  # the rest is untouched
    inputs = batch["input_ids"][chosen]
    masked = (inputs == tokenizer.mask_token_id).float().mean().item()
    kept = (inputs == blocks[chosen]).float().mean().item()  # includes random draws of the same token
    special = set(tokenizer.all_special_ids)
    assert not any(int(t) in special for t in inputs[(inputs != tokenizer.mask_token_id)])
    assert abs(chosen.float().mean().item() - 0.15) < 0.01
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1) < 0.02 and abs(1 - masked - kept - 0.1) < 0.02


# End to end per architecture ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
def test_each_architecture_trains_and_writes_a_hub_ready_folder(arch, tmp_path, text_folder, saved_tokenizer):
    data = text_folder
    extra = {}
    if arch == "encoder":  # a `datasets` dataset saved on disk
        from datasets import Dataset

        texts = [p.read_text() for p in sorted(text_folder.glob("*.txt"))]
        Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
        data = tmp_path / "ds"
    if arch == "encoder-decoder":  # a tokenizer given instead of trained
        extra = dict(tokenizer=str(saved_tokenizer), seq_len=48)
    out = tmp_path / "run"
    if arch == "encoder":  # also: another backend, activation checkpointing
        extra = dict(attn="eager", gradient_checkpointing=True)
    if arch == "decoder":  # also: a backend per layer type, block-sparse on a sliding-window layer
        layers = ["sliding_attention", "full_attention"]
        attn = json.dumps({"sliding_attention": "sparse", "full_attention": "sdpa"})
        extra = dict(attn=attn, set=dict(sliding_window=8, layer_types=layers))
    metrics = train(tiny_args(out, data, arch=arch, **extra))

    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "training_args.json",
        "metrics.json",
        "README.md",
    ):
        assert (out / name).is_file(), name
    assert list(out.glob("modeling_*.py")), "remote code missing"
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]
    assert config["layer_types"] == extra.get("set", {}).get("layer_types", ["full_attention"] * 2)
    assert json.loads((out / "metrics.json").read_text()) == pytest.approx(metrics)
    curve = losses(out)
    assert [s for s, _ in curve] == list(range(1, 9))
    assert all(math.isfinite(v) for _, v in curve)
    assert curve[-1][1] < curve[0][1]  # it learned something
    assert 1 < metrics["val_perplexity"] < 600 and 1 < metrics["unigram_perplexity"] < 600

    # the model card carries the real numbers, in the text and in the Hub metadata
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers"
    if arch == "decoder":
        assert {"attn-sparse", "attn-sdpa"} <= set(card.data.tags)
    assert card.data.eval_results[0].metric_type == "perplexity"
    assert card.data.eval_results[0].metric_value == round(metrics["val_perplexity"], 4)
    assert f"| {metrics['val_perplexity']:.2f} |" in card.text
    assert f"| {metrics['unigram_perplexity']:.2f} |" in card.text

    model = AUTO[arch].from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("def main():\n    return", return_tensors="pt").input_ids
    if arch == "encoder":
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    else:
        generated = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        assert generated.shape[1] == (ids.shape[1] if arch == "decoder" else 1) + 4


# Reliability ---------------------------------------------------------------------------------------------


def test_resume_after_a_kill_reproduces_the_uninterrupted_run(tmp_path, text_folder, report):
    # dropout on and accumulation: the resumed run must also restore the RNG and the batch split
    kw = dict(grad_accum=2, set=dict(hidden_dropout=0.1))
    full = tmp_path / "full"
    train(tiny_args(full, text_folder, **kw))
    broken = tmp_path / "broken"
    assert train(tiny_args(broken, text_folder, stop_after=5, **kw)) == {"stopped_at": 5}
    assert [p.name for p in sorted((broken / "checkpoints").iterdir())] == ["step_0000003"]
    assert not (broken / "model.safetensors").exists()
    # a kill during a checkpoint save leaves a .tmp folder, which resuming must ignore
    (broken / "checkpoints" / "step_0000004.tmp").mkdir()
    (broken / "checkpoints" / "step_0000004.tmp" / "trainer_state.json").write_text("{")
    train(tiny_args(broken, text_folder, resume="latest", **kw))
    a, b = losses(full), losses(broken)
    assert [s for s, _ in b] == list(range(1, 9))  # steps 4-5 were redone, not logged twice
    diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    wa, wb = load_file(str(full / "model.safetensors")), load_file(str(broken / "model.safetensors"))
    weights = max(max_diff(wa[k], wb[k]) for k in wa)
    report("resume: max |loss diff| over 8 steps", diff)
    report("resume: max |weight diff|", weights)
    assert diff <= 1e-6 and weights <= 1e-6


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_checkpoints_store_tied_weights_once_without_a_warning(tmp_path, text_folder, caplog, arch):
    """accelerate drops an aliased tensor with "Removed shared tensor {'lm_head.weight'} while saving", a
    warning that reads like an error at every checkpoint; the copy is dropped before it looks."""
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        train(tiny_args(out, text_folder, arch=arch))
    assert not [r.getMessage() for r in caplog.records if "shared tensor" in r.getMessage()]
    checkpoint = sorted((out / "checkpoints").iterdir())[-1]
    keys = set(load_file(str(checkpoint / "model.safetensors")))
    assert "lm_head.weight" not in keys
    assert ("model.embed_tokens.weight" if arch == "decoder" else "model.shared.weight") in keys


def test_two_processes_follow_the_single_process_loss_curve(tmp_path, text_folder, report):
    one, two = tmp_path / "one", tmp_path / "two"
    python_m = [sys.executable, "-m", "swapformer"]
    accelerate = accelerate_launch(2)
    # the same global batch of 8: 1 process x 4 rows x 2 accumulation, 2 processes x 4 rows
    for command in (
        python_m + tiny_argv(one, text_folder, grad_accum=2),
        accelerate + tiny_argv(two, text_folder),
    ):
        done = subprocess.run(command, env=CPU_ENV, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads((out / "metrics.json").read_text()) for out in (one, two)]
    assert [(m["num_processes"], m["global_batch"]) for m in metrics] == [(1, 8), (2, 8)]
    a, b = losses(one), losses(two)
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 9))
    diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    report("1 process x 2 accumulation vs 2 processes: max |loss diff|", diff)
    assert diff <= 1e-5
    assert metrics[1]["val_perplexity"] == pytest.approx(metrics[0]["val_perplexity"], rel=1e-4)


def test_launches_that_would_train_something_else_are_refused(monkeypatch):
    args = TrainArgs().resolved()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(TrainArgumentError, match="--multi_gpu"):  # asked for several, got one process
        check_launch(args)
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_launch(args)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # the launcher's precision, not the run's
    with pytest.raises(TrainArgumentError, match="--mixed-precision bf16"):
        check_launch(args)
    check_launch(TrainArgs(mixed_precision="bf16").resolved())
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # the launcher's default
    check_launch(TrainArgs(mixed_precision="bf16").resolved())


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, text_folder):
    def poison(step, model):
        if step == 3:  # after step 3's update, before step 4's forward
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))

    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"step 4.*step_0000002"):
        train(tiny_args(out, text_folder, save_every=2), step_hook=poison)
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step_0000002"]
    weights = load_file(str(out / "checkpoints" / "step_0000002" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not (out / "model.safetensors").exists()
    # the run continues from the good checkpoint
    metrics = train(tiny_args(out, text_folder, save_every=2, resume="latest"))
    assert math.isfinite(metrics["val_perplexity"])


def test_a_folder_holding_another_run_is_not_overwritten(tmp_path, text_folder, capsys):
    out = tmp_path / "run"
    train(tiny_args(out, text_folder, stop_after=1))
    saved = (out / "training_args.json").read_text()
    with pytest.raises(TrainArgumentError, match="--overwrite"):
        train(tiny_args(out, text_folder, lr=1e-3))
    with pytest.raises(TrainArgumentError, match="differ.*lr"):
        train(tiny_args(out, text_folder, lr=1e-3, resume="latest"))
    assert (out / "training_args.json").read_text() == saved
    train(tiny_args(out, text_folder, lr=1e-3, overwrite=True, max_steps=2))
    assert json.loads((out / "training_args.json").read_text())["lr"] == 1e-3

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(["train", "--output-dir", str(foreign), "--overwrite"]) == 2
    assert "holds no swapformer run" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--attn", "nosuch"], "--attn"),
        (["--attn", '{"nosuch_attention": "sdpa"}'], "--attn"),
        (["--attn", '{"full_attention": "sdpa"', "--set", "num_hidden_layers=1"], "--attn"),
        (["--batch-size", "0"], "--batch-size"),
        (["--data", "/no/such/path"], "--data"),
        (["--seq-len", "128", "--set", "max_position_embeddings=64"], "--seq-len"),
        (["--set", "no_such_field=1"], "--set"),
        (["--set", "eos_token_id=3"], "come from the tokenizer"),
        (["--arch", "encoder", "--set", "decoder_layers=2"], "--arch encoder"),
        (["--set", "num_attention_heads=5"], "num_attention_heads"),
        (["--push-to-hub", "not a repo id!"], "--push-to-hub 'not a repo id!' is not a Hub repo id"),
        (["--arch", "encoder", "--attn", "flash_attention_2"], "flash_attention_2"),
        pytest.param(
            ["--attn", "flex_attention"],
            "--attn 'flex_attention' has no backward pass",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="flex trains on CUDA"),
        ),
    ],
)
def test_bad_arguments_fail_before_training_naming_the_argument(argv, named, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["train", "--output-dir", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert named in err, err
    assert not out.exists()  # nothing was written: it failed before the run started


def test_python_m_swapformer_train_help():
    done = subprocess.run(
        [sys.executable, "-m", "swapformer", "train", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "--resume" in done.stdout and "--mixed-precision" in done.stdout


def test_metrics_reach_tensorboard_when_it_is_installed(tmp_path, text_folder):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(tiny_args(out, text_folder, max_steps=3, eval_every=2))
    (events,) = (out / "runs").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]
    assert [round(e.value, 4) for e in acc.Scalars("loss")] == [round(v, 4) for _, v in losses(out)]
    assert acc.Scalars("val_perplexity")


def test_cli_single_text_file_config_file_and_set_flags_reach_the_saved_model(tmp_path, text_folder):
    config_file = tmp_path / "model.json"
    config_file.write_text(
        json.dumps({"num_key_value_heads": 2, "position_embedding_type": "alibi", "hidden_size": 64})
    )
    out = tmp_path / "run"
    corpus = tmp_path / "corpus.txt"  # one long text file: cut into documents so validation gets some
    corpus.write_text("".join(p.read_text() for p in sorted(text_folder.glob("*.txt"))))
    argv = ["train", "--output-dir", str(out), "--data", str(corpus), "--config", str(config_file)]
    argv += ["--set", "hidden_size=32", "--set", "num_hidden_layers=1", "--set", "intermediate_size=64"]
    argv += ["--vocab-size", "600", "--seq-len", "32", "--batch-size", "2", "--max-steps", "2"]
    argv += ["--warmup-steps", "0", "--max-train-chars", "20000", "--max-val-chars", "3000", "--no-progress"]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["position_embedding_type"] == "alibi"
    assert config["hidden_size"] == 32 and config["num_hidden_layers"] == 1  # --set wins over --config
    assert config["max_position_embeddings"] == 32  # sized to --seq-len
    assert json.loads((out / "training_args.json").read_text())["set"]["hidden_size"] == 32
    # a saved config.json works as --config (its vocabulary is left to the new run's tokenizer)
    again = tmp_path / "again"
    argv = tiny_argv(again, text_folder, max_steps=1, vocab_size=700, warmup_steps=0)
    assert main([*argv, "--config", str(out / "config.json"), "--set", "num_hidden_layers=1"]) == 0
    config_again = json.loads((again / "config.json").read_text())
    assert config_again["vocab_size"] == len(AutoTokenizer.from_pretrained(again)) != config["vocab_size"]
    assert config_again["position_embedding_type"] == "alibi" and config_again["num_key_value_heads"] == 2


def test_ctrl_c_ends_the_run_with_the_resume_hint(tmp_path, text_folder):
    import signal

    out = tmp_path / "run"
    command = [sys.executable, "-m", "swapformer", *tiny_argv(out, text_folder, max_steps=300)]
    # As a terminal's Ctrl-C meets it: a test run started in the background (`cmd &` in a script) has
    # SIGINT ignored, children inherit that, and Python then installs no KeyboardInterrupt handler.
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(
        command, env=CPU_ENV, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint
    )
    try:
        wait_for_step(proc, out, 4)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "--resume" in err, err


def test_a_killed_process_resumes_onto_the_uninterrupted_curve(tmp_path, text_folder, report):
    """SIGKILL a real `python -m swapformer train` between checkpoints, resume it, compare."""
    steps, every = 300, 5
    flags = dict(max_steps=steps, save_every=every, eval_every=100)
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    command = [sys.executable, "-m", "swapformer", *tiny_argv(killed, text_folder, **flags)]
    kill_after_step(command, killed, 2 * every + 2)  # past the checkpoint at 2 * every
    logged_before = losses(killed)[-1][0]
    assert logged_before < steps and not (killed / "model.safetensors").exists()
    assert main([*tiny_argv(killed, text_folder, **flags), "--resume"]) == 0
    assert main(tiny_argv(reference, text_folder, **flags)) == 0
    a, b = losses(reference), losses(killed)
    assert [s for s, _ in b] == list(range(1, steps + 1))
    diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    report(f"killed at step {logged_before}, resumed: max |loss diff| over {steps} steps", diff)
    assert diff <= 1e-6


def test_a_diverging_learning_rate_stops_through_the_cli_with_a_clear_message(tmp_path, text_folder, capsys):
    out = tmp_path / "run"
    assert main(tiny_argv(out, text_folder, lr=1e4, max_grad_norm=1e9, max_steps=30, warmup_steps=0)) == 1
    err = capsys.readouterr().err
    assert "training stopped at step" in err and "Lower --lr" in err, err
    assert not (out / "model.safetensors").exists()


def test_mixed_precision_reaches_accelerate(tmp_path, text_folder, report):
    fp32 = losses_of_run(tmp_path / "fp32", text_folder, mixed_precision="no")
    bf16 = losses_of_run(tmp_path / "bf16", text_folder, mixed_precision="bf16")
    diff = max(abs(a - b) for a, b in zip(fp32, bf16))
    report("bf16 autocast vs fp32: max |loss diff| over 3 steps", diff)
    assert 0 < diff < 0.1  # bf16 matmuls ran (different numbers), and trained the same model


def losses_of_run(out: pathlib.Path, data: pathlib.Path, **kw) -> list[float]:
    train(tiny_args(out, data, max_steps=3, **kw))
    return [v for _, v in losses(out)]


@pytest.mark.parametrize("preset", ["tiny", "small", "base"])
@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
def test_every_preset_builds_for_every_architecture(preset, arch):
    args, options = check_run(TrainArgs(preset=preset, arch=arch))  # the model is built on the meta device
    assert args.max_steps > args.warmup_steps and options["hidden_size"] % options["num_attention_heads"] == 0
    needed = SpanCorruption.lengths_for(args)["encoder input"] if arch == "encoder-decoder" else args.seq_len
    assert options["max_position_embeddings"] == needed


REMOTE_SCRIPT = """
import json, sys
sys.modules["swapformer"] = None  # as on a machine with only torch and transformers
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tokenizer("def main():", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
print("RESULT " + json.dumps({"class": type(model).__module__, "ids": out[0].tolist()}))
"""


def test_the_trained_folder_generates_with_remote_code_where_swapformer_is_absent(tmp_path, text_folder):
    out = tmp_path / "run"
    train(tiny_args(out, text_folder))
    result = run_python(REMOTE_SCRIPT, out, env=CPU_ENV, tag="RESULT")
    assert result["class"].startswith("transformers_modules")  # the folder's own code ran
    model = AutoModelForCausalLM.from_pretrained(out).eval()  # swapformer's registered class, here
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("def main():", return_tensors="pt").input_ids
    assert (
        model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0].tolist() == result["ids"]
    )


def test_resume_refuses_data_that_changed_since_the_checkpoint(tmp_path, text_folder):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(text_folder, data)
    out = tmp_path / "run"
    train(tiny_args(out, data, stop_after=4))
    first = sorted(data.glob("*.txt"))[0]
    first.write_text(first.read_text().replace("def ", "fed "))
    with pytest.raises(TrainArgumentError, match="training data or the global batch changed"):
        train(tiny_args(out, data, resume="latest"))


@pytest.fixture
def hub_recorder(monkeypatch):
    """HfApi.create_repo and upload_folder replaced by recorders (no network here); the recorder
    applies upload_folder's own ignore filter to list what would be uploaded."""
    from types import SimpleNamespace

    from huggingface_hub import HfApi
    from huggingface_hub.utils import filter_repo_objects

    calls = {}

    def create_repo(self, repo_id, *, private=False, exist_ok=False, **kwargs):
        calls["create_repo"] = dict(repo_id=repo_id, private=private, exist_ok=exist_ok)

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, **kwargs):
        if calls.get("fail"):
            raise OSError("401 Unauthorized")
        files = [
            p.relative_to(folder_path).as_posix() for p in pathlib.Path(folder_path).rglob("*") if p.is_file()
        ]
        calls["files"] = files
        calls["uploaded"] = sorted(filter_repo_objects(files, ignore_patterns=ignore_patterns))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0123abc")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def test_push_to_hub_uploads_the_folder_but_not_the_checkpoints(tmp_path, text_folder, hub_recorder, capsys):
    out = tmp_path / "run"
    assert main([*tiny_argv(out, text_folder), "--push-to-hub", "me/tiny-run", "--hub-private"]) == 0
    assert hub_recorder["create_repo"] == dict(repo_id="me/tiny-run", private=True, exist_ok=True)
    uploaded = hub_recorder["uploaded"]
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "loss_curve.png",
        ".gitignore",
    ):
        assert name in uploaded, name
    assert any(
        f.startswith("checkpoints/") for f in hub_recorder["files"]
    )  # there was something to leave out
    assert not any(f.startswith("checkpoints/") for f in uploaded)
    assert "uploaded to https://huggingface.co/me/tiny-run/commit/0123abc" in capsys.readouterr().out
    assert (out / ".gitignore").read_text() == "checkpoints/\n"


def test_a_failed_upload_says_so_and_keeps_the_folder(tmp_path, text_folder, hub_recorder, capsys):
    hub_recorder["fail"] = True
    out = tmp_path / "run"
    assert main([*tiny_argv(out, text_folder), "--push-to-hub", "me/tiny-run"]) == 1
    err = capsys.readouterr().err
    assert (
        "is complete, but uploading it to 'me/tiny-run' failed (401 Unauthorized)" in err
        and "upload_folder(" in err
    )
    assert AutoModelForCausalLM.from_pretrained(out) is not None


def test_push_to_hub_sends_nothing_until_the_folder_passes_its_preflight(
    tmp_path, text_folder, hub_recorder, monkeypatch
):
    """--push-to-hub checks the folder as model.push_to_hub checks its own before any Hub call: a card
    whose metadata does not parse is refused with the reason and no repository is created; offline, one
    line says nothing was sent; the intact folder then goes up."""
    import huggingface_hub.constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    from swapformer.hub_cards import PublishError
    from swapformer.training.hub import push_folder

    out = tmp_path / "run"
    assert main(tiny_argv(out, text_folder)) == 0
    readme = out / "README.md"
    card = readme.read_text()
    readme.write_text(card.replace("---\n", "---\nlicense: [unclosed\n", 1))
    with pytest.raises(PublishError, match="README.md metadata does not parse"):
        push_folder(out, "me/tiny-run")
    assert hub_recorder == {}
    readme.write_text(card)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineModeIsEnabled, match="HF_HUB_OFFLINE=1 turns it off: nothing was sent"):
        push_folder(out, "me/tiny-run")
    assert hub_recorder == {}
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert push_folder(out, "me/tiny-run").endswith("/commit/0123abc")
    assert hub_recorder["create_repo"]["repo_id"] == "me/tiny-run"


# Issue 10: the command as a new user meets it --------------------------------------------------------


def test_default_warmup_follows_the_length_the_user_gave():
    assert TrainArgs(max_steps=24).resolved().warmup_steps == 2  # tiny: 25 of 250 steps
    assert TrainArgs(preset="small", max_steps=300).resolved().warmup_steps == 20  # small: 200 of 3000
    assert TrainArgs().resolved().warmup_steps == 25 and TrainArgs(max_steps=1).resolved().warmup_steps == 0
    args, _ = check_run(TrainArgs(max_steps=24))
    assert args.warmup_steps == 2
    with pytest.raises(TrainArgumentError, match=r"--warmup-steps must lie in \[0, --max-steps=24\), got 25"):
        check_run(TrainArgs(max_steps=24, warmup_steps=25))  # a value the user gave is still checked


def test_set_reads_lists_and_mappings_as_json(tmp_path, capsys):
    from swapformer.training.args import parse_option

    layers = ["sliding_attention", "full_attention"]
    assert parse_option('layer_types=["sliding_attention", "full_attention"]') == ("layer_types", layers)
    assert parse_option('rope_parameters={"rope_type": "linear", "factor": 2.0}')[1] == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    assert parse_option("position_embedding_type=alibi") == ("position_embedding_type", "alibi")
    # the shell ate the inner quotes: refused with the quoting that works, not read as a string
    argv = [
        "train",
        "--output-dir",
        str(tmp_path / "run"),
        "--set",
        "layer_types=[sliding_attention,full_attention]",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "--set layer_types=[sliding_attention,full_attention]: a list or mapping must be JSON" in err
        and """--set 'layer_types=["sliding_attention","full_attention"]'""" in err
    ), err
    args, options = check_run(TrainArgs(set=dict(layer_types=layers, sliding_window=8, num_hidden_layers=2)))
    assert options["layer_types"] == layers


def test_a_config_file_of_another_architecture_or_with_unknown_fields_is_refused(tmp_path):
    import swapformer

    encoder = swapformer.EncoderConfig(**TINY_MODEL, vocab_size=600)
    encoder.save_pretrained(tmp_path / "encoder")
    config = str(tmp_path / "encoder" / "config.json")
    with pytest.raises(
        TrainArgumentError,
        match="is a 'swapformer_encoder' config, but --arch decoder trains 'swapformer_decoder'; pass --arch encoder",
    ):
        check_run(TrainArgs(config=config))
    args, options = check_run(TrainArgs(arch="encoder", config=config))
    assert options["hidden_size"] == 32
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    with pytest.raises(TrainArgumentError, match="is a 'bert' config.*swapformer convert"):
        check_run(TrainArgs(config=str(bert)))
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"num_hiden_layers": 2, "decoder_layers": 2, "hidden_size": 32}))
    with pytest.raises(
        TrainArgumentError, match="decoder_layers, num_hiden_layers are not fields of --arch decoder"
    ):
        check_run(TrainArgs(config=str(typo)))


def dataset_dict(tmp_path, text_folder, test=None) -> pathlib.Path:
    """A DatasetDict with train, validation and test splits (three documents, or the texts `test`)."""
    from datasets import Dataset, DatasetDict

    texts = [p.read_text() for p in sorted(text_folder.glob("*.txt"))]
    splits = {"train": texts[:14], "validation": texts[14:17], "test": texts[17:20] if test is None else test}
    path = tmp_path / "dd"
    DatasetDict({k: Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(str(path))
    return path


def test_a_dataset_dict_test_split_is_scored_after_training(tmp_path, text_folder, report):
    from swapformer.training import data as data_mod

    path = dataset_dict(tmp_path, text_folder)
    docs, _ = data_mod.load_documents([str(path)], "text")
    train_docs, val_docs = data_mod.split_documents(docs, 0.15, 0, 0)
    test_docs = data_mod.documents_of_test_split(docs, 0)
    assert {d.name.split("/")[1] for d in train_docs} == {"train"} and len(train_docs) == 14
    assert {d.name.split("/")[1] for d in val_docs} == {"validation"} and len(val_docs) == 3  # its own split
    assert [d.name for d in test_docs] == ["dd/test/0", "dd/test/1", "dd/test/2"]

    out = tmp_path / "run"
    metrics = train(tiny_args(out, path, max_val_chars=0, max_steps=3))
    assert metrics["test_perplexity"] != metrics["val_perplexity"]
    assert (
        json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["test_loss"] == metrics["test_loss"]
    )
    assert "On the dataset's test split" in (out / "README.md").read_text()

    # the oracle: the saved model's causal-LM loss over the test split's blocks, computed here
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    blocks = data_mod.pack(tokenizer, test_docs, TINY_RUN["seq_len"])
    with torch.no_grad():
        logits = model(blocks).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
    report("test loss: train's metric - direct computation", metrics["test_loss"] - nll.item())
    assert metrics["test_tokens"] == blocks[:, 1:].numel()
    assert metrics["test_loss"] == pytest.approx(nll.item(), abs=1e-5)
    assert 1 < metrics["test_unigram_perplexity"] < 600


def bad_inputs(
    kind: str, tmp_path: pathlib.Path, text_folder: pathlib.Path
) -> tuple[list[str], str, callable]:
    """Flags that name a bad input, the message expected, and a function that fixes the input."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(text_folder, data)
    if kind == "not UTF-8":
        (data / "broken.txt").write_bytes(b"caf\xe9 \xff\xfe")
        return ["--data", str(data)], "is not UTF-8 text", lambda: (data / "broken.txt").write_text("café")
    if kind == "empty validation split":
        return (
            ["--data", str(data), "--max-val-chars", "50"],
            "the validation split (",
            lambda: None,  # fixed below by a larger budget
        )
    if kind == "empty test split":
        path = dataset_dict(tmp_path, text_folder, test=["", ""])
        return ["--data", str(path)], "its 'test' split has no text in column 'text' (2 rows)", None
    if kind == "unreadable dataset":
        (data / "dataset_info.json").write_text("{}")
        return (
            ["--data", str(data)],
            "looks like a saved `datasets` dataset but cannot be read",
            lambda: (data / "dataset_info.json").unlink(),
        )
    if kind == "tokenizer":
        (tmp_path / "tok").mkdir()
        return (
            ["--data", str(data), "--tokenizer", str(tmp_path / "tok")],
            "is not a saved tokenizer folder",
            None,
        )
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["not UTF-8", "empty validation split", "empty test split", "unreadable dataset", "tokenizer"]
)
def test_data_errors_are_found_before_anything_is_written(kind, tmp_path, text_folder, capsys):
    flags, says, _ = bad_inputs(kind, tmp_path, text_folder)
    out = tmp_path / "run"
    argv = [*tiny_argv(out, text_folder, max_steps=2), *flags]
    capsys.readouterr()  # what making the bad input printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_the_same_command_works_once_the_data_is_fixed(tmp_path, text_folder, capsys):
    """Before training and after it started: neither failure blocks the retry."""
    flags, _, fix = bad_inputs("not UTF-8", tmp_path, text_folder)
    out = tmp_path / "run"
    argv = [*tiny_argv(out, text_folder, max_steps=2), *flags]
    assert main(argv) == 2
    fix()
    assert main(argv) == 0 and (out / "model.safetensors").is_file()

    # an --overwrite whose data turns out bad leaves the earlier run as it was
    saved = (out / "training_args.json").read_text()
    bad, says, _ = bad_inputs("empty validation split", tmp_path / "again", text_folder)
    assert main([*tiny_argv(out, text_folder, max_steps=2), *bad, "--overwrite"]) == 2
    assert says in capsys.readouterr().err
    assert (out / "training_args.json").read_text() == saved and (out / "model.safetensors").is_file()

    # a failure inside training, before the first checkpoint (save_every=3): nothing to resume, nothing left
    fresh = tmp_path / "fresh"

    def crash(step, model):
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        train(tiny_args(fresh, text_folder, max_steps=4), step_hook=crash)
    assert not fresh.exists()
    assert train(tiny_args(fresh, text_folder, max_steps=4))["steps"] == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is about machines without CUDA")
def test_mixed_precision_the_machine_cannot_run_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--output-dir", str(out), "--mixed-precision", "fp8"]) == 2
    err = capsys.readouterr().err
    assert (
        "--mixed-precision fp8 cannot train on this machine (CPU only, no CUDA GPU): fp8 needs an NVIDIA GPU "
        "of compute capability 8.9 or newer (Ada, Hopper). Here, choose --mixed-precision no, fp16, bf16"
    ) in err, err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is about machines without CUDA")
def test_an_fsdp_launch_without_cuda_is_refused(monkeypatch, tmp_path, text_folder, capsys):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from swapformer.training.launch import check_distributed

    # what `accelerate launch --use_fsdp --fsdp_version 2 --multi_gpu --num_processes 2` sets in each process
    launched = dict(
        ACCELERATE_USE_FSDP="true", FSDP_VERSION="2", ACCELERATE_MIXED_PRECISION="no", WORLD_SIZE="2"
    )
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        TrainArgumentError, match="asked for FSDP.*no CUDA GPU.*accelerate launch --multi_gpu"
    ):
        check_launch(TrainArgs().resolved())
    monkeypatch.delenv("WORLD_SIZE")
    out = tmp_path / "run"
    assert main(tiny_argv(out, text_folder)) == 2
    assert "every process would train a whole, unsharded copy" in capsys.readouterr().err
    assert not out.exists()
    # wherever Accelerate sets up something else than the FSDP asked for, the run stops
    plain = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2, device="cpu")
    with pytest.raises(TrainArgumentError, match="asked for FSDP, but Accelerate set up MULTI_CPU"):
        check_distributed(plain)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    check_distributed(plain)


def test_train_help_shows_a_data_parallel_launch_that_works_without_gpus(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "accelerate launch --multi_gpu --num_processes 2 -m swapformer train" in text
    assert "accelerate launch --num_processes 2 -m" not in text
