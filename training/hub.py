"""Uploading a finished `swapformer train` folder to the Hugging Face Hub (`--push-to-hub`)."""

from __future__ import annotations

import pathlib

# What stays on this machine: the Accelerate states kept for --resume (optimizer moments and RNG
# states, several times the model's size), which a model repository does not need.
HUB_IGNORE = ("checkpoints/",)


class HubPushError(RuntimeError):
    """The upload failed; the trained folder itself is complete and untouched."""


def push_folder(out: pathlib.Path, repo_id: str, *, private: bool = False) -> str:
    """Create `repo_id` if needed and upload the folder `out` (all but HUB_IGNORE) in one commit;
    returns the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(out),
            ignore_patterns=[f"{pattern}*" for pattern in HUB_IGNORE],
            commit_message="Upload model trained with swapformer train",
        )
    except Exception as e:  # network, authentication, permissions: all end the same way for the user
        raise HubPushError(
            f"training finished and {out} is complete, but uploading it to {repo_id!r} failed ({e}); "
            f"log in (`hf auth login` or HF_TOKEN) and push the folder again with huggingface_hub's "
            f"upload_folder(repo_id={repo_id!r}, folder_path={str(out)!r}, ignore_patterns=['checkpoints/*'])"
        ) from e
    return getattr(commit, "commit_url", str(commit))
