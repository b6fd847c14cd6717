"""PEFT's prompt learning and layer selection on swapformer's models (issue 31, PEFT items).

- Prefix tuning on the bare encoder: `EncoderModel` takes the key/value prefix PEFT passes
  (`past_key_values`) as BertModel does, and gives BertModel's outputs and gradients on a converted BERT.
- `layers_to_transform` needs `layers_pattern="layers"` on the bare models, as on LlamaModel; with it
  exactly the chosen layer is adapted on every architecture.
- generate() under a prompt-learning adapter is refused before the first step with what works instead,
  where PEFT's generation would decode wrongly; the encoder-decoder's prompt tuning, which decodes
  correctly, matches step-by-step decoding without a cache.
"""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from transformers import BertConfig, BertModel, DynamicCache

import swapformer
from swapformer.conversion import from_hf_model

from conftest import HF_SIZE, build, max_diff, padded_batch, scramble_, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread

TOL = 1e-5
VIRTUAL = 3


def bert_pair(attn: str):
    """A scrambled BertModel (eager) and the swapformer EncoderModel converted from it, on `attn`."""
    config = BertConfig(vocab_size=97, **HF_SIZE, max_position_embeddings=64, attn_implementation="eager")
    bert = BertModel(config)
    scramble_(bert, seed=1)
    bert.eval()
    ours = from_hf_model(bert, swapformer.EncoderModel)
    ours.set_attn_implementation(attn)
    return bert, ours.eval()


def with_prefix(model, state=None):
    """`model` under PEFT prefix tuning (FEATURE_EXTRACTION); the prefix from `state` when given."""
    torch.manual_seed(2)
    config = peft.PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=VIRTUAL)
    wrapped = peft.get_peft_model(model, config)
    if state is not None:
        wrapped.prompt_encoder.load_state_dict(state)
    return wrapped


def encoder_prefix_outputs(attn: str, grad: bool = False):
    """(BERT's output, ours, ours without the prefix), the real tokens' mask, and both PEFT models."""
    bert, ours = bert_pair(attn)
    ids, mask = padded_batch(padding="right")
    with torch.no_grad():
        plain = ours(ids, attention_mask=mask)
    theirs_peft = with_prefix(bert)
    ours_peft = with_prefix(ours, theirs_peft.prompt_encoder.state_dict())
    with torch.set_grad_enabled(grad), pytest.warns(FutureWarning, match="past_key_values"):  # as BertModel's
        got = ours_peft(input_ids=ids, attention_mask=mask)
        want = theirs_peft(input_ids=ids, attention_mask=mask)
    return want, got, plain, mask, (theirs_peft, ours_peft)


@pytest.mark.parametrize("attn", ["eager", "sdpa", "sparse", "flex_attention"])
def test_prefix_tuning_on_the_bare_encoder_gives_berts_outputs(attn, report):
    want, got, plain, mask, _ = encoder_prefix_outputs(attn)
    diff = max_diff(got.last_hidden_state, want.last_hidden_state, mask)
    report(f"prefix-tuned encoder vs BertModel ({attn})", diff)
    assert diff <= TOL
    assert max_diff(got.pooler_output, want.pooler_output) <= TOL
    # the prefix is read: without it the outputs differ
    assert max_diff(got.last_hidden_state, plain.last_hidden_state, mask) > 1e-2


def test_prefix_gradients_are_berts():
    want, got, _, mask, (theirs_peft, ours_peft) = encoder_prefix_outputs("eager", grad=True)
    weights = torch.randn(want.last_hidden_state.shape, generator=torch.Generator().manual_seed(3))
    for out in (want, got):
        (out.last_hidden_state * weights * mask[..., None]).sum().backward()
    theirs = theirs_peft.prompt_encoder["default"].embedding.weight.grad
    ours = ours_peft.prompt_encoder["default"].embedding.weight.grad
    assert theirs.abs().max() > 0
    assert max_diff(ours, theirs) <= 1e-4 * float(theirs.abs().max())


def prefix_cache(config, batch: int, length: int = VIRTUAL, heads=None) -> DynamicCache:
    g = torch.Generator().manual_seed(4)
    shape = (batch, heads or config.num_key_value_heads, length, config.head_dim)
    cache = DynamicCache()
    for i in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), i)
    return cache


def test_encoder_reads_the_prefix_without_extending_it():
    """BertModel appends the tokens' keys to the cache it is given (a second forward with it would see
    them as prefix); the encoder reads the prefix and leaves the cache as it was."""
    model = build(swapformer.EncoderModel, tiny_config("encoder"))
    ids, mask = padded_batch()
    cache = prefix_cache(model.config, ids.shape[0])
    full_mask = torch.cat([torch.ones(ids.shape[0], VIRTUAL, dtype=mask.dtype), mask], 1)
    with torch.no_grad():
        first = model(ids, attention_mask=full_mask, cache=cache).last_hidden_state
        again = model(ids, attention_mask=full_mask, cache=cache).last_hidden_state
    assert cache.get_seq_length() == VIRTUAL
    assert max_diff(first, again) == 0.0


def test_a_prefix_of_the_wrong_shape_is_refused_with_the_shapes():
    model = build(swapformer.EncoderModel, tiny_config("encoder"))
    ids, _ = padded_batch()
    cache = prefix_cache(model.config, ids.shape[0], heads=2)
    with pytest.raises(ValueError, match=r"shape \(3, 2, 3, 8\).*num_key_value_heads=4"):
        model(ids, cache=cache)
    with pytest.raises(TypeError, match="as a transformers Cache"):
        model(ids, cache=(torch.zeros(1),))


# layers_to_transform ---------------------------------------------------------------------------------


def adapted_layers(model, **options) -> set[str]:
    config = peft.LoraConfig(r=2, target_modules=["self_attn.q_proj"], layers_to_transform=[0], **options)
    wrapped = peft.get_peft_model(model, config)
    return {name.split(".q_proj")[0] for name, _ in wrapped.named_modules() if name.endswith("q_proj.lora_A")}


def llama_model():
    config = transformers.LlamaConfig(vocab_size=97, **HF_SIZE, max_position_embeddings=64)
    return transformers.LlamaModel(config)


BARE = {"encoder": swapformer.EncoderModel, "decoder": swapformer.DecoderModel}
HEADS = {
    "encoder": swapformer.EncoderForSequenceClassification,
    "decoder": swapformer.DecoderForCausalLM,
    "seq2seq": swapformer.Seq2SeqForConditionalGeneration,
}


@pytest.mark.parametrize("arch", list(BARE))
def test_bare_models_need_layers_pattern_as_llamamodel_does(arch):
    """Blocks at the top level (`layers.N`, LlamaModel's layout) are not found by PEFT's default rule."""
    with pytest.raises(ValueError, match="layers_to_transform") as theirs:
        adapted_layers(llama_model())
    with pytest.raises(type(theirs.value), match="layers_to_transform"):
        adapted_layers(build(BARE[arch], tiny_config(arch)))


@pytest.mark.parametrize(
    "model_class,arch",
    [*((cls, arch) for arch, cls in BARE.items()), (swapformer.Seq2SeqModel, "seq2seq")]
    + [(cls, arch) for arch, cls in HEADS.items()],
)
def test_layers_pattern_adapts_exactly_the_chosen_layer(model_class, arch):
    config = tiny_config(arch, num_hidden_layers=3, **({"decoder_layers": 3} if arch == "seq2seq" else {}))
    adapted = adapted_layers(build(model_class, config), layers_pattern="layers")
    prefix = "model." if model_class in HEADS.values() else ""
    halves = ("encoder.", "decoder.") if arch == "seq2seq" else ("",)
    assert adapted == {f"base_model.model.{prefix}{half}layers.0.self_attn" for half in halves}
    assert adapted_layers(llama_model(), layers_pattern="layers") == {"base_model.model.layers.0.self_attn"}


# generate() under prompt learning --------------------------------------------------------------------

PROMPT_LEARNING = {
    "PREFIX_TUNING": lambda task: peft.PrefixTuningConfig(task_type=task, num_virtual_tokens=4),
    "PROMPT_TUNING": lambda task: peft.PromptTuningConfig(task_type=task, num_virtual_tokens=4),
    "P_TUNING": lambda task: peft.PromptEncoderConfig(
        task_type=task, num_virtual_tokens=4, encoder_hidden_size=16
    ),
    "CPT": lambda task: peft.CPTConfig(
        task_type=task, cpt_token_ids=[5, 6, 7], cpt_mask=[1, 1, 1], cpt_tokens_type_mask=[1, 2, 3]
    ),
}


@pytest.mark.parametrize(
    "arch,kind",
    [("decoder", kind) for kind in PROMPT_LEARNING] + [("seq2seq", "PREFIX_TUNING")],
)
def test_generate_under_prompt_learning_is_refused_with_what_works(arch, kind):
    model = build(HEADS[arch], tiny_config(arch))
    task = "CAUSAL_LM" if arch == "decoder" else "SEQ_2_SEQ_LM"
    wrapped = peft.get_peft_model(model, PROMPT_LEARNING[kind](task))
    ids, mask = padded_batch(batch=2, length=7, padding="left" if arch == "decoder" else "right")
    with pytest.raises(ValueError) as refusal:
        wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    message = str(refusal.value)
    assert f"generate() with PEFT's prompt learning ({kind}) does not work" in message
    assert f"transformers {transformers.__version__} and peft {peft.__version__}" in message
    assert "Decode with the PEFT model's forward instead, without a cache" in message
    # PEFT puts the model's own hook back after the call: plain generation works again
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("kind", ["PROMPT_TUNING", "P_TUNING"])
def test_seq2seq_prompt_tuning_generates_as_step_by_step_decoding(kind):
    """The encoder-decoder's prompt and P-tuning prepend embeddings to the encoder input only: generate()
    gives the tokens of greedy decoding by the PEFT model's forward without a cache."""
    model = build(HEADS["seq2seq"], tiny_config("seq2seq"))
    wrapped = peft.get_peft_model(model, PROMPT_LEARNING[kind]("SEQ_2_SEQ_LM")).eval()
    ids, mask = padded_batch(batch=2, length=7, padding="right")
    with torch.no_grad():
        out = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        decoded = torch.full((2, 1), model.config.decoder_start_token_id)
        for _ in range(5):
            logits = wrapped(input_ids=ids, attention_mask=mask, decoder_input_ids=decoded).logits
            decoded = torch.cat([decoded, logits[:, -1].argmax(-1, keepdim=True)], 1)
        without = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert out.tolist() == decoded.tolist()
    assert out.tolist() != without.tolist()  # the virtual tokens are read
