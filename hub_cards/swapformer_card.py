"""swapformer's model card: the text and metadata written as README.md into every saved folder.

`card_for(model, ...)` fills swapformer_card.md (what the model is, its layer types, the backend table,
a usage snippet that runs with transformers alone); `write_card(model, folder)` writes it unless the
folder holds a card someone wrote (a card swapformer generated carries `GENERATED_MARK`). The upload
paths that carry the card are in publish.py.
"""

from __future__ import annotations

import os
import pathlib

from huggingface_hub import ModelCard, ModelCardData

TEMPLATE = pathlib.Path(__file__).with_name("swapformer_card.md")
GENERATED_MARK = "<!-- swapformer:generated-card"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
CARRIED_METADATA = ("datasets", "metrics", "eval_results", "license", "language", "base_model")


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


def has_tokenizer(folder) -> bool:
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
    card_for(model, repo_id=repo_id, with_tokenizer=has_tokenizer(folder), carried=carried).save(path)
    return True
