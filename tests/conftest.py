"""Shared helpers: tiny configs, a word-level tokenizer, weight scrambling and tolerant comparisons."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

import swapformer
from swapformer.configuration.configuration_swapformer import LAYER_TYPES
from swapformer.modeling.cpu import sparse_native as sparse_cpu_module

# fixtures kept in support modules beside this file: `reference_flash` (transformers' flash path on the CPU)
pytest_plugins = ["flash_reference"]

# The repository (tests live one folder deeper, grouped as modeling/ is) and the tests' data files
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
ARCHS = ("encoder", "decoder", "seq2seq")
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "relative_bias", "none")
VOCAB = 97
# The sparse backend's routes without gradients on CPU that this machine can run: the PyTorch path, and
# the native kernels where they can be built (test_sparse_native.py says so when they cannot).
SPARSE_CPU_ROUTES = ("torch", "native") if sparse_cpu_module._missing() is None else ("torch",)
# The size of the tiny models; a test that builds a transformers model beside one uses it too.
TINY_SIZE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
# The size of the tiny transformers models that parity and conversion tests start from (Llama, StableLM,
# BERT, Longformer); each test adds its vocabulary, positions and head layout.
HF_SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
# folder of the checkout -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {
    "swapformer": "swapformer",
    "configuration": "swapformer.configuration",
    "modeling": "swapformer.modeling",
    "conversion": "swapformer.conversion",
    "training": "swapformer.training",
    "hub_cards": "swapformer.hub_cards",
}


def tiny_config(arch: str, **overrides):
    """A 2-layer model small enough for exhaustive parametrised tests."""
    base = dict(
        vocab_size=VOCAB,
        **TINY_SIZE,
        num_key_value_heads=4,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(overrides)
    if arch == "encoder":
        return swapformer.EncoderConfig(**base)
    if arch == "decoder":
        return swapformer.DecoderConfig(**base)
    base.setdefault("decoder_start_token_id", 1)
    return swapformer.Seq2SeqConfig(**base)


# Every cache layer type in one decoder (issue 26: full and window layers in one static cache, as Gemma 2
# compiles); for a seq2seq, pass them as `decoder_layer_types` too.
MIXED_LAYERS = dict(
    num_hidden_layers=4,
    layer_types=list(LAYER_TYPES),
    sliding_window=3,
    global_tokens=1,
    attention_block_size=2,
    num_random_blocks=1,
)


def bart_size(*, d_model: int, heads: int, ffn_dim: int, encoder_layers: int, decoder_layers: int) -> dict:
    """BartConfig's size fields for an encoder and a decoder of the same width, heads and feed-forward size
    (BART names each twice, once per half)."""
    return dict(
        d_model=d_model, encoder_layers=encoder_layers, decoder_layers=decoder_layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn_dim, decoder_ffn_dim=ffn_dim,
    )  # fmt: skip


# Multi-head latent attention at the tiny size: every width different, so a swapped one fails.
MLA_TINY = dict(
    position_embedding_type="rope", kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
    v_head_dim=5,
)  # fmt: skip


def pattern_config(arch, layer_type, **overrides):
    """A tiny config whose layer 0 carries the pattern under test (`layer_type`) and layer 1 is full:
    both kinds of mask in one forward (for an encoder-decoder, in both halves)."""
    options = dict(
        layer_types=[layer_type, "full_attention"],
        sliding_window=5,
        attention_block_size=8,
        global_tokens=2,
        num_random_blocks=1,
        position_embedding_type="rope",
        max_position_embeddings=64,
    )
    if arch == "seq2seq":
        options["decoder_layer_types"] = [layer_type, "full_attention"]
    options.update(overrides)
    return tiny_config(arch, **options)


def load_benchmark(name: str):
    """benchmarks/`name`.py as a module (its folder goes on sys.path: the benchmarks import their shared
    measure.py)."""
    folder = ROOT / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_python(script: str, *args, env: dict, tag: str, cwd=None) -> dict:
    """Run `script` with `args` in a fresh interpreter whose whole environment is `env`; it must exit 0
    and print a line `TAG {json}`, whose object is returned."""
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split(f"{tag} ", 1)[1])


# BERT's special tokens by role, in the order of their ids (0-4)
BERT_TOKENS = dict(
    pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
)
BERT_SPECIAL = list(BERT_TOKENS.values())


def word_tokenizer(special: dict, words, *, normalizer=None, post_processor=None, decoder=None, **options):
    """A word-level fast tokenizer split on white space: the `special` tokens (role: token, as
    PreTrainedTokenizerFast takes them) get ids 0, 1, ... in their order, then `words`; `normalizer`,
    `post_processor` and `decoder` are `tokenizers` objects for the steps a test needs, `options` go to
    PreTrainedTokenizerFast."""
    vocab = {tok: i for i, tok in enumerate([*special.values(), *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for step, value in dict(normalizer=normalizer, post_processor=post_processor, decoder=decoder).items():
        if value is not None:
            setattr(tok, step, value)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special, **options)


def bert_style_tokenizer(words, padding_side="right", decoder=None):
    """A word-level fast tokenizer with BERT's special tokens (ids 0-4, BERT_SPECIAL) then `words`:
    lowercased, split on white space, `[CLS] a [SEP]` and `[CLS] a [SEP] b [SEP]` with token types;
    `decoder` a `tokenizers.decoders` object where a test decodes."""
    ids = {tok: i for i, tok in enumerate(BERT_SPECIAL)}
    template = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    return word_tokenizer(
        BERT_TOKENS,
        words,
        normalizer=normalizers.Lowercase(),
        post_processor=template,
        decoder=decoder,
        padding_side=padding_side,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


BASE_CLASSES = {
    "encoder": swapformer.EncoderModel,
    "decoder": swapformer.DecoderModel,
    "seq2seq": swapformer.Seq2SeqModel,
}
LM_CLASSES = {
    "encoder": swapformer.EncoderForMaskedLM,
    "decoder": swapformer.DecoderForCausalLM,
    "seq2seq": swapformer.Seq2SeqForConditionalGeneration,
}


def build(model_class, config, attn="eager", seed=0):
    """A model on its own copy of `config` (from_config writes the backend into the config it gets)."""
    torch.manual_seed(seed)
    model = model_class._from_config(copy.deepcopy(config), attn_implementation=attn)
    scramble_(model, seed)
    return model.eval()


@torch.no_grad()
def scramble_(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every weight a size that makes the function sensitive to mistakes.

    Default inits (std 0.02) make attention almost uniform and layers almost identity, so a wrong
    scale or mask can hide below a tolerance; matrices get std 1/sqrt(fan_in), vectors N(1, 0.2) for
    norm weights and N(0, 0.2) for biases.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.2 * torch.randn(p.shape, generator=g))


def padded_batch(batch=3, length=9, padding="right", seed=0, vocab=VOCAB):
    """Token ids and a 0/1 mask; row 1 and row 2 are shorter (padding on `padding`'s side)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if padding != "none":
        for row, n_pad in ((1, 3), (2, length // 2)):
            if row < batch:
                if padding == "right":
                    mask[row, length - n_pad :] = 0
                else:
                    mask[row, :n_pad] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _owner(module, name: str) -> tuple[object, str]:
    """(object, attribute) a dotted `name` ("Seam.environment") names under `module`."""
    *path, attribute = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, attribute


def route_env_fixture(module, *cached: str, env: str = "ENV"):
    """A fixture `env_route(value)` that sets the variable named by `module.<env>` (None: unset) as a new
    process would see it: the module reads its environment variable once and keeps what it read in the
    attributes `cached` (a dotted name for a class attribute), which are cleared with every call and after
    the test (SWAPFORMER_CPU_ROUTES, SWAPFORMER_CPU_LINEAR, SWAPFORMER_SPARSE_CPU)."""
    variable = getattr(module, env)

    @pytest.fixture
    def env_route(monkeypatch):
        def set_route(value: str | None):
            if value is None:
                monkeypatch.delenv(variable, raising=False)
            else:
                monkeypatch.setenv(variable, value)
            for name in cached:
                monkeypatch.setattr(*_owner(module, name), None)

        yield set_route
        for name in cached:
            setattr(*_owner(module, name), None)

    return env_route


def odd_strides(x: torch.Tensor) -> torch.Tensor:
    """The values of `x` in a view whose last axis has stride 2 (every other column of a wider tensor,
    like heads interleaved in a fused projection) and whose size-1 axes have stride 7 (never stepped
    over, so any stride is valid there; torch still calls such an axis contiguous)."""
    wide = x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])
    wide[..., ::2] = x
    view = wide[..., ::2]
    return view.as_strided(view.shape, [7 if n == 1 else s for n, s in zip(view.shape, view.stride())])


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """max |a - b|, over the positions where `mask` (B, T) is 1 when given."""
    d = (a.float() - b.float()).abs()
    if mask is not None:
        d = d[mask.bool()]
    return float(d.max()) if d.numel() else 0.0


def exact_sgd_args(output_dir, **overrides) -> transformers.TrainingArguments:
    """TrainingArguments for Trainer runs that tests compare weight by weight: plain SGD at a constant
    rate, no weight decay, no clipping, on the CPU, fixed seeds, no reports and no checkpoints;
    `overrides` add the batch size, steps and rate of the run."""
    return transformers.TrainingArguments(
        output_dir=str(output_dir),
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1e9,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
        data_seed=0,
        **overrides,
    )


@pytest.fixture(scope="module", autouse=True)
def no_compiled_kernels_left():
    """After each test file, forget what torch.compile compiled: transformers' flex path keeps one compiled
    function for the process, and the shapes a file compiled it for made a later file's flex call fail
    inside dynamo (unbacked symbols) where it passes alone."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session", autouse=True)
def auto_cache_outside_home(tmp_path_factory):
    """attn_implementation="auto" writes its measurements to a cache folder (default ~/.cache/swapformer),
    and `swapformer train` its token shards (default: beside `datasets`' cache): for the whole session
    SWAPFORMER_CACHE_DIR names a temporary folder for both, so no test writes to the user's home."""
    before = os.environ.get("SWAPFORMER_CACHE_DIR")
    os.environ["SWAPFORMER_CACHE_DIR"] = str(tmp_path_factory.mktemp("swapformer-cache"))
    yield
    if before is None:
        del os.environ["SWAPFORMER_CACHE_DIR"]
    else:
        os.environ["SWAPFORMER_CACHE_DIR"] = before


@pytest.fixture
def auto_cache_dir(tmp_path, monkeypatch):
    """attn_implementation="auto" with its cache in tmp_path, measuring (SWAPFORMER_AUTO unset), nothing
    remembered from earlier tests (auto_backend.forget)."""
    from swapformer.modeling.attention import auto_backend

    folder = tmp_path / "auto-cache"
    monkeypatch.setenv("SWAPFORMER_CACHE_DIR", str(folder))
    monkeypatch.delenv("SWAPFORMER_AUTO", raising=False)
    auto_backend.forget()
    yield folder
    auto_backend.forget()


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy shared machine OpenMP threads
    spin-wait for each other (a backward took 25x longer with two): one thread keeps tests fast and
    steady. Files use it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def report(request):
    """Print a measured figure so `pytest -s` / CI logs show it."""

    def _report(label: str, value: float):
        print(f"\n[{request.node.name}] {label}: {value:.3e}")

    return _report


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    """Twenty stdlib modules as a `swapformer train --data` folder of text files (about 150k characters);
    the training and packing tests train on it."""
    from swapformer.training.corpus import stdlib_documents

    folder = tmp_path_factory.mktemp("texts")
    docs = [d for d in stdlib_documents() if 2_000 < len(d.text) < 15_000][:20]
    for i, d in enumerate(docs):
        (folder / f"doc{i:02d}.txt").write_text(d.text)
    return folder


def generate_steps(model, ids, new_tokens: int, **generate_kwargs):
    """generate() for exactly `new_tokens` steps (min_new_tokens too: an eos token cannot end it early),
    greedy with pad id 0 unless `generate_kwargs` say otherwise; the dict output (sequences, and the
    logits or scores that `generate_kwargs` ask for)."""
    options = {"do_sample": False, "pad_token_id": 0, **generate_kwargs}
    return model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        return_dict_in_generate=True,
        **options,
    )


@torch.no_grad()
def uncached_step_logits(model, ids, mask, sequences, step: int):
    """The logits an uncached forward gives for generation step `step` (from 0) of `sequences`, what
    generate() returned for the prompt `ids` / `mask`: the forward sees the prompt and the tokens
    generated before that step."""
    if model.config.is_encoder_decoder:
        prefix = sequences[:, : step + 1]
        return model(ids, attention_mask=mask, decoder_input_ids=prefix, use_cache=False).logits[:, -1]
    prefix = sequences[:, : ids.shape[1] + step]
    prefix_mask = torch.cat([mask, torch.ones(mask.shape[0], step, dtype=mask.dtype)], dim=1)
    return model(prefix, attention_mask=prefix_mask, use_cache=False).logits[:, -1]


def cached_step_diffs(model, ids, mask, max_new_tokens: int, **generate_kwargs) -> list[float]:
    """generate() with the KV cache (greedy unless `generate_kwargs` say otherwise); for every step,
    max |its logits - the logits of an uncached forward over the same prefix|. Checked per step, not
    on tokens: tiny random models often pick the same tokens when the cache is wrong."""
    out = generate_steps(
        model, ids, max_new_tokens, attention_mask=mask, output_logits=True, **generate_kwargs
    )
    diffs = [
        max_diff(logits, uncached_step_logits(model, ids, mask, out.sequences, step))
        for step, logits in enumerate(out.logits)
    ]
    assert len(diffs) == max_new_tokens
    return diffs
