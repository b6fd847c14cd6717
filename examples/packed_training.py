"""Train a swapformer decoder on packed sequences with transformers' Trainer and
DataCollatorWithFlattening: no padding, and each sequence attends only to itself.

    python examples/packed_training.py                      # about a minute on 2 CPU cores
    python examples/packed_training.py --max-steps 2 --documents 16 --hidden-size 32   # a smoke run

The data are slices of the Python standard library's source and the tokenizer a small BPE trained on
them, so the script runs without downloads. `train_packed` is what docs/patterns.md shows (a test runs this
file and checks that the page holds the same code).
"""

from __future__ import annotations

import argparse
import math
import tempfile

# docs/patterns.md: packed sequences (start)
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

import swapformer


def train_packed(tokenizer, texts, output_dir, hidden_size=128, max_steps=60):
    config = swapformer.DecoderConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=128,  # windows, global tokens and random blocks apply per sequence
    )
    model = swapformer.DecoderForCausalLM(config)  # every backend but sdpa_fa keeps sequences apart
    train_dataset = [{"input_ids": tokenizer(text)["input_ids"][:512]} for text in texts]
    # Each batch becomes one row: the sequences side by side, position_ids restarting at 0 for each
    # (plus cu_seq_lens_*/max_length_* for flash_attention_2), labels -100 at each sequence's start.
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        max_steps=max_steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, data_collator=collator)
    trainer.train()
    return trainer


# docs/patterns.md: packed sequences (end)


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the logged training losses."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=256, help="standard-library files to train on")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--output-dir", default=None, help="Trainer's folder (default: a temporary one)")
    args = parser.parse_args(argv)

    from swapformer.training.corpus import stdlib_documents
    from swapformer.training.tokenizer import train_tokenizer

    texts = [doc.text[:3000] for doc in stdlib_documents()[: args.documents]]
    tokenizer = train_tokenizer(texts, vocab_size=1024)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="packed-training-")
    trainer = train_packed(tokenizer, texts, output_dir, args.hidden_size, args.max_steps)
    losses = [record["loss"] for record in trainer.state.log_history if "loss" in record]
    print(f"{len(losses)} steps, training loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert all(math.isfinite(loss) for loss in losses)
    return losses


if __name__ == "__main__":
    main()
