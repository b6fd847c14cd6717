"""RoPE scaling in transformers 5's `rope_parameters` form (issue 10, item 12): config validation,
backward compatibility of `rope_theta`, and Llama checkpoints with each scaling converted with
parity on sequences past the lengths where the scaling acts."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

import swapformer
from swapformer.conversion import convert

from conftest import HF_SIZE, build, max_diff, scramble_, tiny_config
from hf_models import SCALINGS

MAX_POSITIONS = 64  # max_position_embeddings
LENGTH = 80  # past both, so dynamic NTK rescales too


def llama_config(rope_parameters):
    return T.LlamaConfig(
        vocab_size=97,
        **HF_SIZE,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters=dict(rope_parameters),
    )


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_llama_checkpoint_with_rope_scaling_converts_with_parity(scaling, tmp_path, report):
    llama, ours = converted_pair(scaling, tmp_path)
    assert ours.config.rope_parameters["rope_type"] == scaling
    ids = torch.randint(0, 97, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = llama(ids).logits, ours(ids).logits
        # the same model without its scaling: the comparison is sensitive to it
        plain = T.LlamaForCausalLM(llama_config(SCALINGS["default"])).eval()
        plain.load_state_dict(llama.state_dict())
        unscaled = plain(ids).logits
    diff = max_diff(got, want)
    report(f"{scaling}: converted vs Llama logits at {LENGTH} tokens", diff)
    assert diff <= 1e-4
    if scaling != "default":
        assert max_diff(unscaled, want) > 100 * max(diff, 1e-6)
    back = convert(tmp_path / "ours", tmp_path / "back", to_hf=True, log=lambda line: None)
    assert (
        json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"]["rope_type"] == scaling
    )
    assert back.max_diff <= 1e-4


@pytest.mark.parametrize("scaling", ["dynamic", "llama3"])
def test_cached_generation_matches_llama(scaling, tmp_path):
    """Decoding past max_position_embeddings, step by step: dynamic NTK rescales as the sequence grows."""
    llama, ours = converted_pair(scaling, tmp_path)
    ids = torch.randint(0, 97, (1, MAX_POSITIONS - 4), generator=torch.Generator().manual_seed(2))
    kw = dict(
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    want, got = llama.generate(ids, **kw), ours.generate(ids, **kw)
    assert torch.equal(want.sequences, got.sequences)
    assert max(max_diff(a, b) for a, b in zip(want.logits, got.logits)) <= 1e-4


def test_dynamic_frequencies_carry_over_between_forwards_as_llamas(tmp_path, report):
    """Llama keeps the frequencies of its longest forward while later ones stay past
    max_position_embeddings, and goes back to the original ones under it; so does swapformer (frequencies
    computed from each forward alone give other logits for the shorter forward, checked below)."""
    llama, ours = converted_pair("dynamic", tmp_path)

    def alone(ids):  # a Llama that ran nothing before
        fresh = T.LlamaForCausalLM(llama_config(SCALINGS["dynamic"])).eval()
        fresh.load_state_dict(llama.state_dict())
        return fresh(ids).logits

    g = torch.Generator().manual_seed(3)
    history = []  # (length, swapformer's and a fresh Llama's distance to the Llama that ran the earlier ones)
    with torch.no_grad():
        for length in (LENGTH, MAX_POSITIONS + 8, MAX_POSITIONS - 8, MAX_POSITIONS + 4):
            ids = torch.randint(0, 97, (2, length), generator=g)
            want = llama(ids).logits
            history.append((length, max_diff(ours(ids).logits, want), max_diff(alone(ids), want)))
    for length, diff, _ in history:
        report(f"dynamic, {length} tokens after the earlier forwards: converted vs Llama logits", diff)
        assert diff <= 1e-4
    _, diff, alone = history[1]  # 72 tokens after 80: Llama keeps the frequencies of 80
    assert alone > 100 * max(diff, 1e-6)


def converted_pair(scaling: str, tmp_path):
    """A random Llama with `scaling` and its conversion, loaded again from disk."""
    torch.manual_seed(0)
    llama = T.LlamaForCausalLM(llama_config(SCALINGS[scaling])).eval()
    scramble_(llama)
    llama.save_pretrained(tmp_path / "llama")
    result = convert(tmp_path / "llama", tmp_path / "ours", log=lambda line: None)
    assert result.max_diff <= 1e-4
    return llama, T.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()


class TestRopeConfig:
    def test_rope_theta_is_backward_compatible(self, tmp_path):
        config = tiny_config("decoder", position_embedding_type="rope", rope_theta=500.0)
        assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500.0}
        assert config.rope_theta == 500.0
        # a config.json saved before rope_parameters existed
        old = config.to_dict()
        del old["rope_parameters"]
        old["rope_theta"] = 500.0
        (tmp_path / "config.json").write_text(json.dumps(old))
        loaded = swapformer.DecoderConfig.from_pretrained(tmp_path)
        assert loaded.rope_parameters["rope_theta"] == 500.0 and loaded.rope_theta == 500.0
        a, b = build(swapformer.DecoderModel, config), build(swapformer.DecoderModel, loaded)
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            assert torch.equal(a(ids).last_hidden_state, b(ids).last_hidden_state)
        config.rope_theta = 20.0  # the attribute still sets the base
        assert config.rope_parameters["rope_theta"] == 20.0

    def test_legacy_rope_scaling_key(self):
        config = tiny_config(
            "decoder", position_embedding_type="rope", rope_scaling={"type": "linear", "factor": 2.0}
        )
        assert config.rope_parameters["rope_type"] == "linear" and config.rope_parameters["factor"] == 2.0

    def test_round_trip(self, tmp_path):
        params = dict(SCALINGS["yarn"], beta_fast=16.0)
        config = tiny_config("decoder", position_embedding_type="rope", rope_parameters=params)
        config.save_pretrained(tmp_path)
        assert swapformer.DecoderConfig.from_pretrained(tmp_path).rope_parameters == config.rope_parameters

    @pytest.mark.parametrize(
        "params, error, match",
        [
            ({"rope_type": "su"}, ValueError, r"Unknown rope_parameters\['rope_type'\]='su'.*'llama3'"),
            ({"rope_type": "linear"}, ValueError, r"rope_type='linear' needs 'factor'"),
            (
                {"rope_type": "dynamic", "factor": 0},
                ValueError,
                r"rope_parameters\['factor'\] must be a finite number > 0, got rope_parameters\['factor'\]=0",
            ),
            (
                {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
                ValueError,
                "high_freq_factor=1.0 must exceed low_freq_factor=4.0",
            ),
            ({"rope_type": "longrope", "factor": 2.0}, ValueError, "Unknown rope_parameters"),
            ("linear", TypeError, "rope_parameters must be a dict"),
            (
                {"rope_type": "default", "rope_theta": 0.0},
                ValueError,
                r"rope_theta must be a finite number > 0, got rope_theta=0.0",
            ),
        ],
    )
    def test_bad_rope_parameters(self, params, error, match):
        with pytest.raises(error, match=match):
            tiny_config("decoder", position_embedding_type="rope", rope_parameters=params)

    def test_scaling_without_rope_positions(self):
        with pytest.raises(ValueError, match="rope_type='linear' but position_embedding_type='learned'"):
            tiny_config("decoder", rope_parameters={"rope_type": "linear", "factor": 2.0})

    def test_llama_conversion_refuses_unsupported_scaling(self, tmp_path):
        config = llama_config(
            {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "factor": 2.0}
        )
        T.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
        with pytest.raises(Exception, match="rope_type='longrope' cannot be converted.*'llama3'"):
            convert(tmp_path / "llama", tmp_path / "ours", log=lambda line: None)
