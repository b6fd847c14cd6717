"""swapformer's model card in every saved folder and every upload, and the checks made before an upload.

- `write_card(model, folder)` (swapformer_card.py, beside `card_for`): called by `save_pretrained`. Writes README.md (this package's
  swapformer_card.md) unless the folder holds a card swapformer did not generate: a user's text is
  never replaced. A card swapformer generated (it carries `GENERATED_MARK`) is refreshed, keeping its
  metadata about data and results.
- `push_model(model, repo_id, ...)`: what `model.push_to_hub` and `save_pretrained(push_to_hub=True)`
  do: save into a temporary folder and run `preflight` before the Hub hears of it, then read the
  repository's card (kept if a user wrote it, and checked), and only then create the repository and
  upload everything in one commit. With the Hub switched off (HF_HUB_OFFLINE) it stops at once.
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

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData

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
    files = uploaded_files(folder, ignore)
    problems = _card_problems(folder, files)
    for rel in files:
        parts = rel.split("/")
        if any(fnmatch.fnmatch(part, p) for part in parts[:-1] for p in RESUME_FOLDERS) or any(
            fnmatch.fnmatch(parts[-1], p) for p in RESUME_STATE
        ):
            problems.append(
                f"{rel} is training state for resuming (optimizer, scheduler, RNG or a checkpoint)"
            )
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
    _refuse(folder, problems)


def _card_problems(folder, files) -> list[str]:
    if "README.md" not in files:
        return []
    try:
        card = ModelCard.load(os.path.join(folder, "README.md"))
        ModelCardData(**card.data.to_dict())
    except Exception as e:  # huggingface_hub raises several kinds for malformed metadata
        return [f"README.md metadata does not parse as a model card ({e})"]
    return []


def _refuse(folder, problems: list[str]) -> None:
    if problems:
        raise PublishError(f"not uploaded: {folder} failed its preflight: " + "; ".join(problems))


def refuse_offline(call: str) -> None:
    """Stop an upload at once when huggingface_hub is switched off, naming the variable that did it."""
    from huggingface_hub import is_offline_mode
    from huggingface_hub.errors import OfflineModeIsEnabled

    if is_offline_mode():
        name = next(
            (v for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if os.environ.get(v)), "HF_HUB_OFFLINE"
        )
        raise OfflineModeIsEnabled(
            f"{call} needs the Hub, and {name}={os.environ.get(name, '1')} turns it off: nothing was sent. To "
            f"upload, unset {name} (or set it to 0); to keep the model on disk, save_pretrained(folder) needs no Hub"
        )


def full_repo_id(api, repo_id: str) -> str:
    """`repo_id` with its namespace: a bare name goes where create_repo would put it, the token owner's."""
    return repo_id if "/" in repo_id else f"{api.whoami()['name']}/{repo_id}"


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
    own card, when a user wrote it, with `tags` added). The Hub is only read until the folder passed
    `preflight` and the card to upload is checked; then the repository is created and the commit made."""
    refuse_offline(f"push_to_hub({repo_id!r})")
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        preflight(tmp, auto_class_of(model))  # the folder as saved, with swapformer's card
        repo_id = full_repo_id(api, repo_id)
        remote = _remote_card(api, repo_id, revision, token)
        readme = os.path.join(tmp, "README.md")
        if remote is not None and not is_generated(remote.content):
            remote.data.tags = list(dict.fromkeys([*(remote.data.tags or []), *(tags or [])]))
            remote.save(readme)  # the user's text, as it is on the Hub
        else:
            with_tokenizer = api.file_exists(repo_id, "tokenizer_config.json", revision=revision)
            card_for(
                model, repo_id=repo_id, with_tokenizer=with_tokenizer, tags=tags or (), carried=remote
            ).save(readme)
        _refuse(tmp, _card_problems(tmp, ["README.md"]))  # the card that goes up, now from the Hub's
        api.create_repo(repo_id, private=private, exist_ok=True)
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
    Other models (a PEFT wrapper, whose card is PEFT's, included) keep Trainer's card. The repository is
    created there too, once the preflight passed, not when Trainer asks for it (`init_hf_repo`)."""

    def init_hf_repo(self, token=None, private=None):
        """Trainer's, without creating the repository yet: only its name is settled here."""
        if not self.is_world_process_zero():
            return
        strategy = getattr(self.args.hub_strategy, "value", self.args.hub_strategy)
        if self.args.push_to_hub and strategy != "end":
            raise ValueError(
                f"push_to_hub=True with hub_strategy={strategy!r} uploads each checkpoint's folder during "
                "training, where swapformer's preflight does not run; set hub_strategy='end' (the model is "
                "pushed when saved, after the preflight), or use transformers' Trainer"
            )
        name = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        token = token if token is not None else self.args.hub_token
        name = full_repo_id(HfApi(token=token), name)
        self.hub_model_id, self.push_in_progress = name, None
        self._hub_repo = dict(token=token, private=self.args.hub_private_repo if private is None else private)

    def create_model_card(self, *args, **kwargs):
        from ..modeling.heads.modeling_base import SwapformerPreTrainedModel

        folder = self.args.output_dir
        model = self.accelerator.unwrap_model(self.model)
        ours = isinstance(model, SwapformerPreTrainedModel) and self.is_world_process_zero()
        users = _users_card(folder, self.hub_model_id) if ours else None
        super().create_model_card(*args, **kwargs)
        if ours:
            trainer_card_to_swapformer(model, folder, self.hub_model_id, users)
        if self.is_world_process_zero() and (repo := getattr(self, "_hub_repo", None)) is not None:
            HfApi(token=repo["token"]).create_repo(self.hub_model_id, private=repo["private"], exist_ok=True)


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
