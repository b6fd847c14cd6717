"""transformers' own contract, held against live transformers models where one exists (Llama).

generate() leaves the parameters alone (fused AdamW, inference_mode); loading fills every missing
weight; the causal-LM loss takes `shift_labels` as transformers' does (`num_items_in_batch` under
Trainer: tests/heads/test_trainer.py); the cache argument is `cache`, with `past_key_values=` /
`cache_params=` deprecated as Llama deprecates them; `cache_position` and `logits_to_keep` as in
Llama; gradient checkpointing drops the cache with Llama's warning; bad seq2seq labels are reported
as labels.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import slice_logits_to_keep

import swapformer

from conftest import LM_CLASSES, VOCAB, build, max_diff, padded_batch, tiny_config

CACHED_CLASSES = {  # {class name: (arch, class)} for the models that take a cache
    cls.__name__: (arch, cls)
    for arch, classes in {
        "decoder": (
            swapformer.DecoderModel,
            swapformer.DecoderForCausalLM,
            swapformer.DecoderForSequenceClassification,
        ),
        "seq2seq": (swapformer.Seq2SeqModel, swapformer.Seq2SeqForConditionalGeneration),
    }.items()
    for cls in classes
}
ENCODER_CLASSES = (
    swapformer.EncoderModel,
    swapformer.EncoderForMaskedLM,
    swapformer.EncoderForSequenceClassification,
    swapformer.EncoderForTokenClassification,
    swapformer.EncoderForQuestionAnswering,
)
ALL_CLASSES = {**{cls.__name__: ("encoder", cls) for cls in ENCODER_CLASSES}, **CACHED_CLASSES}


def lm_batch(arch, batch=3):
    ids, mask = padded_batch(batch=batch, padding="left" if arch == "decoder" else "right")
    labels = ids.masked_fill(mask == 0, -100)
    out = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if arch == "seq2seq":
        out["labels"] = labels[:, :5]
    return out


def tiny_llama():
    """transformers' Llama at the size of conftest's tiny decoder, with 2 key/value heads."""
    torch.manual_seed(0)
    ours = tiny_config("decoder")
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    config = LlamaConfig(
        **{name: getattr(ours, name) for name in sizes}, num_key_value_heads=2, pad_token_id=0
    )
    return LlamaForCausalLM(config).eval()


def generate_a_few(model, batch):
    return model.generate(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
    )


# generate() and the parameters under a user's optimizer (issue 10, items 5 and 2) -----------------


def lora(model, arch, targets=("q_proj", "v_proj", "up_proj", "o_proj")):
    from peft import LoraConfig, get_peft_model

    task = "CAUSAL_LM" if arch == "decoder" else "SEQ_2_SEQ_LM"
    return get_peft_model(model, LoraConfig(r=4, target_modules=list(targets), task_type=task))


def parameter_layout(model):
    return {n: (id(p), p.data_ptr(), p.stride(), p.is_inference()) for n, p in model.named_parameters()}


def train_with_fused_adamw(arch, *, generate_midway: bool, use_lora: bool, steps=(3, 3)):
    """Train `steps[0]` steps, optionally generate (eval mode), train `steps[1]` more; dropout 0."""
    model = build(LM_CLASSES[arch], tiny_config(arch))
    if use_lora:
        model = lora(model, arch)
    batch = lm_batch(arch)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)

    def train(n):
        model.train()
        for _ in range(n):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    train(steps[0])
    layout = parameter_layout(model)
    if generate_midway:
        model.eval()
        generate_a_few(model, batch)
    assert parameter_layout(model) == layout  # same objects, storage and strides
    train(steps[1])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_generate_mid_training_leaves_fused_adamw_exact(arch, use_lora, report):
    plain = train_with_fused_adamw(arch, generate_midway=False, use_lora=use_lora)
    with_generate = train_with_fused_adamw(arch, generate_midway=True, use_lora=use_lora)
    worst = max(max_diff(plain[n], with_generate[n]) for n in plain)
    report(f"{arch} {'lora' if use_lora else 'full'}: max weight diff with / without generate", worst)
    assert worst == 0.0


def seq2seq_trainer_weights(tmp_path, predict_with_generate: bool):
    """Seq2SeqTrainer with transformers' fused AdamW, evaluating (with or without generate) every 2 steps."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    model = build(swapformer.Seq2SeqForConditionalGeneration, tiny_config("seq2seq"))
    batch = lm_batch("seq2seq")
    rows = [{k: v[i] for k, v in batch.items()} for i in range(3)]
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / str(predict_with_generate)),
        per_device_train_batch_size=3,
        per_device_eval_batch_size=3,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        predict_with_generate=predict_with_generate,
        generation_max_length=4,
        optim="adamw_torch_fused",
        learning_rate=1e-2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    # with compute_metrics, evaluation makes predictions (generate() when predict_with_generate)
    metrics = lambda prediction: {"n": float(len(prediction.predictions))}  # noqa: E731
    Seq2SeqTrainer(
        model=model, args=args, train_dataset=rows, eval_dataset=rows, compute_metrics=metrics
    ).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_seq2seq_trainer_predict_with_generate_trains_as_without(tmp_path, report):
    """The issue's case: Seq2SeqTrainer, predict_with_generate=True, transformers' fused AdamW."""
    plain = seq2seq_trainer_weights(tmp_path, predict_with_generate=False)
    generating = seq2seq_trainer_weights(tmp_path, predict_with_generate=True)
    worst = max(max_diff(plain[n], generating[n]) for n in plain)
    report("max weight diff, predict_with_generate True vs False", worst)
    assert worst == 0.0


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_generate_under_inference_mode_then_train(arch, use_lora):
    model = build(LM_CLASSES[arch], tiny_config(arch))
    if use_lora:
        model = lora(model, arch)
    batch = lm_batch(arch)
    with torch.inference_mode():
        generate_a_few(model, batch)
    inference = [n for n, p in model.named_parameters() if p.is_inference()]
    assert not inference, f"inference tensors after generate: {inference[:5]}"
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model(**batch).loss.backward()
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, trainable))


# Loading with missing keys (item 3) --------------------------------------------------------------


def saved_checkpoint(name, config_overrides, tmp_path):
    arch, cls = ALL_CLASSES[name]
    model = build(cls, tiny_config(arch, **config_overrides))
    folder = tmp_path / name
    model.save_pretrained(folder)
    return cls, folder, load_file(os.path.join(folder, "model.safetensors"))


def tied_and_shared_keys(keys):
    return [k for k in keys if "embed_tokens" in k or "shared" in k or "lm_head" in k]


def missing_subsets(keys):
    keys = sorted(keys)
    subsets = {"all": keys, "none": []}
    for k in tied_and_shared_keys(keys):
        subsets[k] = [k]
    subsets["every third"] = keys[::3]
    return subsets


def check_initialised(model, saved, fresh):
    """Loaded tensors hold the saved values; missing parameters the initialiser's (zeros for biases,
    ones for norms, std initializer_range for matrices); buffers those of a model built afresh."""
    config = model.config
    fresh_buffers = dict(fresh.named_buffers())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        assert tensor.device.type == "cpu", f"{name} is on {tensor.device}"
        assert torch.isfinite(tensor).all(), f"{name} holds non-finite values"
        if name in saved:
            assert torch.equal(tensor, saved[name]), f"{name} was loaded wrong"
            continue
        if name in fresh_buffers:
            assert torch.equal(tensor, fresh_buffers[name]), f"buffer {name} differs from a fresh model's"
            continue
        if name.endswith("bias"):
            assert not tensor.any(), f"{name}: a missing bias is initialised to zeros"
        elif "norm" in name:
            assert torch.all(tensor == 1), f"{name}: a missing norm weight is initialised to ones"
        else:
            std = float(tensor.detach().std())
            assert 0.7 * config.initializer_range < std < 1.3 * config.initializer_range, f"{name}: std {std}"


@pytest.mark.parametrize(
    "name, overrides",
    [(n, {}) for n in ALL_CLASSES]
    + [
        ("DecoderForCausalLM", {"tie_word_embeddings": False}),
        ("Seq2SeqForConditionalGeneration", {"tie_word_embeddings": False}),
        ("Seq2SeqForConditionalGeneration", {"shared_embeddings": False, "tie_word_embeddings": False}),
        ("Seq2SeqModel", {"shared_embeddings": False}),
        ("Seq2SeqForConditionalGeneration", {"position_embedding_type": "relative_bias"}),
        ("EncoderForSequenceClassification", {"position_embedding_type": "rope", "type_vocab_size": 2}),
    ],
)
def test_every_missing_weight_is_materialised_initialised_and_reported(name, overrides, tmp_path):
    cls, folder, state = saved_checkpoint(name, overrides, tmp_path)
    for label, dropped in missing_subsets(state).items():
        kept = {k: v for k, v in state.items() if k not in dropped}
        save_file(kept, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        model, info = cls.from_pretrained(folder, output_loading_info=True)
        assert set(dropped) <= set(info["missing_keys"]), (label, set(dropped) - set(info["missing_keys"]))
        assert not set(info["missing_keys"]) & set(kept), label
        check_initialised(model, kept, cls._from_config(copy.deepcopy(model.config)))
        for target, source in model.all_tied_weights_keys.items():
            assert model.get_parameter(target) is model.get_parameter(source), (label, target, source)
        if getattr(model.config, "shared_embeddings", False):
            base = getattr(model, "model", model)
            assert base.encoder.embed_tokens.weight is base.shared.weight is base.decoder.embed_tokens.weight
        ids, mask = padded_batch()
        with torch.no_grad():
            inputs = dict(input_ids=ids, attention_mask=mask)
            if ALL_CLASSES[name][0] == "seq2seq":
                inputs["decoder_input_ids"] = ids[:, :4]
            out = model(**inputs)
        assert all(torch.isfinite(v).all() for v in out.values() if torch.is_tensor(v)), label


# Base-model inputs through the heads' **kwargs (issue 12, item 5) -------------------------------


@pytest.mark.parametrize("name", sorted(ALL_CLASSES))
def test_misspelt_keyword_is_a_type_error_and_base_inputs_reach_the_base_model(name):
    """A head passes its base model's inputs on as **kwargs. A misspelt keyword still fails (a
    TypeError naming it; transformers' own heads would ignore it), with the encoder output given too
    (when the encoder does not run); the inputs that pass through arrive (hidden states, packing)."""
    arch, model_class = ALL_CLASSES[name]
    model = build(model_class, tiny_config(arch))
    ids, mask = padded_batch()
    inputs = dict(input_ids=ids, attention_mask=mask)
    if arch == "seq2seq":
        inputs["decoder_input_ids"] = ids[:, :4]
    with torch.no_grad(), pytest.raises(TypeError, match="output_hiden_states"):
        model(**inputs, output_hiden_states=True)
    if arch == "seq2seq":
        encoder_outputs = model.get_encoder()(ids, attention_mask=mask)
        with torch.no_grad(), pytest.raises(TypeError, match="seq_ids"):
            model(**inputs, encoder_outputs=encoder_outputs, seq_ids=None)
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    hidden = out.encoder_hidden_states if arch == "seq2seq" else out.hidden_states
    assert len(hidden) == 3
    if arch == "seq2seq":
        return
    with torch.no_grad():  # one packed row of two sequences (4 + 5 tokens), marked in two ways
        by_positions = model(input_ids=ids[:1], position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]))
        bounds = torch.tensor([0, 4, 9])
        by_bounds = model(input_ids=ids[:1], cu_seq_lens_q=bounds, cu_seq_lens_k=bounds)
        whole = model(input_ids=ids[:1])
    first = (lambda o: o[0]) if name != "EncoderForQuestionAnswering" else (lambda o: o.start_logits)
    assert max_diff(first(by_positions), first(by_bounds)) <= 1e-5
    assert max_diff(first(by_bounds), first(whole)) > 1e-3


# {swapformer class: transformers' class of the same family and head}
COUNTERPARTS = {
    "EncoderModel": "BertModel",
    "EncoderForMaskedLM": "BertForMaskedLM",
    "EncoderForSequenceClassification": "BertForSequenceClassification",
    "EncoderForTokenClassification": "BertForTokenClassification",
    "EncoderForQuestionAnswering": "BertForQuestionAnswering",
    "DecoderModel": "LlamaModel",
    "DecoderForCausalLM": "LlamaForCausalLM",
    "DecoderForSequenceClassification": "LlamaForSequenceClassification",
    "Seq2SeqModel": "BartModel",
    "Seq2SeqForConditionalGeneration": "BartForConditionalGeneration",
}
# BERT's inputs for BERT used as a cross-attending decoder, which swapformer's encoder is not
NOT_TAKEN = {"encoder_hidden_states", "encoder_attention_mask", "cache", "use_cache"}


def named_parameters(forward, kind=None) -> list[str]:
    params = list(inspect.signature(forward).parameters.values())[1:]  # without self
    return [p.name for p in params if p.kind is not p.VAR_KEYWORD and (kind is None or p.kind is kind)]


@pytest.mark.parametrize("name", list(COUNTERPARTS))
def test_forward_takes_the_parameters_of_its_transformers_counterpart(name):
    """Every named parameter of transformers' head of the same family (BERT, Llama, BART) is a named
    parameter of swapformer's, in transformers' positional order for BERT and Llama (positional callers
    get the same meaning); swapformer's own input `global_attention_mask` is named too (Trainer keeps
    only the dataset columns forward names, generate() refuses keywords it neither names nor knows),
    and the other base-model keywords are names transformers' generate() accepts by itself
    (`TransformersKwargs`). The signature is the function's own, not one a decorator wrote."""
    from transformers.utils.generic import TransformersKwargs

    from swapformer.modeling.heads.task_heads import HeadKwargs

    ours = ALL_CLASSES[name][1].forward
    theirs = getattr(transformers, COUNTERPARTS[name]).forward
    expected = [n for n in named_parameters(theirs) if not (name.startswith("Encoder") and n in NOT_TAKEN)]
    assert set(expected) <= set(named_parameters(ours)), sorted(set(expected) - set(named_parameters(ours)))
    if not name.startswith("Seq2Seq"):  # swapformer's seq2seq has decoder_position_ids 5th, BART has none
        positional = named_parameters(ours, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        assert positional[: len(expected)] == expected
    params = inspect.signature(ours).parameters
    assert params["global_attention_mask"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["global_attention_mask"].default is None
    assert HeadKwargs.__optional_keys__ <= TransformersKwargs.__optional_keys__
    assert not hasattr(ours, "__wrapped__") and not hasattr(ours, "__signature__")


def test_encoder_half_names_every_base_input_for_generate():
    """generate() hands an encoder-decoder's encoder only the model keywords its forward names (when it
    has no `**kwargs`): the encoder half names global tokens, packing inputs and output flags."""
    from swapformer.modeling.heads.seq2seq_stack import Seq2SeqStack
    from swapformer.modeling.heads.task_heads import BaseModelKwargs

    names = set(named_parameters(Seq2SeqStack.forward))
    assert BaseModelKwargs.__optional_keys__ | {"global_attention_mask", "attention_mask"} <= names


@pytest.mark.parametrize(
    "model_class",
    [
        swapformer.EncoderForSequenceClassification,
        swapformer.EncoderForQuestionAnswering,
        swapformer.DecoderForSequenceClassification,
    ],
)
def test_heads_with_a_mean_loss_refuse_trainer_token_count(model_class):
    """Their loss is a mean over sequences: Trainer must not pass `num_items_in_batch`, and a caller
    who does gets a TypeError naming it."""
    assert model_class.accepts_loss_kwargs is False
    model = build(model_class, tiny_config("decoder" if "Decoder" in model_class.__name__ else "encoder"))
    ids, mask = padded_batch()
    with torch.no_grad(), pytest.raises(TypeError, match="num_items_in_batch"):
        model(input_ids=ids, attention_mask=mask, num_items_in_batch=4)


# Loss keyword arguments (item 9) -----------------------------------------------------------------


def test_shift_labels_as_transformers_causal_lm_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    batch = lm_batch("decoder")
    labels = batch.pop("labels")
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    with torch.no_grad():
        from_labels = model(**batch, labels=labels)
        from_shift = model(**batch, shift_labels=shift)
        both = model(**batch, labels=torch.full_like(labels, 5), shift_labels=shift)  # shift_labels wins
        counted = model(**batch, shift_labels=shift, num_items_in_batch=torch.tensor(7))
    reference = ForCausalLMLoss(from_labels.logits, None, VOCAB, shift_labels=shift)
    torch.testing.assert_close(from_shift.loss, reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(from_labels.loss, reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(both.loss, reference, rtol=0, atol=1e-6)
    summed = ForCausalLMLoss(from_labels.logits, None, VOCAB, shift_labels=shift, num_items_in_batch=7)
    torch.testing.assert_close(counted.loss, summed, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="shift_labels"):
        model(**batch, shift_labels=shift[:, :-1])


def test_causal_lm_loss_shifts_labels_not_logits():
    """The loss of a training step equals transformers' `ForCausalLMLoss` bit for bit (also its
    gradient), and neither its forward nor its backward copies the (B, T, V) logits: transformers
    shifts the labels, and a slice of the logits costs a copy and a zero-filled slice backward, about
    a tenth of a small model's training step."""
    from torch.profiler import profile
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    batch = lm_batch("decoder")
    labels = batch.pop("labels")
    with profile(record_shapes=True) as prof:
        model(**batch, labels=labels).loss.backward()
    out = model(**batch, labels=labels)
    ours = torch.autograd.grad(out.loss, out.logits)[0]
    logits = out.logits.detach().requires_grad_()
    reference = ForCausalLMLoss(logits, labels, VOCAB)
    reference.backward()
    assert torch.equal(out.loss, reference) and torch.equal(ours, logits.grad)
    copies = {"aten::copy_", "aten::clone", "aten::slice_backward", "aten::contiguous", "aten::index"}
    logits_shaped = [
        (e.name, e.input_shapes)
        for e in prof.events()
        if e.name in copies and any(list(s[-1:]) == [VOCAB] and len(s) == 3 for s in e.input_shapes if s)
    ]
    assert not logits_shaped, logits_shaped


# Cache argument names (item 10) ------------------------------------------------------------------


def decode_inputs(arch, model):
    """A prompt, a cache filled by it, and the next token's inputs (for a cache-reading forward)."""
    ids, mask = padded_batch(batch=2, padding="left" if arch == "decoder" else "right")
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True, **seq2seq_prompt(arch, ids)).cache
    nxt = torch.tensor([[5], [6]])
    if arch == "decoder":
        step = dict(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1))
    else:
        step = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=nxt)
    return cache, step


def seq2seq_prompt(arch, ids):
    return {"decoder_input_ids": ids[:, :3]} if arch == "seq2seq" else {}


def first_output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def deprecation_messages(record):
    return [str(w.message) for w in record if issubclass(w.category, FutureWarning)]


def llama_message_for(old_name, class_name):
    """The FutureWarning LlamaForCausalLM gives for past_key_values=, with the names swapped in."""
    llama = tiny_llama()
    ids = torch.tensor([[5, 6, 7]])
    cache = llama(ids, use_cache=True).cache
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        llama(torch.tensor([[8]]), past_key_values=cache)
    (message,) = deprecation_messages(record)
    assert "LlamaForCausalLM.forward" in message and "`past_key_values`" in message
    return message.replace("LlamaForCausalLM", class_name).replace("past_key_values", old_name)


@pytest.mark.parametrize("old_name", ["past_key_values", "cache_params"])
@pytest.mark.parametrize("name", list(CACHED_CLASSES))
def test_old_cache_names_work_and_warn_as_llama(name, old_name):
    arch, cls = CACHED_CLASSES[name]
    model = build(cls, tiny_config(arch))
    cache, step = decode_inputs(arch, model)
    with torch.no_grad():
        expected = first_output(model(**step, cache=copy.deepcopy(cache)))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = first_output(model(**step, **{old_name: copy.deepcopy(cache)}))
    assert torch.equal(got, expected)
    assert deprecation_messages(record) == [llama_message_for(old_name, cls.__name__)]
    # it points at the line above that called the model (Llama's points into torch's module.py)
    assert [(w.filename, w.category) for w in record] == [(__file__, FutureWarning)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")  # Python's default: once per call site
        for _ in range(3):
            model(**step, **{old_name: copy.deepcopy(cache)})
    assert len(deprecation_messages(record)) == 1


@pytest.mark.parametrize("name", list(CACHED_CLASSES))
def test_two_cache_names_at_once_raise(name):
    arch, cls = CACHED_CLASSES[name]
    model = build(cls, tiny_config(arch))
    cache, step = decode_inputs(arch, model)
    for names in (
        ("cache", "past_key_values"),
        ("cache", "cache_params"),
        ("past_key_values", "cache_params"),
    ):
        with pytest.raises(ValueError, match=f"`{names[1]}`.*`{names[0]}`|`{names[0]}`.*`{names[1]}`"):
            model(**step, **{n: cache for n in names})


@pytest.mark.parametrize("name", list(CACHED_CLASSES))
def test_output_past_key_values_reads_cache_with_transformers_warning(name, caplog):
    from transformers.utils import logging as hf_logging

    arch, cls = CACHED_CLASSES[name]
    model = build(cls, tiny_config(arch))
    ids, mask = padded_batch(batch=2)
    out = model(ids, attention_mask=mask, use_cache=True, **seq2seq_prompt(arch, ids))
    assert isinstance(out.cache, DynamicCache) or hasattr(out.cache, "self_attention_cache")
    hf_logging.get_logger("transformers.utils.generic").warning_once.cache_clear()
    hf_logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        assert out.past_key_values is out.cache and out.cache_params is out.cache
    hf_logging.disable_propagation()
    assert "`past_key_values`/`cache_params` are deprecated. Use `cache` instead." in caplog.text


def test_cache_position_is_accepted_as_llama_accepts_it():
    """Llama (5.24) takes cache_position and computes the same logits; so does swapformer, and a
    cache_position that disagrees with the cache is an error instead of being silently ignored."""
    llama = tiny_llama()
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder", position_embedding_type="rope"))
    ids = torch.tensor([[5, 6, 7, 8]])
    for m in (llama, model):
        with torch.no_grad():
            cache = m(ids[:, :3], use_cache=True).cache
            expected = m(ids[:, 3:], cache=copy.deepcopy(cache)).logits
            got = m(ids[:, 3:], cache=copy.deepcopy(cache), cache_position=torch.tensor([3])).logits
            prefill = m(ids, cache_position=torch.arange(4)).logits
        assert torch.equal(got, expected)
        assert torch.equal(prefill, m(ids).logits)
    with pytest.raises(ValueError, match="cache_position"):
        model(ids[:, 3:], cache=copy.deepcopy(cache), cache_position=torch.tensor([7]))
    # encoder-decoder: cache_position counts decoder tokens
    seq2seq = build(swapformer.Seq2SeqForConditionalGeneration, tiny_config("seq2seq"))
    with torch.no_grad():
        cache = seq2seq(ids, decoder_input_ids=ids[:, :3], use_cache=True).cache
        expected = seq2seq(ids, decoder_input_ids=ids[:, 3:], cache=copy.deepcopy(cache)).logits
        got = seq2seq(
            ids, decoder_input_ids=ids[:, 3:], cache=copy.deepcopy(cache), cache_position=torch.tensor([3])
        )
    assert torch.equal(got.logits, expected)
    with pytest.raises(ValueError, match="cache_position"):
        seq2seq(
            ids, decoder_input_ids=ids[:, 3:], cache=copy.deepcopy(cache), cache_position=torch.tensor([0])
        )


@pytest.mark.parametrize(
    "keep",
    [0, 1, 3, torch.tensor([0, 2]), torch.tensor([[1, 3], [0, 4], [2, 2]]), "bool"],
    ids=["0", "1", "3", "1d", "2d-int", "2d-bool"],
)
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_logits_to_keep_as_llama(arch, keep):
    model = build(LM_CLASSES[arch], tiny_config(arch))
    llama = tiny_llama()
    ids, mask = padded_batch(batch=3, length=6, padding="none")
    if isinstance(keep, str):
        keep = torch.rand(3, 6, generator=torch.Generator().manual_seed(0)) > 0.5
    inputs = dict(input_ids=ids, decoder_input_ids=ids) if arch == "seq2seq" else dict(input_ids=ids)
    with torch.no_grad():
        full, kept = model(**inputs).logits, model(**inputs, logits_to_keep=keep).logits
        llama_full, llama_kept = llama(ids).logits, llama(ids, logits_to_keep=keep).logits
    assert max_diff(llama_kept, slice_logits_to_keep(llama_full, keep)) <= 1e-5  # the reference rule
    assert kept.shape[:-1] == llama_kept.shape[:-1]
    assert max_diff(kept, slice_logits_to_keep(full, keep)) <= 1e-5


# Gradient checkpointing with a cache, seq2seq labels (item 21) -----------------------------------


def gc_use_cache_warning(model, inputs, caplog):
    from transformers.utils import logging as hf_logging

    model.activation_checkpointing_enable()
    model.train()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            out = model(**inputs, use_cache=True)
    finally:
        hf_logging.disable_propagation()
    return out, caplog.text


@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_checkpointing_with_use_cache_warns_as_llama(arch, caplog):
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers.utils.generic").warning_once.cache_clear()
    _, llama_text = gc_use_cache_warning(tiny_llama(), dict(input_ids=torch.tensor([[5, 6, 7]])), caplog)
    expected = "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`."
    assert expected in llama_text
    model = build(LM_CLASSES[arch], tiny_config(arch))
    ids, mask = padded_batch()
    out, text = gc_use_cache_warning(model, dict(input_ids=ids, **seq2seq_prompt(arch, ids)), caplog)
    assert expected in text
    assert out.cache is None


def test_seq2seq_labels_outside_the_vocabulary_are_named_labels():
    model = build(swapformer.Seq2SeqForConditionalGeneration, tiny_config("seq2seq"))
    ids, mask = padded_batch()
    labels = ids[:, :5].clone()
    labels[0, 2] = VOCAB + 3
    with pytest.raises(ValueError) as error:
        model(ids, attention_mask=mask, labels=labels)
    message = str(error.value)
    assert "labels" in message and f"{VOCAB + 3}" in message and "decoder_input_ids" not in message
    labels[0, 2] = -5  # only -100 marks ignored positions
    with pytest.raises(ValueError, match="labels"):
        model(ids, attention_mask=mask, labels=labels)
