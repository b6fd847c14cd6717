"""Heads, outputs, tying, resizing, activation checkpointing, device maps and losses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import swapformer
from swapformer import cpu_linear
from swapformer.modeling.heads.losses import token_cross_entropy

from conftest import ARCHS, BASE_CLASSES, LM_CLASSES, build, max_diff, padded_batch, tiny_config


def lm_inputs(arch, ids, mask):
    labels = ids.masked_fill(mask == 0, -100)
    if arch == "seq2seq":
        return dict(input_ids=ids, attention_mask=mask, labels=labels[:, :6])
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize(
    "auto, config_arch, model_class",
    [
        (AutoModel, "encoder", swapformer.EncoderModel),
        (AutoModelForMaskedLM, "encoder", swapformer.EncoderForMaskedLM),
        (AutoModelForSequenceClassification, "encoder", swapformer.EncoderForSequenceClassification),
        (AutoModelForTokenClassification, "encoder", swapformer.EncoderForTokenClassification),
        (AutoModelForQuestionAnswering, "encoder", swapformer.EncoderForQuestionAnswering),
        (AutoModel, "decoder", swapformer.DecoderModel),
        (AutoModelForCausalLM, "decoder", swapformer.DecoderForCausalLM),
        (AutoModelForSequenceClassification, "decoder", swapformer.DecoderForSequenceClassification),
        (AutoModel, "seq2seq", swapformer.Seq2SeqModel),
        (AutoModelForSeq2SeqLM, "seq2seq", swapformer.Seq2SeqForConditionalGeneration),
    ],
)
def test_auto_classes_build_and_reload_every_model(auto, config_arch, model_class, tmp_path):
    model = auto.from_config(tiny_config(config_arch))
    assert type(model) is model_class
    model.save_pretrained(tmp_path)
    again = auto.from_pretrained(tmp_path)
    assert type(again) is model_class
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("arch", ARCHS)
def test_return_dict_false_gives_loss_first_tuple(arch):
    model = build(LM_CLASSES[arch], tiny_config(arch))
    ids, mask = padded_batch()
    inputs = lm_inputs(arch, ids, mask)
    as_dict = model(**inputs)
    as_tuple = model(**inputs, return_dict=False)
    assert isinstance(as_tuple, tuple)
    assert torch.equal(as_tuple[0], as_dict.loss) and torch.equal(as_tuple[1], as_dict.logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_states_and_attentions_count(arch):
    config = tiny_config(arch, num_hidden_layers=3)
    model = build(BASE_CLASSES[arch], config, attn="sdpa")
    ids, mask = padded_batch()
    kw = dict(decoder_input_ids=ids[:, :4]) if arch == "seq2seq" else {}
    out = model(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True, **kw)
    hidden = out.encoder_hidden_states if arch == "seq2seq" else out.hidden_states
    attns = out.encoder_attentions if arch == "seq2seq" else out.attentions
    assert len(hidden) == 4 and len(attns) == 3
    last = out.encoder_last_hidden_state if arch == "seq2seq" else out.last_hidden_state
    assert torch.equal(hidden[-1], last)
    if arch == "seq2seq":
        assert len(out.decoder_hidden_states) == config.decoder_layers + 1 and len(out.cross_attentions) == 3


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_activation_checkpointing_gives_the_same_gradients(arch, reentrant):
    """T5's relative bias lives in the lowered masks: its gradient (and every other) is the same with
    reentrant and non-reentrant checkpointing as without."""
    config = tiny_config(arch, position_embedding_type="relative_bias")
    ids, mask = padded_batch()
    grads = []
    for checkpointing in (False, True):
        model = build(LM_CLASSES[arch], config, attn="sdpa")
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": reentrant}
            )
            assert all(
                layer.gradient_checkpointing
                for layer in model.modules()
                if isinstance(layer, swapformer.modeling.core.layers.Block)
            )
        model(**lm_inputs(arch, ids, mask)).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert any("relative_attention_bias" in n for n in grads[0])
    assert max(max_diff(grads[0][n], grads[1][n]) for n in grads[0]) <= 1e-6


@pytest.mark.parametrize("arch", ARCHS)
def test_tied_and_untied_embeddings(arch, tmp_path):
    for tied in (True, False):
        model = build(LM_CLASSES[arch], tiny_config(arch, tie_word_embeddings=tied))
        out_emb, in_emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        if arch == "seq2seq":
            in_emb = model.model.decoder.embed_tokens.weight
        assert (out_emb is in_emb) == tied
        model.save_pretrained(tmp_path / str(tied))
        again = type(model).from_pretrained(tmp_path / str(tied))
        assert (again.get_output_embeddings().weight is again.get_input_embeddings().weight) == tied
        assert torch.equal(again.get_output_embeddings().weight, out_emb)


def test_seq2seq_shared_and_separate_embeddings(tmp_path):
    shared = build(swapformer.Seq2SeqForConditionalGeneration, tiny_config("seq2seq"))
    m = shared.model
    assert m.encoder.embed_tokens is m.shared and m.decoder.embed_tokens is m.shared
    separate = build(
        swapformer.Seq2SeqForConditionalGeneration,
        tiny_config("seq2seq", shared_embeddings=False, tie_word_embeddings=False),
    )
    s = separate.model
    assert s.shared is None and s.encoder.embed_tokens is not s.decoder.embed_tokens
    for model, name in ((shared, "shared"), (separate, "separate")):
        model.save_pretrained(tmp_path / name)
        again = type(model).from_pretrained(tmp_path / name, attn_implementation="eager")
        ids, mask = padded_batch()
        with torch.no_grad():
            a = model(ids, attention_mask=mask, decoder_input_ids=ids[:, :4]).logits
            b = again.eval()(ids, attention_mask=mask, decoder_input_ids=ids[:, :4]).logits
        assert torch.equal(a, b), name
    again = type(shared).from_pretrained(tmp_path / "shared")
    assert again.model.encoder.embed_tokens.weight is again.model.shared.weight


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shared", [True, False])
def test_resize_token_embeddings(arch, shared):
    if arch != "seq2seq" and not shared:
        pytest.skip("shared_embeddings is a seq2seq option")
    extra = {} if arch != "seq2seq" else dict(shared_embeddings=shared)
    model = build(LM_CLASSES[arch], tiny_config(arch, **extra))
    old = model.get_input_embeddings().weight.detach().clone()
    model.resize_token_embeddings(120)
    assert model.config.vocab_size == 120
    assert model.get_input_embeddings().weight.shape[0] == 120
    assert model.get_output_embeddings().weight.shape[0] == 120
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight or arch == "seq2seq"
    assert torch.equal(model.get_input_embeddings().weight[: old.shape[0]], old)
    if arch == "seq2seq":
        assert model.model.decoder.embed_tokens.weight.shape[0] == 120
        assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    ids = torch.tensor([[5, 118, 119, 7]])
    kw = dict(decoder_input_ids=ids) if arch == "seq2seq" else {}
    assert model(ids, **kw).logits.shape[-1] == 120


def test_no_split_modules_keep_blocks_whole():
    from accelerate import infer_auto_device_map

    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder", num_hidden_layers=4, hidden_size=64))
    assert model._no_split_modules == {"Block"}
    size = sum(p.numel() * 4 for p in model.parameters())
    device_map = infer_auto_device_map(
        model,
        max_memory={0: size // 3, 1: size // 3, "cpu": size * 2},
        no_split_module_classes=model._no_split_modules,
    )
    assert len(set(device_map.values())) > 1, device_map
    for name in device_map:
        assert ".self_attn" not in name and ".mlp" not in name, f"a Block was split: {device_map}"


def test_device_map_auto_offloads_whole_blocks_and_still_computes_the_same(tmp_path):
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder", num_hidden_layers=4, hidden_size=64))
    model.save_pretrained(tmp_path / "model")
    size = sum(p.numel() * 4 for p in model.parameters())
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model",
        device_map="auto",
        max_memory={"cpu": size // 2},
        offload_folder=tmp_path / "offload",
        attn_implementation="eager",
    )
    placement = loaded.hf_device_map
    assert "disk" in placement.values() and "cpu" in placement.values(), placement
    assert not any(".self_attn" in name or ".mlp" in name for name in placement), placement
    ids, _ = padded_batch(padding="none")
    with torch.no_grad():
        assert max_diff(loaded(ids).logits, model(ids).logits) <= 1e-6


class TestLosses:
    def test_causal_loss_shifts_once(self):
        model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
        ids, mask = padded_batch()
        labels = ids.masked_fill(mask == 0, -100)
        out = model(ids, attention_mask=mask, labels=labels)
        manual = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        torch.testing.assert_close(out.loss, manual)

    def test_seq2seq_loss_does_not_shift_twice(self):
        config = tiny_config("seq2seq")
        model = build(swapformer.Seq2SeqForConditionalGeneration, config)
        ids, mask = padded_batch()
        labels = ids[:, :6].clone()
        labels[1, 4:] = -100
        out = model(ids, attention_mask=mask, labels=labels)
        decoder_inputs = torch.cat([torch.full((3, 1), config.decoder_start_token_id), labels[:, :-1]], dim=1)
        decoder_inputs = decoder_inputs.masked_fill(decoder_inputs == -100, config.pad_token_id)
        same = model(ids, attention_mask=mask, decoder_input_ids=decoder_inputs)
        torch.testing.assert_close(out.logits, same.logits)
        manual = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, config.vocab_size), labels.reshape(-1), ignore_index=-100
        )
        torch.testing.assert_close(out.loss, manual)
        assert torch.equal(model.prepare_decoder_input_ids_from_labels(labels), decoder_inputs)

    def test_missing_decoder_start_token_is_a_clear_error(self):
        model = build(
            swapformer.Seq2SeqForConditionalGeneration, tiny_config("seq2seq", decoder_start_token_id=None)
        )
        ids, _ = padded_batch()
        with pytest.raises(ValueError, match="decoder_start_token_id=None"):
            model(ids, labels=ids)

    def test_num_items_in_batch_makes_accumulation_equal_one_batch(self):
        """Two micro-batches with different label counts, summed, give the gradient of the union."""
        model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
        ids, mask = padded_batch(batch=4, padding="right")
        mask[3, 2:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        big = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        total = int((labels[:, 1:] != -100).sum())
        for part in (slice(0, 2), slice(2, 4)):
            model(
                ids[part], attention_mask=mask[part], labels=labels[part], num_items_in_batch=total
            ).loss.backward()
        assert max(max_diff(big[n], p.grad) for n, p in model.named_parameters()) <= 1e-6

    def test_token_cross_entropy_with_count(self):
        logits = torch.randn(2, 5, 7)
        labels = torch.tensor([[1, 2, -100, 3, 4], [0, -100, -100, -100, 6]])
        mean = token_cross_entropy(logits, labels, shift=False)
        summed = token_cross_entropy(logits, labels, shift=False, num_items_in_batch=torch.tensor(6))
        torch.testing.assert_close(mean, summed)


@pytest.mark.parametrize(
    "problem, labels",
    [
        ("single_label_classification", torch.tensor([0, 2, 1])),
        ("regression", torch.tensor([0.5, -1.0, 2.0])),
        ("multi_label_classification", torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0]])),
        (None, torch.tensor([0, 2, 1])),  # the problem inferred from the labels, as transformers does
        (None, torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0]])),
    ],
)
@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_sequence_classification_losses_equal_transformers(arch, problem, labels):
    """Replaces a test that only checked the loss was a finite scalar: the loss of the pooled logits
    equals transformers' `ForSequenceClassificationLoss` on the same logits, for every problem type."""
    from transformers.loss.loss_utils import ForSequenceClassificationLoss

    num_labels = 1 if problem == "regression" else 3
    config = tiny_config(arch, num_labels=num_labels, problem_type=problem)
    model_class = (
        swapformer.EncoderForSequenceClassification
        if arch == "encoder"
        else swapformer.DecoderForSequenceClassification
    )
    model = build(model_class, config)
    ids, mask = padded_batch(padding="left" if arch == "decoder" else "right")
    out = model(ids, attention_mask=mask, labels=labels)
    assert out.logits.shape == (3, num_labels)
    reference = ForSequenceClassificationLoss(labels, out.logits, copy.deepcopy(model.config))
    torch.testing.assert_close(out.loss, reference, rtol=0, atol=1e-6)


def test_decoder_classification_reads_the_last_real_token():
    """Left- and right-padded copies of a row classify like the unpadded row."""
    model = build(swapformer.DecoderForSequenceClassification, tiny_config("decoder", num_labels=3))
    row = torch.tensor([[5, 6, 7, 8]])
    ref = model(row).logits
    left = model(torch.tensor([[0, 0, 5, 6, 7, 8]]), attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]])).logits
    right = model(
        torch.tensor([[5, 6, 7, 8, 0, 0]]), attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]])
    ).logits
    assert max_diff(ref, left) <= 1e-5 and max_diff(ref, right) <= 1e-5


def test_question_answering_and_token_classification_losses_equal_transformers():
    """Replaces a test that only checked shapes and a finite loss: the span loss (positions past the
    end ignored) and the token-classification loss (mean, and summed over `num_items_in_batch`) equal
    transformers' `ForQuestionAnsweringLoss` / `ForTokenClassification` on the same logits."""
    from transformers.loss.loss_utils import ForQuestionAnsweringLoss, ForTokenClassification

    ids, mask = padded_batch()
    qa = build(swapformer.EncoderForQuestionAnswering, tiny_config("encoder"))
    start, end = torch.tensor([1, 2, 50]), torch.tensor([3, 4, 50])
    out = qa(ids, attention_mask=mask, start_positions=start, end_positions=end)
    assert out.start_logits.shape == (3, 9)
    reference = ForQuestionAnsweringLoss(out.start_logits, out.end_logits, start, end)
    torch.testing.assert_close(out.loss, reference, rtol=0, atol=1e-6)
    tok = build(swapformer.EncoderForTokenClassification, tiny_config("encoder", num_labels=5))
    labels = torch.randint(0, 5, ids.shape).masked_fill(mask == 0, -100)
    for count in (None, torch.tensor(11)):
        out = tok(ids, attention_mask=mask, labels=labels, num_items_in_batch=count)
        assert out.logits.shape == (3, 9, 5)
        reference = ForTokenClassification(out.logits, labels, tok.config, num_items_in_batch=count)
        torch.testing.assert_close(out.loss, reference, rtol=0, atol=1e-6)


def test_xavier_initializer_is_used():
    normal = swapformer.DecoderModel(tiny_config("decoder", initializer="normal", initializer_range=0.02))
    xavier = swapformer.DecoderModel(tiny_config("decoder", initializer="xavier"))
    w_n, w_x = normal.layers[0].mlp.up_proj.weight, xavier.layers[0].mlp.up_proj.weight
    bound = (6 / sum(w_x.shape)) ** 0.5
    assert w_x.abs().max() <= bound and w_x.abs().max() > 0.5 * bound
    assert abs(float(w_n.std()) - 0.02) < 0.005


def test_peft_lora_on_hf_standard_names():
    from peft import LoraConfig, get_peft_model

    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    peft_model = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    wrapped = [n for n, _ in peft_model.named_modules() if n.endswith("q_proj.lora_A")]
    assert len(wrapped) == model.config.num_hidden_layers
    ids, mask = padded_batch()
    out = peft_model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    assert all(p.grad is not None for n, p in peft_model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("route", ["torch", "onednn"])
@pytest.mark.parametrize(
    "mlp_type,act,bias", [("mlp", "gelu", True), ("gated", "silu", True), ("mlp", "gelu_new", False)]
)
def test_mlp_without_gradients_in_row_chunks_equals_one_pass(mlp_type, act, bias, route, monkeypatch):
    """Without gradients the MLP runs rows a chunk at a time with an in-place activation (no fresh
    whole-sequence intermediate per layer), its projections writing into reused buffers (torch's
    linear route) or called per chunk (the oneDNN route); the result equals one pass. A forward hook
    on a projection turns that off: the hook sees one call with the whole, untouched output."""
    from swapformer.modeling.core import layers as layers
    from swapformer.modeling.cpu import routes as chunking

    config = tiny_config("encoder", mlp_type=mlp_type, hidden_act=act, mlp_bias=bias)
    mlp = layers.MLP(config).eval()
    x = torch.randn(2, 37, config.hidden_size)
    with torch.enable_grad():
        whole = mlp(x).detach()  # the path with gradients: one pass, out-of-place activation
    monkeypatch.setattr(chunking.Seam, "mlp_chunk_bytes", 5 * config.intermediate_size * x.element_size())
    seen = []
    with torch.no_grad(), cpu_linear(route):
        chunked = mlp(x)
        source = mlp.up_proj if mlp.gate_proj is None else mlp.gate_proj
        handle = source.register_forward_hook(lambda module, args, out: seen.append((out, out.clone())))
        hooked = mlp(x)
        handle.remove()
    assert chunked.shape == whole.shape and max_diff(chunked, whole) <= 1e-6
    assert max_diff(hooked, whole) <= 1e-6
    assert len(seen) == 1 and seen[0][0].shape[:-1] == (2, 37)  # one call, the whole output
    assert all(torch.equal(out, copy) for out, copy in seen)


def test_mlp_row_chunks_call_projections_that_are_not_plain_linears(monkeypatch):
    """The chunked MLP writes a projection's output straight into its buffer only for a plain
    `nn.Linear`; a wrapped or subclassed projection (PEFT, quantization) is called as a module."""
    from swapformer.modeling.core import layers as layers
    from swapformer.modeling.cpu import routes as chunking

    class Shifted(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0

    config = tiny_config("encoder")
    mlp = layers.MLP(config).eval()
    shifted = Shifted(config.hidden_size, config.intermediate_size)
    shifted.load_state_dict(mlp.up_proj.state_dict())
    mlp.up_proj = shifted
    x = torch.randn(2, 37, config.hidden_size)
    with torch.enable_grad():
        whole = mlp(x).detach()
    monkeypatch.setattr(chunking.Seam, "mlp_chunk_bytes", 5 * config.intermediate_size * x.element_size())
    with torch.no_grad():
        chunked = mlp(x)
        mlp.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        mlp.up_proj.load_state_dict(shifted.state_dict())
        plain = mlp(x)
    assert max_diff(chunked, whole) <= 1e-6
    assert max_diff(plain, whole) > 1e-3  # the shift matters: the check above can fail
