"""PEFT's methods on every architecture, beside the transformers model of the same family and shape
(issue 26): whatever wraps, trains, saves, reloads and merges on Llama, BERT, RoBERTa, T5 and BART does
the same here.

Each (method, architecture) runs one pipeline on both models: `get_peft_model` on the same projections
(by their names on each side), three AdamW steps on one batch, `save_pretrained` of the adapter,
`PeftModel.from_pretrained` into a fresh base (outputs compared exactly with the trained model), and
`merge_and_unload` (outputs compared with the unmerged model). Each step is one test: what succeeds on
the transformers model must succeed here with the same result; a step that fails on the transformers
model too is an xfail carrying PEFT's error there, so the gaps PEFT has everywhere stay visible.
Prefix and prompt tuning run through the task models (PEFT's task types); prefix tuning of the bare
encoder is issue 31.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass

import peft
import pytest
import torch
import transformers

import swapformer

from conftest import TINY_SIZE, VOCAB, bart_size, build, max_diff, padded_batch, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread

STEPS = ("wrap", "train", "save", "reload", "merge")
# relative: a merged weight sums in another order than base + adapter (FourierFT's inverse FFT on the
# tiny BART: 1.2e-4)
MERGE_TOLERANCE = 1e-3


SIZE = dict(vocab_size=VOCAB, pad_token_id=0)
LLAMA = dict(
    hidden_size=TINY_SIZE["hidden_size"],
    num_hidden_layers=TINY_SIZE["num_hidden_layers"],
    num_attention_heads=TINY_SIZE["num_attention_heads"],
    intermediate_size=TINY_SIZE["intermediate_size"],
)
BERT = {**LLAMA, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "num_labels": 2}
ROBERTA = {**BERT, "max_position_embeddings": 64 + 2}  # RoBERTa's positions start after the pad id
T5 = dict(
    d_model=TINY_SIZE["hidden_size"],
    d_kv=TINY_SIZE["hidden_size"] // TINY_SIZE["num_attention_heads"],
    d_ff=TINY_SIZE["intermediate_size"],
    num_layers=TINY_SIZE["num_hidden_layers"],
    num_heads=TINY_SIZE["num_attention_heads"],
    dropout_rate=0.0,
    decoder_start_token_id=0,
)
BART = dict(
    **bart_size(
        d_model=TINY_SIZE["hidden_size"],
        heads=TINY_SIZE["num_attention_heads"],
        ffn_dim=TINY_SIZE["intermediate_size"],
        encoder_layers=TINY_SIZE["num_hidden_layers"],
        decoder_layers=TINY_SIZE["num_hidden_layers"],
    ),
    max_position_embeddings=64,
    dropout=0.0,
    decoder_start_token_id=1,
)
OURS_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
BERT_TARGETS = ("query", "key", "value", "attention.output.dense")


@dataclass(frozen=True)
class Pair:
    """One architecture: swapformer's model (class and config options) and transformers' model of the same
    shape (`reference`, e.g. "LlamaForCausalLM", with its config options), their PEFT task type, and the
    attention projections adapted on transformers' model (swapformer's: OURS_TARGETS)."""

    task_type: str
    ours: tuple  # (swapformer class, arch, tiny_config options)
    reference: str
    options: dict
    targets: tuple

    def model(self, side: str):
        """A fresh model of `side` ("ours" or "theirs"), with the same weights at every call."""
        if side == "ours":
            cls, arch, options = self.ours
            return build(cls, tiny_config(arch, **options))
        torch.manual_seed(0)
        config = getattr(transformers, self.reference.split("For")[0] + "Config")(**SIZE, **self.options)
        config._attn_implementation = "eager"
        return getattr(transformers, self.reference)(config).eval()


SEQ_CLS = swapformer.EncoderForSequenceClassification
SEQ2SEQ = (swapformer.Seq2SeqForConditionalGeneration, "seq2seq", {})
PAIRS = {
    "decoder": Pair(
        "CAUSAL_LM", (swapformer.DecoderForCausalLM, "decoder", {}), "LlamaForCausalLM", LLAMA, OURS_TARGETS
    ),
    # BERT's head (pooler -> linear classifier) and RoBERTa's (dense -> tanh -> out_proj, no pooler)
    "encoder": Pair(
        "SEQ_CLS",
        (SEQ_CLS, "encoder", dict(num_labels=2, add_pooling_layer=True)),
        "BertForSequenceClassification",
        BERT,
        BERT_TARGETS,
    ),
    "encoder-roberta": Pair(
        "SEQ_CLS",
        (SEQ_CLS, "encoder", dict(num_labels=2, add_pooling_layer=False)),
        "RobertaForSequenceClassification",
        ROBERTA,
        BERT_TARGETS,
    ),
    "seq2seq": Pair("SEQ_2_SEQ_LM", SEQ2SEQ, "T5ForConditionalGeneration", T5, ("q", "k", "v", "o")),
    "seq2seq-bart": Pair(
        "SEQ_2_SEQ_LM",
        SEQ2SEQ,
        "BartForConditionalGeneration",
        BART,
        ("q_proj", "k_proj", "v_proj", "out_proj"),
    ),
}

# Each method's config for a 32-wide model (block sizes dividing 32, few frequencies), with PEFT's
# default initialisation (most start as the identity; training moves them).
METHODS = {
    "lora": lambda targets: peft.LoraConfig(r=4, target_modules=targets),
    "dora": lambda targets: peft.LoraConfig(r=4, target_modules=targets, use_dora=True),
    "glora": lambda targets: peft.GloraConfig(r=4, target_modules=targets),
    "ia3": lambda targets: peft.IA3Config(target_modules=targets, feedforward_modules=[]),
    "loha": lambda targets: peft.LoHaConfig(r=4, target_modules=targets),
    "lokr": lambda targets: peft.LoKrConfig(r=4, target_modules=targets),
    "oft": lambda targets: peft.OFTConfig(oft_block_size=4, target_modules=targets),
    "boft": lambda targets: peft.BOFTConfig(boft_block_size=4, target_modules=targets),
    "vera": lambda targets: peft.VeraConfig(r=4, target_modules=targets),
    "fourierft": lambda targets: peft.FourierFTConfig(n_frequency=16, target_modules=targets),
    "adalora": lambda targets: peft.AdaLoraConfig(
        init_r=4, target_r=2, total_step=10, target_modules=targets
    ),
    "prefix_tuning": lambda targets: peft.PrefixTuningConfig(num_virtual_tokens=4),
    "prompt_tuning": lambda targets: peft.PromptTuningConfig(num_virtual_tokens=4),
}


def batch(arch: str) -> tuple[dict, torch.Tensor]:
    """The inputs of the compared forwards, and the labels of training."""
    ids, mask = padded_batch(batch=3, padding="left" if arch == "decoder" else "right")
    inputs = dict(input_ids=ids, attention_mask=mask)
    if arch.startswith("encoder"):
        return inputs, torch.tensor([0, 1, 1])
    labels = ids.masked_fill(mask == 0, -100)
    if arch.startswith("seq2seq"):
        inputs["decoder_input_ids"] = ids[:, :5].contiguous()
        labels = labels[:, 1:6].contiguous()
    return inputs, labels


@torch.no_grad()
def outputs(model, inputs) -> torch.Tensor:
    model.eval()
    return model(**inputs).logits


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_diff(a, b) / max(float(b.abs().max()), 1e-30)


class WrongResult(Exception):
    """A step ran but gave the wrong result (the loss did not go down, the reload is not exact, ...)."""


def train(model, inputs, steps: int = 3) -> None:
    """`steps` AdamW steps on one batch, which must lower its loss."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps + 1):
        loss = model(**inputs).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if not losses[-1] < losses[0]:
        raise WrongResult(f"the loss went from {losses[0]:.4f} to {losses[-1]:.4f}")


def reload(make, folder, inputs, trained: torch.Tensor) -> None:
    """The saved adapter on a fresh base gives the trained model's outputs exactly."""
    diff = max_diff(outputs(peft.PeftModel.from_pretrained(make(), folder), inputs), trained)
    if diff != 0.0:
        raise WrongResult(f"the reloaded adapter's outputs differ by {diff:.2e}")


def merge(model, inputs, trained: torch.Tensor) -> None:
    diff = relative_diff(outputs(model.merge_and_unload(), inputs), trained)
    if diff > MERGE_TOLERANCE:
        raise WrongResult(f"the merged model's outputs differ by {diff:.2e} (relative)")


def pipeline(method: str, arch: str, side: str) -> dict[str, str | None]:
    """{step: None (done) or why not (PEFT's error, a wrong result, or the earlier step it needed)} of
    one model of the pair."""
    pair = PAIRS[arch]
    targets = OURS_TARGETS if side == "ours" else pair.targets

    def make():
        return pair.model(side)

    inputs, labels = batch(arch)
    config = METHODS[method](list(targets))
    config.task_type = pair.task_type
    record: dict[str, str | None] = {}

    def attempt(step, fn, needs=()):
        blocked = next((n for n in needs if record[n] is not None), None)
        if blocked is not None:
            why = record[blocked]
            record[step] = why if why.startswith("not reached") else f"not reached ({blocked}: {why})"
            return None
        try:
            result = fn()
        except Exception as e:  # recorded: the test compares it with the reference's outcome
            record[step] = f"{type(e).__name__}: {e}"
            return None
        record[step] = None
        return result

    model = attempt("wrap", lambda: peft.get_peft_model(make(), config))
    attempt("train", lambda: train(model, {**inputs, "labels": labels}), needs=("wrap",))
    trained = attempt("outputs", lambda: outputs(model, inputs), needs=("train",))
    with tempfile.TemporaryDirectory() as folder:
        attempt("save", lambda: model.save_pretrained(folder), needs=("outputs",))
        attempt("reload", lambda: reload(make, folder, inputs, trained), needs=("save",))
    attempt("merge", lambda: merge(model, inputs, trained), needs=("outputs",))
    return record


@functools.cache
def outcomes(method: str, arch: str) -> tuple[dict, dict]:
    return pipeline(method, arch, "theirs"), pipeline(method, arch, "ours")


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("arch", list(PAIRS))
@pytest.mark.parametrize("method", list(METHODS))
def test_peft_method_step_as_on_transformers(method, arch, step):
    theirs, ours = outcomes(method, arch)
    reference = PAIRS[arch].reference
    if theirs[step] is not None:
        if ours[step] is not None:
            pytest.xfail(f"{method} {step} fails on transformers' {reference} too: {theirs[step]}")
        return  # swapformer's model does more than the reference
    assert ours[step] is None, (
        f"{method} {step} works on {reference}, not on swapformer's model: {ours[step]}"
    )
