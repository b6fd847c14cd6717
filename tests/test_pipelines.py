"""transformers pipelines run on swapformer models with a tokenizer built by `tokenizers`."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, pipeline

import swapformer

from conftest import scramble_, tiny_config

WORDS = "the a cat dog sat on mat paris is capital of france where what who ran fast".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def encoder(model_class, tokenizer, **kw):
    config = tiny_config("encoder", vocab_size=len(tokenizer), type_vocab_size=2, pad_token_id=0, **kw)
    model = model_class(config).eval()
    scramble_(model)
    return model


def test_fill_mask(tokenizer):
    fill = pipeline("fill-mask", model=encoder(swapformer.EncoderForMaskedLM, tokenizer), tokenizer=tokenizer)
    out = fill("the cat sat on the [MASK]", top_k=3)
    assert len(out) == 3 and all(o["token_str"] for o in out)
    assert out[0]["score"] >= out[1]["score"] >= out[2]["score"]


def test_text_classification(tokenizer):
    model = encoder(swapformer.EncoderForSequenceClassification, tokenizer, id2label={0: "NEG", 1: "POS"})
    out = pipeline("text-classification", model=model, tokenizer=tokenizer)(
        ["the cat sat", "a dog ran fast on the mat"]
    )
    assert [o["label"] in {"NEG", "POS"} for o in out] == [True, True]


def test_token_classification(tokenizer):
    model = encoder(
        swapformer.EncoderForTokenClassification, tokenizer, id2label={0: "O", 1: "B-LOC", 2: "B-PER"}
    )
    out = pipeline("token-classification", model=model, tokenizer=tokenizer)("the cat sat on paris")
    assert out and all(o["entity"] in {"B-LOC", "B-PER"} for o in out)  # "O" is filtered by the pipeline


def test_question_answering_removed_pipeline_and_the_head_end_to_end(tokenizer):
    """transformers 5.x removed the "question-answering" pipeline (REMOVED_TASKS); the head still
    serves extractive QA: a question/context pair with token types and offsets in, a span out."""
    with pytest.raises(KeyError, match="question-answering has been removed"):
        pipeline(
            "question-answering",
            model=encoder(swapformer.EncoderForQuestionAnswering, tokenizer),
            tokenizer=tokenizer,
        )
    model = encoder(swapformer.EncoderForQuestionAnswering, tokenizer)
    question, context = "what is the capital of france", "paris is the capital of france"
    enc = tokenizer(question, context, return_offsets_mapping=True, return_tensors="pt")
    offsets = enc.pop("offset_mapping")[0]
    assert enc["token_type_ids"].max() == 1  # the pair template marks the context
    with torch.no_grad():
        out = model(**enc)
    in_context = torch.tensor([sid == 1 for sid in enc.sequence_ids(0)])
    start = out.start_logits[0].masked_fill(~in_context, float("-inf"))
    end = out.end_logits[0].masked_fill(~in_context, float("-inf"))
    scores = start[:, None] + end[None, :]
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).tril(-1), float("-inf"))
    s, e = divmod(int(scores.argmax()), scores.shape[1])
    answer = context[int(offsets[s][0]) : int(offsets[e][1])]
    assert answer and answer in context and s <= e


def test_feature_extraction(tokenizer):
    model = encoder(swapformer.EncoderModel, tokenizer)
    features = pipeline("feature-extraction", model=model, tokenizer=tokenizer)(
        "the cat sat", return_tensors=True
    )
    ids = tokenizer("the cat sat", return_tensors="pt")
    with torch.no_grad():
        direct = model(**ids).last_hidden_state
    torch.testing.assert_close(features, direct)
