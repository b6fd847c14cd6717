"""The capability table as Markdown: the README's table and its notes are generated from this."""

from __future__ import annotations

from .capability_table import BACKENDS, FEATURES


def capability_table_markdown() -> str:
    """The backend x feature table, as Markdown (the README's copy is generated from this)."""
    head = "| backend | " + " | ".join(f.replace("_", " ") for f in FEATURES) + " |"
    rule = "|" + "---|" * (len(FEATURES) + 1)
    rows = []
    for name, caps in BACKENDS.items():
        cells = []
        for feature in FEATURES:
            value = getattr(caps, feature)
            if isinstance(value, bool):
                cells.append("yes" if value else "no")
            elif isinstance(value, tuple):
                cells.append(", ".join(value) if value else "none")
            else:
                cells.append(str(value))
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    notes = [
        f"- `{name}`: "
        + "; ".join(
            filter(
                None,
                (
                    caps.note,
                    caps.no_compile and f"not compiled: {caps.no_compile}",
                    caps.no_sinks and f"no sinks: {caps.no_sinks}",
                ),
            )
        )
        for name, caps in BACKENDS.items()
        if caps.note or caps.no_compile or caps.no_sinks
    ]
    notes.append(
        "- compile: the devices where the model runs inside `torch.compile(fullgraph=True)` and `torch.export` "
        "(tested on CPU; the CUDA entries are not run by this project's CPU-only tests)"
    )
    return "\n".join([head, rule, *rows, "", *notes])
