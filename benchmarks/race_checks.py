"""What train_vs_trainer.py sets up before the race and checks after it: the corpus and tokenizer both
sides read, swapformer's initial weights converted to Llama for Trainer, and the checks that both sides
trained the same model on the same blocks with the same optimisation."""

from __future__ import annotations

import pathlib
import shutil
import sysconfig

import torch

SKIP = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
CHARS_PER_BLOCK_TOKEN = 6  # generous: a byte-level BPE of Python takes 2 to 4 characters per token


def stdlib_text(chars: int, skip: int = 0) -> tuple[str, int]:
    """About `chars` characters of the running Python's standard library sources, in sorted path order,
    from file number `skip` on; (the text, the file number after the last one used)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if not SKIP & set(p.relative_to(root).parts[:-1])]
    pieces, total, i = [], 0, skip
    while total < chars and i < len(files):
        try:
            pieces.append(files[i].read_text(encoding="utf-8"))
            total += len(pieces[-1])
        except (UnicodeDecodeError, OSError):
            pass  # a few files are not UTF-8
        i += 1
    return "\n".join(pieces), i


def read_corpus(args, work: pathlib.Path) -> tuple[pathlib.Path, str]:
    """The corpus (a DatasetDict of one training and one validation document: both sides concatenate the
    same text in the same order) and the tokenizer folder, trained by swapformer's tokenizer trainer
    unless --tokenizer gives one."""
    from datasets import Dataset, DatasetDict

    blocks = args.steps * args.batch * args.grad_accum
    train, used = stdlib_text(blocks * args.seq_len * CHARS_PER_BLOCK_TOKEN)
    val, _ = stdlib_text(args.val_blocks * args.seq_len * 4, skip=used)
    corpus = work / "corpus"
    shutil.rmtree(corpus, ignore_errors=True)  # and Dataset.map's caches in it: each race tokenizes afresh
    splits = {"train": [train], "validation": [val]}
    DatasetDict({k: Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(str(corpus))
    if args.tokenizer:
        return corpus, args.tokenizer
    from swapformer.training.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(train.splitlines(keepends=True), args.vocab)
    tokenizer.save_pretrained(str(work / "tokenizer"))
    return corpus, str(work / "tokenizer")


def llama_init(spec: dict, work: pathlib.Path) -> tuple[str, float]:
    """swapformer's weights before its first update, as a LlamaForCausalLM folder; (the folder, the
    largest logit difference the conversion measured between the two)."""
    from swapformer import DecoderConfig, DecoderForCausalLM
    from swapformer.conversion import convert

    init = torch.load(work / "race_record_swapformer.pt")["init"]
    model = DecoderForCausalLM(DecoderConfig.from_pretrained(work / "swapformer-run"))
    model.load_state_dict(init)
    # the family to convert back to: a freshly trained model names none
    model.config.converted_from = {"model_type": "llama", "architecture": "LlamaForCausalLM"}
    model.save_pretrained(work / "init-swapformer")
    report = convert(
        work / "init-swapformer", work / "init-llama", to_hf=True, overwrite=True, log=lambda _: None
    )
    return str(work / "init-llama"), report.max_diff


def same_tensor_rows(a: torch.Tensor, b: torch.Tensor, what: str) -> tuple[bool, str]:
    """Whether two records of input_ids are the same rows in the same order, and how they differ."""
    if a.shape != b.shape:
        return False, f"{what}: swapformer {tuple(a.shape)}, Trainer {tuple(b.shape)}"
    differ = int((a != b).any(dim=-1).sum())
    if differ:
        return False, f"{what}: {differ} of {len(a)} rows differ"
    return True, f"{what}: {len(a)} blocks of {a.shape[-1]} tokens, identical and in the same order"


def same_weights(trainer_init: dict, llama_folder: str, conversion_diff: float) -> tuple[bool, str]:
    from safetensors.torch import load_file

    saved = {}
    for f in pathlib.Path(llama_folder).glob("*.safetensors"):
        saved |= load_file(f)
    common = saved.keys() & trainer_init.keys()
    worst = max((float((saved[k] - trainer_init[k]).abs().max()) for k in common), default=float("inf"))
    ok = len(common) == len(saved) and worst == 0.0
    detail = (
        f"swapformer's initial weights converted to Llama (logits verified, max diff {conversion_diff:.1e}); "
        f"Trainer's weights before its first update equal them (max diff {worst:.1e} over {len(common)} "
        f"of {len(saved)} tensors)"
    )
    return ok, detail


def check_all(work: pathlib.Path, results: dict, conversion_diff: float) -> dict:
    """{check: (passed, detail)} of the two runs' records."""
    sf = torch.load(work / "race_record_swapformer.pt")
    tr = torch.load(work / "race_record_Trainer.pt")
    a, b = results["swapformer"]["first_loss"], results["Trainer"]["first_loss"]
    lr_a, lr_b = sf["lrs"], tr["lrs"]
    lr_gap = max((abs(x - y) for x, y in zip(lr_a, lr_b)), default=float("inf"))
    llama = str(work / "init-llama")
    return {
        "same training blocks": same_tensor_rows(sf["train"], tr["train"], "training forwards"),
        "same validation blocks": same_tensor_rows(sf["eval"], tr["eval"], "evaluation forwards"),
        "same initial weights": same_weights(tr["init"], llama, conversion_diff),
        "same first-step loss": (
            abs(a - b) <= 1e-4 * max(1.0, abs(a)),
            f"swapformer {a:.6f}, Trainer {b:.6f}",
        ),
        "same schedule": (
            len(lr_a) == len(lr_b) and lr_gap <= 1e-9 * max(lr_a, default=1.0),
            f"max lr difference {lr_gap:.1e} over {len(lr_a)} steps",
        ),
        "same decay groups": (
            bool(tr["decay_is_matrices"]),
            "Trainer's AdamW group with weight decay holds exactly the matrices (2-D), as swapformer's param_groups",
        ),
    }
