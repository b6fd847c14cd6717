"""swapformer's model card in every saved folder and every upload, and the checks made before an upload.

- `write_card(model, folder)`: called by `save_pretrained`. Writes README.md (this package's
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
import pathlib
import subprocess
import sys
import tempfile

from huggingface_hub import ModelCard, ModelCardData

TEMPLATE = pathlib.Path(__file__).with_name("swapformer_card.md")
GENERATED_MARK = "<!-- swapformer:generated-card"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
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
CARRIED_METADATA = ("datasets", "metrics", "eval_results", "license", "language", "base_model")


class PublishError(ValueError):
    """A folder failed its preflight; nothing was uploaded."""


# The card ----------------------------------------------------------------------------------------


def is_generated(card_text: str) -> bool:
    return GENERATED_MARK in card_text


def auto_class_of(model) -> str:
    for name, cls in type(model).auto_classes.items():
        if cls is type(model):
            return name
    raise ValueError(f"{type(model).__name__} is not registered with an Auto class")


TASKS = {  # class name suffix -> (pipeline tag, usage lines with a tokenizer)
    "ForCausalLM": (
        "text-generation",
        'inputs = tokenizer("Once upon a time", return_tensors="pt")\n'
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))",
    ),
    "ForConditionalGeneration": (
        "text2text-generation",
        'inputs = tokenizer("Translate: hello", return_tensors="pt")\n'
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))",
    ),
    "ForMaskedLM": (
        "fill-mask",
        'inputs = tokenizer("The capital of France is " + tokenizer.mask_token, return_tensors="pt")\n'
        "logits = model(**inputs).logits  # (1, tokens, vocabulary)",
    ),
    "ForSequenceClassification": (
        "text-classification",
        'inputs = tokenizer("What a lovely day", return_tensors="pt")\nprint(model(**inputs).logits.softmax(-1))',
    ),
    "ForTokenClassification": (
        "token-classification",
        'inputs = tokenizer("Ada Lovelace lived in London", return_tensors="pt")\n'
        "print(model(**inputs).logits.argmax(-1))",
    ),
    "ForQuestionAnswering": (
        "question-answering",
        'inputs = tokenizer("Who wrote it?", "Ada wrote the first program.", return_tensors="pt")\n'
        "out = model(**inputs)\nprint(out.start_logits.argmax(-1), out.end_logits.argmax(-1))",
    ),
}
BASE_USAGE = (
    'inputs = tokenizer("Hello world", return_tensors="pt")\nprint(model(**inputs).last_hidden_state.shape)'
)


def usage_snippet(model, repo_id: str, with_tokenizer: bool) -> tuple[str, str]:
    """(pipeline tag, a snippet that runs on a machine with only torch and transformers)."""
    name, auto = type(model).__name__, auto_class_of(model)
    tag, usage = next(
        ((t, u) for suffix, (t, u) in TASKS.items() if name.endswith(suffix)),
        ("feature-extraction", BASE_USAGE),
    )
    seq2seq_base = model.config.is_encoder_decoder and tag == "feature-extraction"
    if seq2seq_base:
        usage = usage.replace(
            "model(**inputs)", 'model(**inputs, decoder_input_ids=inputs["input_ids"][:, :1])'
        )
    lines = [
        "import torch",
        f"from transformers import {auto}" + (", AutoTokenizer" if with_tokenizer else ""),
        "",
    ]
    lines.append(f'repo = "{repo_id}"')
    if (
        with_tokenizer
    ):  # without trust_remote_code, AutoTokenizer waits 15 s on a y/N prompt for such a folder
        lines.append("tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)")
    lines.append(f"model = {auto}.from_pretrained(repo, trust_remote_code=True).eval()")
    lines.append("with torch.no_grad():")
    if not with_tokenizer:  # ids of the model's own vocabulary stand in for a tokenizer's output
        usage = (
            usage.split("\n", 1)[1]
            .replace("**inputs", "input_ids=input_ids")
            .replace('inputs["input_ids"]', "input_ids")
        )
        usage = "input_ids = torch.tensor([[5, 6, 7, 8]])  # this repository has no tokenizer\n" + usage
        usage = usage.replace("tokenizer.decode(", "(")
    lines += ["    " + line for line in usage.splitlines()]
    return tag, "\n".join(lines)


LAYER_TEXT = {
    "full_attention": "every token",
    "sliding_attention": "the tokens within {w} positions",
    "sliding_global_attention": "the tokens within {w} positions, and the global tokens (global tokens see everything)",
    "bigbird_attention": "a window of {w}, the global tokens and {r} random blocks of {b} tokens (BigBird)",
}


def _layer_rows(config) -> list[tuple[str, str, str]]:
    rows = []
    types = list(config.layer_types) + list(getattr(config, "decoder_layer_types", None) or [])
    for layer_type in dict.fromkeys(types):
        where = [str(i) for i, t in enumerate(types) if t == layer_type]
        text = LAYER_TEXT[layer_type].format(
            w=config.sliding_window, r=config.num_random_blocks, b=config.attention_block_size
        )
        rows.append(
            (
                layer_type,
                ", ".join(where),
                text + (" (earlier tokens only)" if getattr(config, "causal", False) else ""),
            )
        )
    return rows


def card_for(
    model,
    *,
    repo_id: str,
    with_tokenizer: bool,
    tags=(),
    carried: ModelCard | None = None,
    training_text: str | None = None,
) -> ModelCard:
    """swapformer's card for `model`; `carried`'s data/results metadata is kept, `training_text` (e.g.
    Trainer's summary) becomes the training section."""
    from ..configuration import capability_table_markdown
    from .render import model_values

    cfg = model.config
    tag, usage = usage_snippet(model, repo_id, with_tokenizer)
    old = carried.data.to_dict() if carried is not None else {}
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=tag,
        tags=list(
            dict.fromkeys(["swapformer", cfg.model_type, "custom_code", *(old.get("tags") or []), *tags])
        ),
        model_name=repo_id.rsplit("/", 1)[-1],
        **{k: v for k, v in old.items() if k in CARRIED_METADATA and k != "eval_results" and v},
        eval_results=carried.data.eval_results if carried is not None else None,
    )
    results = [(r.metric_name or r.metric_type, r.metric_value) for r in (data.eval_results or [])]
    layers = (
        cfg.num_hidden_layers
        if not cfg.is_encoder_decoder
        else f"{cfg.num_hidden_layers} + {cfg.decoder_layers}"
    )
    return ModelCard.from_template(
        data,
        template_path=str(TEMPLATE),
        model_name=repo_id.rsplit("/", 1)[-1],
        description=f"A swapformer {('encoder-decoder' if cfg.is_encoder_decoder else 'decoder' if getattr(cfg, 'causal', False) else 'encoder')} model.",
        usage=usage,
        **model_values(model),
        num_parameters=f"{sum(p.numel() for p in model.parameters()):,}",
        layers=layers,
        attn=cfg._attn_implementation,
        layer_count=len(cfg.layer_types) + len(getattr(cfg, "decoder_layer_types", None) or []),
        layer_rows=_layer_rows(cfg),
        backend_table=capability_table_markdown(),
        results=results,
        training_data=training_text or "Not recorded with this model; add what it was trained on.",
        limitations="Whatever its training data and size imply; the card does not know them. A model saved "
        "with swapformer behaves as the same transformers model would, on every attention backend.",
    )


def _has_tokenizer(folder) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def write_card(model, folder, repo_id: str | None = None) -> bool:
    """Write swapformer's card as `folder`/README.md; False (nothing written) when the folder holds a card
    that someone wrote by hand."""
    path = os.path.join(folder, "README.md")
    carried = None
    if os.path.isfile(path):
        carried = ModelCard.load(path)
        if not is_generated(carried.content):
            return False
    repo_id = repo_id or os.path.basename(os.path.normpath(str(folder)))
    card_for(model, repo_id=repo_id, with_tokenizer=_has_tokenizer(folder), carried=carried).save(path)
    return True


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
        from ..modeling.modeling_base import SwapformerPreTrainedModel

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
            with_tokenizer=_has_tokenizer(folder),
            tags=summary.data.tags or (),
            carried=summary,
            training_text=training.replace("## ", "### "),
        ).save(path)
    preflight(folder, auto_class_of(model), ignore=TRAINER_IGNORE)


def _users_card(folder, repo_id: str | None) -> ModelCard | None:
    """A card someone wrote, in `folder` or else on the Hub under `repo_id`: neither swapformer's nor
    one Trainer generated (transformers marks those with its AUTOGENERATED_TRAINER_COMMENT)."""
    from huggingface_hub import HfApi

    from ..modeling.hf_compat import autogenerated_trainer_comment

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


__all__ = ["CardTrainerMixin", "PublishError", "card_for", "preflight", "push_model", "write_card"]
