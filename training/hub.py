"""Uploading a finished `swapformer train` folder to the Hugging Face Hub (`--push-to-hub`)."""

from __future__ import annotations

import json
import pathlib

from ..hub_cards.publish import preflight, refuse_offline

# What stays on this machine: the Accelerate states kept for --resume (optimizer moments and RNG
# states, several times the model's size), which a model repository does not need.
HUB_IGNORE = ("checkpoints/",)


class HubPushError(RuntimeError):
    """The upload failed; the trained folder itself is complete and untouched."""


def push_folder(out: pathlib.Path, repo_id: str, *, private: bool = False) -> str:
    """Check the folder `out` as `model.push_to_hub` checks its own (`hub_cards.publish.preflight`: it
    loads without swapformer, its card parses, no training state goes up), then create `repo_id` if
    needed and upload the folder (all but HUB_IGNORE) in one commit; returns the commit's URL. Nothing
    reaches the Hub, not even an empty repository, before the check passes."""
    from huggingface_hub import HfApi

    refuse_offline(f"--push-to-hub {repo_id}")
    ignore = [f"{pattern}*" for pattern in HUB_IGNORE]
    preflight(out, auto_class_of_folder(out), ignore=ignore)
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(out),
            ignore_patterns=ignore,
            commit_message="Upload model trained with swapformer train",
        )
    except Exception as e:  # network, authentication, permissions: all end the same way for the user
        raise HubPushError(
            f"training finished and {out} is complete, but uploading it to {repo_id!r} failed ({e}); "
            f"log in (`hf auth login` or HF_TOKEN) and push the folder again with huggingface_hub's "
            f"upload_folder(repo_id={repo_id!r}, folder_path={str(out)!r}, ignore_patterns=['checkpoints/*'])"
        ) from e
    return getattr(commit, "commit_url", str(commit))


def auto_class_of_folder(out: pathlib.Path) -> str:
    """The Auto class a saved folder's config maps its model class to (`auto_map`), as the preflight loads
    it: AutoModelForCausalLM for a decoder's run, AutoModelForMaskedLM for an encoder's."""
    config = json.loads((out / "config.json").read_text())
    model_class = (config.get("architectures") or [""])[0]
    for auto_class, target in config.get("auto_map", {}).items():
        if auto_class != "AutoConfig" and target.rpartition(".")[2] == model_class:
            return auto_class
    raise ValueError(
        f"{out / 'config.json'} names no Auto class for {model_class or 'its model'} in auto_map; the folder "
        "was not written by swapformer train (write it again, or upload it with huggingface_hub yourself)"
    )
