"""Loading a swapformer model whose safetensors file was cut short (issue 28) says which file, its size
and what to do, in one line, as `swapformer convert` does for a source checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

import swapformer

from conftest import build, tiny_config

LOADERS = {
    "DecoderForCausalLM": swapformer.DecoderForCausalLM.from_pretrained,
    "AutoModelForCausalLM": transformers.AutoModelForCausalLM.from_pretrained,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    model.save_pretrained(folder / "whole")
    model.save_pretrained(folder / "sharded", max_shard_size="20KB")
    return folder


def cut(folder, name: str, keep) -> int:
    """Cut `name` in `folder` to `keep(size)` bytes; return the size left."""
    path = folder / name
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])
    return path.stat().st_size


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("keep", [lambda n: n - 100, lambda n: 5], ids=["data", "header"])
def test_a_truncated_model_safetensors_is_named_with_its_size(saved, tmp_path, loader, keep):
    whole = LOADERS[loader](saved / "whole")
    assert isinstance(whole, swapformer.DecoderForCausalLM)
    copy = shutil.copytree(saved / "whole", tmp_path / "copy")
    size = cut(copy, "model.safetensors", keep)
    with pytest.raises(ValueError) as error:
        LOADERS[loader](copy)
    message = str(error.value)
    assert f"{copy / 'model.safetensors'} is truncated" in message
    assert f"{size} bytes" in message
    assert "copy or download it again" in message
    assert "\n" not in message


def test_a_truncated_shard_is_the_one_named(saved, tmp_path):
    copy = shutil.copytree(saved / "sharded", tmp_path / "copy")
    shards = sorted(copy.glob("model-*.safetensors"))
    assert len(shards) > 1
    size = cut(copy, shards[-1].name, lambda n: n - 10)
    with pytest.raises(ValueError, match=f"{shards[-1].name} is truncated: .* the file has {size}"):
        swapformer.DecoderForCausalLM.from_pretrained(copy)


def test_an_intact_folder_loads_the_saved_weights(saved):
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    loaded = swapformer.DecoderForCausalLM.from_pretrained(saved / "whole")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
