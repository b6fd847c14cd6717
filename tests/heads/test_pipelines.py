"""transformers pipelines run on swapformer models with a tokenizer built by `tokenizers`."""

from __future__ import annotations

import pytest
import torch
from tokenizers import decoders
from transformers import pipeline

import swapformer

from conftest import bert_style_tokenizer, scramble_, tiny_config, word_tokenizer

WORDS = "the a cat dog sat on mat paris is capital of france where what who ran fast".split()


@pytest.fixture(scope="module")
def tokenizer():
    return bert_style_tokenizer(WORDS, decoder=decoders.WordPiece())


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


@pytest.fixture(scope="module")
def lm_tokenizer():
    """A word-level tokenizer with <s> / </s> / <pad>, left padding, as generation wants."""
    special = dict(pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return word_tokenizer(special, WORDS, decoder=decoder, padding_side="left")


def lm(model_class, arch, tokenizer):
    config = tiny_config(arch, vocab_size=len(tokenizer), position_embedding_type="rope")
    model = model_class(config).eval()
    scramble_(model)
    return model


def test_text_generation_pipeline_batches_left_padded_prompts(lm_tokenizer):
    model = lm(swapformer.DecoderForCausalLM, "decoder", lm_tokenizer)
    generator = pipeline("text-generation", model=model, tokenizer=lm_tokenizer)
    prompts = ["the cat sat on", "paris"]
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    out = generator(prompts, batch_size=2, return_tensors=True, **kw)
    texts = generator(prompts, batch_size=2, **kw)
    padded = []
    for prompt, result, text in zip(prompts, out, texts):
        # left padding inside the batch changes nothing: the same tokens as generate() alone
        alone = model.generate(**lm_tokenizer(prompt, return_tensors="pt"), **kw)[0]
        ids = list(result[0]["generated_token_ids"])
        pads = len(ids) - len(alone)
        assert ids[:pads] == [lm_tokenizer.pad_token_id] * pads and ids[pads:] == alone.tolist()
        padded.append(pads)
        assert text[0]["generated_text"].startswith(prompt)
    assert padded == [0, 3]  # the short prompt really was left-padded in the batch


def test_seq2seq_generation_end_to_end_without_the_removed_pipeline(lm_tokenizer):
    """transformers 5.x removed text2text-generation / summarization / translation (REMOVED_TASKS)
    and offers no seq2seq text pipeline; the model generates from tokenized text and decodes."""
    model = lm(swapformer.Seq2SeqForConditionalGeneration, "seq2seq", lm_tokenizer)
    for task in ("text2text-generation", "summarization", "translation"):
        with pytest.raises(KeyError, match=f"{task} has been removed"):
            pipeline(task, model=model, tokenizer=lm_tokenizer)
    batch = lm_tokenizer(["the cat sat on the mat", "paris"], padding=True, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    texts = lm_tokenizer.batch_decode(out, skip_special_tokens=True)
    assert len(texts) == 2 and all(len(t.split()) == 5 for t in texts)
    # each row decodes as it does alone: padding does not leak into the encoder
    alone = model.generate(**lm_tokenizer(["paris"], return_tensors="pt"), max_new_tokens=5, min_new_tokens=5)
    assert torch.equal(alone[0], out[1])
