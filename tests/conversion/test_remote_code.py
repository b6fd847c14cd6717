"""Saved folders load with trust_remote_code=True in a Python where swapformer cannot be imported."""

from __future__ import annotations

import json
import os

import pytest
import torch

import swapformer
from swapformer.modeling.remote_code import flat_files

from conftest import DATA, MLA_TINY, build, padded_batch, tiny_config
from remote_code_check import load_without_swapformer

# window + global layers, as Longformer (with its global projections) or gpt-oss (with sinks) have them
WINDOW_GLOBAL = dict(
    layer_types=["sliding_global_attention", "full_attention"], sliding_window=3, global_tokens=1
)
CASES = {
    "encoder": (
        swapformer.EncoderForMaskedLM,
        "AutoModelForMaskedLM",
        dict(position_embedding_type="learned"),
    ),
    # Longformer-like: window + global layers with the global tokens' own projections
    "encoder-global": (
        swapformer.EncoderForMaskedLM,
        "AutoModelForMaskedLM",
        dict(WINDOW_GLOBAL, global_projections=True),
    ),
    "decoder": (
        swapformer.DecoderForCausalLM,
        "AutoModelForCausalLM",
        dict(position_embedding_type="rope", num_key_value_heads=2),
    ),
    # multi-head latent attention (mla.py)
    "decoder-mla": (
        swapformer.DecoderForCausalLM,
        "AutoModelForCausalLM",
        dict(MLA_TINY, rope_interleave=True),
    ),
    # gpt-oss-like learned attention sinks on window + global layers, GQA
    "decoder-sinks": (
        swapformer.DecoderForCausalLM,
        "AutoModelForCausalLM",
        dict(WINDOW_GLOBAL, position_embedding_type="rope", num_key_value_heads=2, attention_sinks=True),
    ),
    "seq2seq": (
        swapformer.Seq2SeqForConditionalGeneration,
        "AutoModelForSeq2SeqLM",
        dict(position_embedding_type="relative_bias"),
    ),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_remote_code_loads_without_swapformer(arch, tmp_path, report):
    model_class, auto_name, options = CASES[arch]
    model = build(model_class, tiny_config(arch.split("-")[0], **options), attn="sdpa")
    ids, mask = padded_batch(padding="right")
    kw = dict(attention_mask=mask)
    if arch == "seq2seq":
        kw.update(decoder_input_ids=ids[:, :5])
    with torch.no_grad():
        logits = model(ids, **kw).logits
    folder = tmp_path / "model"
    model.save_pretrained(folder)

    config = json.loads((folder / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", *model_class.auto_classes}
    for target in config["auto_map"].values():
        assert (folder / (target.split(".")[0] + ".py")).exists()

    result = load_without_swapformer(folder, auto_name, arch, tmp_path, ids, mask, logits)
    report(f"{arch} remote sdpa logits max abs diff", result["sdpa"])
    report(f"{arch} remote eager logits max abs diff", result["eager"])
    assert result["sdpa"] <= 1e-5 and result["eager"] <= 1e-5
    assert result["attn_after_switch"] == "eager"


def test_flat_files_only_use_single_dot_imports():
    files = flat_files(swapformer.Seq2SeqForConditionalGeneration)
    assert {"configuration_swapformer.py", "modeling_seq2seq.py", "layers.py", "masks.py"} <= set(files)
    for name, text in files.items():
        for line in text.splitlines():
            stripped = line.strip()
            assert not stripped.startswith("from .."), (name, line)
            assert not stripped.startswith(("import swapformer", "from swapformer")), (name, line)
            if stripped.startswith("from ."):
                target = stripped.split()[1][1:] + ".py"
                assert target in files, (name, line)
    assert "ALL_ATTENTION_FUNCTIONS.get_interface(" in files["plan.py"]


def test_saved_folder_is_safetensors_only(tmp_path):
    build(swapformer.EncoderModel, tiny_config("encoder")).save_pretrained(tmp_path)
    names = set(os.listdir(tmp_path))
    assert "model.safetensors" in names
    assert not {n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))}


@pytest.mark.parametrize("how", ["push_to_hub", "save_pretrained(push_to_hub=True)"])
def test_push_to_hub_uploads_the_modeling_code(how, tmp_path, monkeypatch):
    """The Hub is out of reach here: the huggingface_hub client's network calls are replaced by a
    recorder (tests/hub_recorder.py), and the test checks the commit it would make."""
    from hub_recorder import Hub

    hub = Hub(monkeypatch)
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    if how == "push_to_hub":
        model.push_to_hub("me/tiny")
    else:
        model.save_pretrained(tmp_path / "tiny", push_to_hub=True, repo_id="me/tiny")
        assert (tmp_path / "tiny" / "modeling_decoder.py").exists()  # the local copy is complete too
    commit = hub.commits[-1]
    assert commit["repo_id"] == "me/tiny"
    assert {
        "model.safetensors",
        "config.json",
        "modeling_decoder.py",
        "layers.py",
        "configuration_swapformer.py",
    } <= set(commit["files"])
    assert "modeling_decoder.DecoderForCausalLM" in commit["files"]["config.json"].decode()


def test_the_generated_header_is_never_read_as_an_encoding_declaration():
    """A module whose name ends in "coding" (e.g. `cpu.decoding`) once made the header of its flat file a
    PEP 263 encoding declaration ("...decoding: the model's source"), and the folder failed to load."""
    from swapformer.modeling.remote_code import HEADER

    for origin in ("swapformer.modeling.cpu.decoding", "x.coding", "encoding"):
        source = HEADER.format(origin=origin) + "value = 1\n"
        namespace = {}
        exec(compile(source.encode(), f"{origin}.py", "exec"), namespace)
        assert namespace["value"] == 1


def test_a_folder_saved_by_the_release_before_the_consolidation_still_loads(tmp_path):
    """tests/data/remote_decoder_v0_1.tar.gz is a decoder folder (RoPE, GQA, a window layer beside a
    full one, gated MLP) saved with its flat remote code by the release before issue 27 moved the
    modules into subpackages. It loads with trust_remote_code=True in a Python without swapformer, and
    gives the logits of the installed swapformer's model loaded from the same folder (the reference)."""
    import tarfile

    with tarfile.open(DATA / "remote_decoder_v0_1.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    folder = tmp_path / "remote_decoder_v0_1"
    model = swapformer.DecoderForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    ids, mask = padded_batch(padding="right", vocab=model.config.vocab_size)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    result = load_without_swapformer(folder, "AutoModelForCausalLM", "decoder", tmp_path, ids, mask, logits)
    assert result["sdpa"] <= 1e-5 and result["eager"] <= 1e-5, result
