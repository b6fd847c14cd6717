"""Converted models train like the transformers model they came from.

Eval-mode parity (test_conversion.py) says nothing about dropout: where it sits, with which
probability and in which order the random masks are drawn. Here every converted family runs one
training step in train mode with dropout on, from the same seed, against the original: the loss and
every gradient (sent through the family's key map) must agree.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers as T

import swapformer
from swapformer.conversion import FAMILIES, architectures_for, convert, convert_state_dict, from_hf_model

from conftest import max_diff, scramble_
from hf_models import (
    bart_config,
    bert_config,
    big_bird_config,
    gpt2_config,
    llama_config,
    longformer_config,
    mistral_config,
    roberta_config,
    stablelm_config,
    t5_config,
)

P = 0.1  # every dropout probability the family has
BERT_DROPOUT = dict(hidden_dropout_prob=P, attention_probs_dropout_prob=P)
T5_DROPOUT = dict(dropout_rate=P, pad_token_id=0)
BART_DROPOUT = dict(dropout=P, attention_dropout=P, activation_dropout=P)
# Longformer drops out its window's probabilities (B, T, H, w + 1 + globals), swapformer the (B, H, T, S)
# map: the same distribution, other draws, so its attention dropout stays off here. It also pads the batch
# to a multiple of its window inside the forward and draws the other masks over that length: a window of
# 4 divides the batch's 12 tokens.
LONGFORMER_DROPOUT = dict(hidden_dropout_prob=P, attention_probs_dropout_prob=0.0, attention_window=4)

# (id, transformers class, config, swapformer class, kind of labels)
CASES = [
    ("bert-cls", T.BertForSequenceClassification, lambda: bert_config(**BERT_DROPOUT, num_labels=3), swapformer.EncoderForSequenceClassification, "class"),
    ("bert-mlm", T.BertForMaskedLM, lambda: bert_config(**BERT_DROPOUT), swapformer.EncoderForMaskedLM, "tokens"),
    ("bert-tok", T.BertForTokenClassification, lambda: bert_config(**BERT_DROPOUT, num_labels=4), swapformer.EncoderForTokenClassification, "token-class"),
    ("roberta-cls", T.RobertaForSequenceClassification, lambda: roberta_config(**BERT_DROPOUT, num_labels=2), swapformer.EncoderForSequenceClassification, "class"),
    ("roberta-mlm", T.RobertaForMaskedLM, lambda: roberta_config(**BERT_DROPOUT), swapformer.EncoderForMaskedLM, "tokens"),
    ("longformer-cls", T.LongformerForSequenceClassification, lambda: longformer_config(**LONGFORMER_DROPOUT, num_labels=2), swapformer.EncoderForSequenceClassification, "class"),
    ("longformer-mlm", T.LongformerForMaskedLM, lambda: longformer_config(**LONGFORMER_DROPOUT), swapformer.EncoderForMaskedLM, "tokens"),
    ("bigbird-full-mlm", T.BigBirdForMaskedLM, lambda: big_bird_config(**BERT_DROPOUT), swapformer.EncoderForMaskedLM, "tokens"),
    ("gpt2", T.GPT2LMHeadModel, lambda: gpt2_config(resid_pdrop=P, embd_pdrop=P, attn_pdrop=P), swapformer.DecoderForCausalLM, "tokens"),
    ("gpt2-embd-dropout-differs", T.GPT2LMHeadModel, lambda: gpt2_config(resid_pdrop=P, embd_pdrop=0.3, attn_pdrop=0.2), swapformer.DecoderForCausalLM, "tokens"),
    ("llama", T.LlamaForCausalLM, lambda: llama_config(num_key_value_heads=2, attention_dropout=P), swapformer.DecoderForCausalLM, "tokens"),
    ("mistral", T.MistralForCausalLM, lambda: mistral_config(sliding_window=5, attention_dropout=P), swapformer.DecoderForCausalLM, "tokens"),
    ("stablelm", T.StableLmForCausalLM, lambda: stablelm_config(num_key_value_heads=2, attention_dropout=P), swapformer.DecoderForCausalLM, "tokens"),
    ("t5-v1.0", T.T5ForConditionalGeneration, lambda: t5_config(feed_forward_proj="relu", **T5_DROPOUT), swapformer.Seq2SeqForConditionalGeneration, "seq2seq"),
    ("t5-v1.1", T.T5ForConditionalGeneration, lambda: t5_config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **T5_DROPOUT), swapformer.Seq2SeqForConditionalGeneration, "seq2seq"),
    ("bart", T.BartForConditionalGeneration, lambda: bart_config(**BART_DROPOUT), swapformer.Seq2SeqForConditionalGeneration, "seq2seq"),
]  # fmt: skip


def batch_for(kind: str, config, pad: int):
    """Two right-padded rows (the second shorter); real tokens never the pad id."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (2, 12), generator=g)
    ids[ids == pad] = pad + 1
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    ids = ids.masked_fill(mask == 0, pad)
    batch = {"input_ids": ids, "attention_mask": mask}
    if kind == "class":
        batch["labels"] = torch.tensor([1, 0])
    elif kind == "token-class":
        batch["labels"] = torch.randint(0, config.num_labels, ids.shape, generator=g).masked_fill(
            mask == 0, -100
        )
    elif kind == "tokens":
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    else:  # seq2seq: decoder inputs are made from the labels on both sides
        labels = torch.randint(3, config.vocab_size, (2, 7), generator=g)
        labels[1, 5:] = -100
        batch["labels"] = labels
    return batch


def one_step(model, batch, seed: int):
    """Loss and gradients {name: grad} of one forward/backward in train mode, from `seed`."""
    model.train()
    model.zero_grad()
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return loss.detach(), grads


def pair(hf_class, hf_config, target_class, attn="eager"):
    # Longformer's attention is its own code, with no sdpa path: only swapformer's side switches then
    hf_config._attn_implementation = attn if hf_class._supports_sdpa else "eager"
    torch.manual_seed(0)
    hf = hf_class(hf_config)
    scramble_(hf, 1)
    ours = from_hf_model(hf.eval(), target_class)
    ours.set_attn_implementation(attn)
    return hf, ours


def as_swapformer(hf, grads: dict, ours_grads: dict) -> tuple[dict, dict]:
    """The transformers gradients under swapformer's names (the family's rules, transforms included),
    and the ones set aside (source tensors swapformer does not use)."""
    module = FAMILIES[hf.config.model_type]
    arch = architectures_for(module, hf.config)[type(hf).__name__]
    mapped = convert_state_dict(grads, arch.rules, expected_keys=ours_grads.keys(), drop=module.DROP)
    aside = {k: v for k, v in mapped.items() if k not in ours_grads}
    return {k: v for k, v in mapped.items() if k in ours_grads}, aside


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_training_step_matches_the_source_model(case, attn, report):
    """(On CPU, SDPA with dropout runs its math kernel, which draws the same masks as eager.)"""
    name, hf_class, make_config, target_class, kind = case
    hf, ours = pair(hf_class, make_config(), target_class, attn)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    batch = batch_for(kind, hf.config, pad)

    with torch.no_grad():
        eval_loss = hf.eval()(**batch).loss
    hf_loss, hf_grads = one_step(hf, batch, seed=123)
    our_loss, our_grads = one_step(ours, batch, seed=123)
    # dropout is really on: the train-mode loss is not the eval-mode loss
    assert abs(float(hf_loss) - float(eval_loss)) > 1e-4, "dropout did not change the loss"

    mapped, aside = as_swapformer(hf, hf_grads, our_grads)
    worst = max(max_diff(our_grads[k], v) / max(float(v.abs().max()), 1.0) for k, v in mapped.items())
    report(f"{name} ({attn}) train-mode loss: transformers {float(hf_loss):.6f}, swapformer {float(our_loss):.6f}; "
           "worst gradient diff (relative)", worst)  # fmt: skip
    assert abs(float(hf_loss) - float(our_loss)) <= 1e-5 * max(1.0, abs(float(hf_loss)))
    assert worst <= 1e-4
    # tensors set aside (offset rows of a position table) are never read, so they get no gradient
    assert all(float(v.abs().max()) == 0.0 for v in aside.values()), list(aside)


def test_a_different_seed_gives_a_different_step():
    """The parity above is not vacuous: another seed draws other masks, and the loss moves."""
    hf, ours = pair(T.T5ForConditionalGeneration, t5_config(feed_forward_proj="relu", **T5_DROPOUT),
                    swapformer.Seq2SeqForConditionalGeneration)  # fmt: skip
    batch = batch_for("seq2seq", hf.config, 0)
    a, _ = one_step(ours, batch, seed=123)
    b, _ = one_step(ours, batch, seed=124)
    assert abs(float(a) - float(b)) > 1e-4


def test_t5_stacks_drop_out_their_output_as_t5_does():
    """The figure of the issue: in train mode T5 zeroes about a tenth of its encoder outputs (dropout
    after the final layer norm); the converted model must zero the same ones."""
    hf, ours = pair(T.T5ForConditionalGeneration, t5_config(feed_forward_proj="relu", **T5_DROPOUT),
                    swapformer.Seq2SeqForConditionalGeneration)  # fmt: skip
    batch = batch_for("seq2seq", hf.config, 0)
    zeros = {}
    for label, model in (("T5", hf), ("swapformer", ours)):
        model.train()
        torch.manual_seed(7)
        with torch.no_grad():
            h = model(**batch).encoder_last_hidden_state
        zeros[label] = h == 0
    share = float(zeros["T5"].float().mean())
    print(
        f"\nencoder outputs zeroed in train mode: T5 {share:.1%}, swapformer {float(zeros['swapformer'].float().mean()):.1%}"
    )
    assert share > 0.05 and torch.equal(zeros["T5"], zeros["swapformer"])


# Fine-tuning a classifier from a real checkpoint ------------------------------------------------
#
# A small sentiment task with negation, built here (no network): the test split uses adjectives the
# training split never shows, so what the model brings from pretraining (its pooler included) counts.

SUBJECTS = ["the movie", "the food", "this phone", "the hotel", "our trip", "the service", "the book",
            "the game", "her speech", "the concert", "the weather", "his idea"]  # fmt: skip
POSITIVE = ["great", "wonderful", "excellent", "pleasant", "brilliant", "lovely", "superb", "delightful",
            "fantastic", "good"]  # fmt: skip
NEGATIVE = ["awful", "terrible", "boring", "dreadful", "poor", "horrible", "disappointing", "bland", "bad",
            "mediocre"]  # fmt: skip
LEADS = ["", "honestly, ", "i think ", "to be fair, ", "well, "]


def sentiment(n: int, seed: int, positive: list[str], negative: list[str]):
    """n sentences and labels (1 positive): an adjective, negated half of the time."""
    r = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        good, negated = r.random() < 0.5, r.random() < 0.5
        adjective = r.choice(positive if good else negative)
        texts.append(f"{r.choice(LEADS)}{r.choice(SUBJECTS)} was {'not ' if negated else ''}{adjective}.")
        labels.append(int(good != negated))
    return texts, torch.tensor(labels)


STEPS, BATCH, LR = 16, 8, 5e-5


def fine_tune(model, tokenizer, train, test) -> float:
    """Test accuracy (%) after STEPS AdamW steps in train mode (dropout on), from seed 0. The word
    embedding is frozen (in every model alike) to keep the test fast."""
    encode = lambda texts: tokenizer(texts, padding=True, return_tensors="pt")  # noqa: E731
    torch.manual_seed(0)
    model.get_input_embeddings().weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    model.train()
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        model(**encode(train[0][rows]), labels=train[1][rows]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        predicted = torch.cat(
            [model(**encode(test[0][i : i + 100])).logits.argmax(-1) for i in range(0, len(test[0]), 100)]
        )
    return 100.0 * float((predicted == test[1]).float().mean())


@pytest.mark.slow
def test_classifier_fine_tuned_from_converted_minilm_matches_bert(tmp_path):
    """BertForSequenceClassification and the swapformer classifier, both from the real MiniLM checkpoint
    (a BertModel with its pooler), with the same fresh classifier weights, seed, data and steps."""
    from hf_models import minilm_folder

    src = minilm_folder()
    convert(src, tmp_path / "minilm", log=lambda line: None)
    tokenizer = T.AutoTokenizer.from_pretrained(src)
    train = sentiment(STEPS * BATCH, 0, POSITIVE[:6], NEGATIVE[:6])
    test = sentiment(400, 1, POSITIVE[6:], NEGATIVE[6:])

    torch.manual_seed(0)
    bert = T.BertForSequenceClassification.from_pretrained(src, num_labels=2)
    ours = T.AutoModelForSequenceClassification.from_pretrained(tmp_path / "minilm", num_labels=2)
    # what conversion gave before: the pooler set aside, a classifier head with a random dense layer
    aside = T.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "minilm", num_labels=2, add_pooling_layer=False
    )
    assert torch.equal(ours.model.pooler.dense.weight, bert.bert.pooler.dense.weight)
    with torch.no_grad():
        for head in (ours.classifier, aside.classifier.out_proj):
            head.weight.copy_(bert.classifier.weight)
            head.bias.copy_(bert.classifier.bias)

    accuracy = {name: fine_tune(m, tokenizer, train, test) for name, m in
                (("BertForSequenceClassification", bert), ("swapformer", ours), ("swapformer, pooler set aside", aside))}  # fmt: skip
    print("\nMiniLM fine-tuned, test accuracy:", ", ".join(f"{k} {v:.2f}%" for k, v in accuracy.items()))
    assert abs(accuracy["swapformer"] - accuracy["BertForSequenceClassification"]) <= 0.5
