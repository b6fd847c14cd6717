"""Verification: the source and the converted model, loaded afresh from their folders, run on the
same padded batch; the max abs diffs of their outputs (fp32) must stay within a tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .io import load
from .rules import ConversionError

TOLERANCE = 1e-4
SWAPFORMER_TYPES = ("swapformer_encoder", "swapformer_decoder", "swapformer_seq2seq")


class VerificationError(ConversionError):
    """The converted model does not compute what the source computes."""


@dataclass
class ConversionReport:
    """What `convert` did: the classes on both sides and the measured max abs diffs (fp32)."""

    source: str
    output: str
    family: str
    source_class: str
    target_class: str
    diffs: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    # a long model (stretch.py): the source's positions and the config values set
    long: dict = field(default_factory=dict)

    @property
    def max_diff(self) -> float:
        """The largest diff; NaN if any is NaN (Python's max would skip it depending on order)."""
        values = list(self.diffs.values())
        return float("nan") if any(v != v for v in values) else max(values, default=0.0)


def batch(config, pad_token_id: int | None, seq2seq: bool, length: int | None = None, window_limit: int = 64):
    """Inputs for both models: two rows, the second right-padded by a third, real tokens never the
    pad id (RoBERTa counts positions over non-pad ids). No padding when there is no pad id. `length`
    tokens when given; by default 24, or more so that a window up to `window_limit` is cut by the batch
    (a family whose window is its point raises the limit), at most the learned position table."""
    if length is None:
        length = 24
        window = config.sliding_window
        if window is not None and window <= window_limit:
            length = max(length, window + 8)  # the window must cut something
        if config.position_embedding_type == "learned":
            length = min(length, config.max_position_embeddings)
    if pad_token_id is not None and not 0 <= pad_token_id < config.vocab_size:
        pad_token_id = None  # e.g. GPT-2 configs naming id 50256 in a smaller vocabulary
    g = torch.Generator().manual_seed(0)
    high = config.vocab_size - (pad_token_id is not None)

    def ids_and_mask(n: int):
        ids = torch.randint(0, high, (2, n), generator=g)
        mask = torch.ones(2, n, dtype=torch.long)
        if pad_token_id is not None:
            ids[ids >= pad_token_id] += 1
            mask[1, n - n // 3 :] = 0
            ids[mask == 0] = pad_token_id
        return ids, mask

    ids, mask = ids_and_mask(length)
    inputs = {"input_ids": ids, "attention_mask": mask}
    masks = {"encoder": mask}
    if seq2seq:
        dec, dec_mask = ids_and_mask(max(4, length // 2))
        inputs.update(decoder_input_ids=dec, decoder_attention_mask=dec_mask)
        masks["decoder"] = dec_mask
    return inputs, masks


def diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> float:
    """max |a - b| over real tokens (padded positions are not compared: swapformer zeroes what
    transformers leaves as an average, see docs/architecture.md)."""
    if a.shape != b.shape:
        raise VerificationError(f"Output shapes differ: {tuple(a.shape)} against {tuple(b.shape)}")
    d = (a.float() - b.float()).abs()
    if mask is not None and d.dim() >= 2 and tuple(d.shape[:2]) == tuple(mask.shape):
        d = d[mask.bool()]
    return float(d.max()) if d.numel() else 0.0


@torch.no_grad()
def compare(
    reference, candidate, config, pad_token_id: int | None, length: int | None = None, family=None
) -> tuple[dict[str, float], int]:
    """Run two models on the same padded batch (of `length` tokens, by default `batch`'s); max abs
    diffs of hidden states and logits. A `family` (family.py) sets how long a window the batch must
    cut and may add inputs besides tokens and padding (Longformer's `global_attention_mask`)."""
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    limit = family.verify_window_limit if family is not None else 64
    inputs, masks = batch(config, pad_token_id, seq2seq, length, window_limit=limit)
    if family is not None and family.verification_inputs is not None:
        inputs = family.verification_inputs(config, inputs)
    a = reference(**inputs, output_hidden_states=True, return_dict=True)
    b = candidate(**inputs, output_hidden_states=True, return_dict=True)
    diffs = {}
    if seq2seq:
        diffs["encoder hidden states"] = diff(
            a.encoder_last_hidden_state, b.encoder_last_hidden_state, masks["encoder"]
        )
        diffs["decoder hidden states"] = diff(
            a.decoder_hidden_states[-1], b.decoder_hidden_states[-1], masks["decoder"]
        )
    else:
        base_inputs = {
            k: inputs[k] for k in ("input_ids", "attention_mask", "global_attention_mask") if k in inputs
        }
        ha = reference.base_model(**base_inputs, return_dict=True).last_hidden_state
        hb = candidate.base_model(**base_inputs, return_dict=True).last_hidden_state
        diffs["hidden states"] = diff(ha, hb, masks["encoder"])
    token_mask = masks["decoder" if seq2seq else "encoder"]
    for name in ("logits", "start_logits", "end_logits"):
        if getattr(a, name, None) is not None:
            diffs[name] = diff(getattr(a, name), getattr(b, name), token_mask)
    if getattr(a, "pooler_output", None) is not None:  # (B, E): one vector per row, no token mask
        diffs["pooler output"] = diff(a.pooler_output, b.pooler_output, None)
    return diffs, inputs["input_ids"].shape[1]


def verify_folders(
    source_class,
    src: Path,
    target_class,
    tmp: Path,
    pad_token_id,
    use_safetensors: bool,
    length=None,
    family=None,
):
    """Both folders loaded afresh from disk in fp32 (nothing shared with the tensors just written),
    run on the same batch; the batch is sized by the swapformer side's config, or `length` tokens."""
    reference = load(source_class, src, dtype=torch.float32, use_safetensors=use_safetensors)
    candidate = load(target_class, tmp, dtype=torch.float32)
    swapformer_side = candidate if candidate.config.model_type in SWAPFORMER_TYPES else reference
    return compare(reference, candidate, swapformer_side.config, pad_token_id, length, family)


def check_within(report: ConversionReport, tolerance: float, out: Path, log) -> None:
    """Log the measured diffs; VerificationError when one is above `tolerance` (or NaN)."""
    for name, value in report.diffs.items():
        log(f"verification: {name} max abs diff {value:.3e}")
    if not report.max_diff <= tolerance:
        raise VerificationError(
            f"Verification failed: max abs diff {report.max_diff:.3e} > tolerance {tolerance:g} "
            f"({report.source_class} against {report.target_class}: {report.diffs}); nothing was written to {out}"
        )
