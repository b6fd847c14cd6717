"""swapformer's model card in every saved folder and every upload, and the checks made before an upload.

- `write_card(model, folder)` (swapformer_card.py, beside `card_for`): called by `save_pretrained`. Writes README.md (this package's
  swapformer_card.md) unless the folder holds a card swapformer did not generate: a user's text is
  never replaced. A card swapformer generated (it carries `GENERATED_MARK`) is refreshed, keeping its
  metadata about data and results.
- `push_model(model, repo_id, ...)`: what `model.push_to_hub` and `save_pretrained(push_to_hub=True)`
  do: save into a temporary folder, keep the repository's own card if a user wrote it, run
  `preflight`, and upload everything in one commit.
- `CardTrainerMixin`: a Trainer class built with it (`class CardTrainer(CardTrainerMixin, Trainer)`)
  uploads swapformer's card from `push_to_hub` (Trainer's training summary kept as a section of it),
  after the same preflight. transformers' own `Trainer` is left as it is: a plain Trainer uploads
  Trainer's card.
- `preflight(folder, auto_class)`: the folder loads with `trust_remote_code=True` in a clean
  interpreter where swapformer cannot be imported, the card's metadata parses as huggingface_hub's
  `ModelCardData`, and no resume checkpoint or optimizer state would be uploaded. A failure raises
  `PublishError` naming every problem, before anything is sent.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tempfile

from huggingface_hub import ModelCard, ModelCardData

from .swapformer_card import (
    GENERATED_MARK,
    auto_class_of,
    card_for,
    has_tokenizer,
    is_generated,
    write_card,
)

# Files a model repository must not receive: the state a training run resumes from.
RESUME_STATE = (
    "optimizer*.pt",
    "optimizer*.bin",
    "optimizer*.safetensors",
    "scheduler*.pt",
    "scaler*.pt",
    "rng_state*.pth",
    "random_states_*.pkl",
)
RESUME_FOLDERS = ("checkpoints", "checkpoint-*")
# Trainer.push_to_hub leaves these out of its upload
TRAINER_IGNORE = ("_*", "checkpoint-*")


class PublishError(ValueError):
    """A folder failed its preflight; nothing was uploaded."""


# Preflight -----------------------------------------------------------------------------------------

_CLEAN_LOAD = """
import json, sys
sys.modules["swapformer"] = None  # as on a machine without swapformer
import transformers
model = getattr(transformers, sys.argv[2]).from_pretrained(sys.argv[1], trust_remote_code=True)
print(json.dumps({"class": type(model).__name__, "module": type(model).__module__}))
"""


def uploaded_files(folder, ignore=()) -> list[str]:
    """Paths (relative, '/'-separated) of the files an upload of `folder` sends."""
    files = []
    for root, _dirs, names in os.walk(folder):
        rel_root = os.path.relpath(root, folder)
        for name in names:
            rel = name if rel_root == "." else f"{rel_root}/{name}".replace(os.sep, "/")
            if not any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel.split("/")[0], p) for p in ignore):
                files.append(rel)
    return sorted(files)


def preflight(folder, auto_class: str, *, ignore=()) -> None:
    problems = []
    files = uploaded_files(folder, ignore)
    for rel in files:
        parts = rel.split("/")
        if any(fnmatch.fnmatch(part, p) for part in parts[:-1] for p in RESUME_FOLDERS) or any(
            fnmatch.fnmatch(parts[-1], p) for p in RESUME_STATE
        ):
            problems.append(
                f"{rel} is training state for resuming (optimizer, scheduler, RNG or a checkpoint)"
            )
    if "README.md" in files:
        try:
            card = ModelCard.load(os.path.join(folder, "README.md"))
            ModelCardData(**card.data.to_dict())
        except Exception as e:  # huggingface_hub raises several kinds for malformed metadata
            problems.append(f"README.md metadata does not parse as a model card ({e})")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(
        [sys.executable, "-c", _CLEAN_LOAD, os.fspath(folder), auto_class],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if run.returncode != 0:
        tail = " | ".join(run.stderr.strip().splitlines()[-3:])
        problems.append(
            f"the folder does not load with {auto_class}.from_pretrained(..., trust_remote_code=True) without swapformer: {tail}"
        )
    if problems:
        raise PublishError(f"not uploaded: {folder} failed its preflight: " + "; ".join(problems))


# Uploads ---------------------------------------------------------------------------------------------


def _remote_card(api, repo_id: str, revision: str | None, token):
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return (
            ModelCard.load(repo_id, token=token)
            if api.file_exists(repo_id, "README.md", revision=revision)
            else None
        )
    except EntryNotFoundError:
        return None


def push_model(
    model,
    repo_id: str,
    *,
    commit_message=None,
    commit_description=None,
    private=None,
    token=None,
    revision=None,
    create_pr=False,
    max_shard_size="50GB",
    tags=None,
):
    """`model.push_to_hub`: one commit with the saved folder and swapformer's card (or the repository's
    own card, when a user wrote it, with `tags` added), after `preflight`."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    remote = _remote_card(api, repo_id, revision, token)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        readme = os.path.join(tmp, "README.md")
        if remote is not None and not is_generated(remote.content):
            remote.data.tags = list(dict.fromkeys([*(remote.data.tags or []), *(tags or [])]))
            remote.save(readme)  # the user's text, as it is on the Hub
        else:
            with_tokenizer = api.file_exists(repo_id, "tokenizer_config.json", revision=revision)
            card_for(
                model, repo_id=repo_id, with_tokenizer=with_tokenizer, tags=tags or (), carried=remote
            ).save(readme)
        preflight(tmp, auto_class_of(model))
        operations = [
            CommitOperationAdd(path_in_repo=rel, path_or_fileobj=os.path.join(tmp, rel))
            for rel in uploaded_files(tmp)
        ]
        return api.create_commit(
            repo_id=repo_id,
            operations=operations,
            commit_message=commit_message or "Upload model",
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )


class CardTrainerMixin:
    """Put it before `transformers.Trainer` (or a subclass of it) in a Trainer class of your own, and
    `trainer.push_to_hub()` uploads swapformer's card for a swapformer model:

        class CardTrainer(CardTrainerMixin, Trainer): ...

    It overrides `Trainer.create_model_card`, which `push_to_hub` calls after saving the model and just
    before uploading the output folder: Trainer's card is written, then replaced by swapformer's card
    with Trainer's summary as its training section (a card the user wrote, in the folder or on the Hub,
    is kept, with Trainer's tags added), and the folder must pass `preflight`, or nothing is uploaded.
    Other models (a PEFT wrapper, whose card is PEFT's, included) keep Trainer's card."""

    def create_model_card(self, *args, **kwargs):
        from ..modeling.heads.modeling_base import SwapformerPreTrainedModel

        folder = self.args.output_dir
        model = self.accelerator.unwrap_model(self.model)
        ours = isinstance(model, SwapformerPreTrainedModel) and self.is_world_process_zero()
        users = _users_card(folder, self.hub_model_id) if ours else None
        super().create_model_card(*args, **kwargs)
        if ours:
            trainer_card_to_swapformer(model, folder, self.hub_model_id, users)


def trainer_card_to_swapformer(model, folder, repo_id: str | None, users: ModelCard | None) -> None:
    """Replace the card Trainer wrote in `folder` by swapformer's (or keep `users`, the card someone
    wrote, with Trainer's tags added), then run `preflight` on what Trainer uploads."""
    path = os.path.join(folder, "README.md")
    summary = ModelCard.load(path)
    if users is not None:
        users.data.tags = list(dict.fromkeys([*(users.data.tags or []), *(summary.data.tags or [])]))
        users.save(path)
    else:
        text = summary.text.split("## Training procedure", 1)
        training = "Trained with transformers' Trainer. " + (
            "## Training procedure" + text[1] if len(text) > 1 else ""
        )
        card_for(
            model,
            repo_id=repo_id or os.path.basename(os.path.normpath(folder)),
            with_tokenizer=has_tokenizer(folder),
            tags=summary.data.tags or (),
            carried=summary,
            training_text=training.replace("## ", "### "),
        ).save(path)
    preflight(folder, auto_class_of(model), ignore=TRAINER_IGNORE)


def _users_card(folder, repo_id: str | None) -> ModelCard | None:
    """A card someone wrote, in `folder` or else on the Hub under `repo_id`: neither swapformer's nor
    one Trainer generated (transformers marks those with its AUTOGENERATED_TRAINER_COMMENT)."""
    from huggingface_hub import HfApi

    from ..modeling.compat.hf_compat import autogenerated_trainer_comment

    def written_by_hand(card: ModelCard) -> bool:
        return not is_generated(card.content) and autogenerated_trainer_comment().strip() not in card.content

    path = os.path.join(folder, "README.md")
    if os.path.isfile(path) and written_by_hand(card := ModelCard.load(path)):
        return card
    if repo_id is not None:
        remote = _remote_card(HfApi(), repo_id, None, None)
        if remote is not None and written_by_hand(remote):
            return remote
    return None


__all__ = [
    "GENERATED_MARK",
    "CardTrainerMixin",
    "PublishError",
    "card_for",
    "preflight",
    "push_model",
    "write_card",
]
