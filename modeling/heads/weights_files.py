"""Safetensors files cut short (an interrupted copy or download), named with their size and the fix, where
safetensors' own error ("incomplete metadata, file not fully covered") names neither. Read when loading
a swapformer model fails in safetensors (modeling_base.py) and by `swapformer convert` before it loads
its source (conversion/io.py)."""

from __future__ import annotations

import json
from pathlib import Path

AGAIN = "copy or download it again"


def safetensors_problem(path) -> str | None:
    """What makes `path` not a whole safetensors file (cut short, or a header that does not parse), or None.
    Reads the 8-byte header length and the header only."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or 8 + length > size:
            return f"{path} is truncated or not a safetensors file ({size} bytes, too short for its header); {AGAIN}"
        try:
            header = json.loads(f.read(length))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            return f"{path} has an unreadable safetensors header ({e!r}); {AGAIN}"
    if 8 + length + end > size:
        return f"{path} is truncated: its header describes {8 + length + end} bytes but the file has {size} bytes; {AGAIN}"
    return None


def truncated_weights(folder, subfolder: str = "") -> str | None:
    """The problem of the first safetensors file in a local model folder that is not whole, or None (a
    Hub id, or every file whole: then the error was something else)."""
    where = Path(folder) / subfolder
    if not where.is_dir():
        return None
    problems = (safetensors_problem(path) for path in sorted(where.glob("*.safetensors")))
    return next((p for p in problems if p is not None), None)
