"""The README.md card of a converted folder: where it came from, how it was verified, how to load it."""

from __future__ import annotations

from pathlib import Path

from .io import auto_class
from .verify import ConversionReport


def card(report: ConversionReport, direction: str, tolerance: float) -> str:
    diffs = "\n".join(f"| {k} | {v:.3e} |" for k, v in report.diffs.items())
    name = Path(report.output).name
    if direction == "to swapformer":
        from .. import modeling

        auto = auto_class(getattr(modeling, report.target_class)).__name__
        load = (
            "import swapformer  # registers the classes (or pass trust_remote_code=True without it)\n"
            f'from transformers import {auto}\nmodel = {auto}.from_pretrained("{name}")'
        )
    else:
        load = f'from transformers import {report.target_class}\nmodel = {report.target_class}.from_pretrained("{name}")'
    long = copied = ""
    if report.long:
        copied = ", the position table copied (below)"
        v = report.long
        kinds = sorted(set(v["layer_types"]))
        long = f"""
Made long (Longformer's recipe): the learned position table of {v["source_positions"]} rows was copied
repeatedly up to {v["max_position_embeddings"]} rows; layer types {", ".join(kinds)}
(sliding_window {v["sliding_window"]}, global_tokens {v["global_tokens"]}). Inputs no longer than
{report.tokens} tokens compute what the source computes (checked below); longer inputs read the copied
rows, which the source never trained: continue pretraining (Longformer: masked LM) before relying on them.
"""
    return f"""---
library_name: transformers
tags: [swapformer, converted]
---

# {Path(report.output).name}

`{report.source_class}` (model_type `{report.family}`) from `{report.source}`, converted {direction} as
`{report.target_class}` by `swapformer convert`. The weights are the source's, renamed and reshaped only{copied}.
{long}
Verified after writing: both folders loaded again and run in fp32 on one batch of two sequences of
{report.tokens} tokens, the second right-padded; max abs diff on real tokens (tolerance {tolerance:g}):

| output | max abs diff |
|---|---|
{diffs}

```python
{load}
```
"""
