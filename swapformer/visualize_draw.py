"""How `swapformer.visualize` draws: token labels as text, block averaging of long inputs, and the grid of
heatmaps sized for a normal screen with one shared colour scale.

The sizes are budgets in pixels at `DPI` (what `swapformer attention` saves at): a picture is at most
`MAX_WIDTH_PX` wide, so a full-HD screen shows its whole width, and grows downwards with more panels.
Tick labels are `LABEL_POINTS` tall; where a heatmap, as laid out, is too small for one label per token,
every k-th token is labelled, the smallest k that leaves each label its pitch."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

DEFAULT_MAX_TOKENS = 64  # longer inputs are block-averaged down to at most this many rows and columns
DPI = 120
MAX_WIDTH_PX = 1920
MAX_COLUMNS = 4
LABEL_POINTS = 6.0
LABEL_PITCH = 1.15  # a label's row, in label heights: the font's ascent and descent plus a gap
MIN_SIDE_IN = 1.6  # a heatmap is never smaller than this, so short inputs still read as a picture
COLOUR_BAR_IN = 0.9  # the colour bar with its numbers and its label
FRAME_IN = 0.8  # the figure's title, the "key" / "query" labels and the outer margins


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """One label per id: the tokenizer's own decoding of that id alone, so a byte-level BPE's `Ġthe` reads
    ` the` and WordPiece keeps its `##` continuations; then spaces are drawn as `␣` and other invisible
    characters as escapes (`\\n`, `\\t`), since a label that is blank or ends in a space can't be read.
    A token that decodes to nothing keeps its vocabulary form."""
    labels = []
    for i in ids:
        text = tokenizer.decode([int(i)], skip_special_tokens=False)
        labels.append(_visible(text) if text else tokenizer.convert_ids_to_tokens(int(i)))
    return labels


def _visible(text: str) -> str:
    return "".join(
        "\u2423" if ch == " " else ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )


def block_average(matrix: torch.Tensor, max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[torch.Tensor, int]:
    """(averaged, block): `matrix` (..., T, S) with each `block` x `block` square replaced by its mean,
    the smallest block that leaves at most `max_tokens` rows and columns (1: unchanged). The last block
    of a side may be shorter; it is averaged over the cells it has. Cells that were all zero stay 0."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    t, s = matrix.shape[-2:]
    block = max(1, math.ceil(max(t, s) / max_tokens))
    if block == 1:
        return matrix, 1
    rows, cols = math.ceil(t / block), math.ceil(s / block)
    padded = torch.nn.functional.pad(matrix, (0, cols * block - s, 0, rows * block - t))
    sums = padded.unflatten(-2, (rows, block)).unflatten(-1, (cols, block)).sum(dim=(-3, -1))
    counts = torch.ones(t, s).to(matrix.dtype)
    counts = torch.nn.functional.pad(counts, (0, cols * block - s, 0, rows * block - t))
    counts = counts.unflatten(-2, (rows, block)).unflatten(-1, (cols, block)).sum(dim=(-3, -1))
    return sums / counts, block


def block_labels(tokens: Sequence[str] | int, block: int) -> list[str]:
    """One label per block: the token itself, or "i-j first..last" for a block of several. An int
    `tokens` stands for that many positions, labelled by their indices ("i-j" for a block)."""
    if isinstance(tokens, int):
        return [
            str(i) if block == 1 else f"{i}-{min(i + block, tokens) - 1}" for i in range(0, tokens, block)
        ]
    if block == 1:
        return list(tokens)
    labels = []
    for start in range(0, len(tokens), block):
        stop = min(start + block, len(tokens)) - 1
        labels.append(f"{start}-{stop} {tokens[start]}..{tokens[stop]}")
    return labels


def grid_columns(count: int) -> int:
    """Columns for `count` panels: the fewest rows of at most MAX_COLUMNS, filled as evenly as they can be
    (12 heads: 3 rows of 4; 6: 2 of 3; 4: 1 of 4), so a picture is wider than tall while it fits."""
    return math.ceil(count / math.ceil(count / MAX_COLUMNS))


def chunked(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _label_inches(labels: Sequence[str]) -> float:
    """About how far the longest label reaches from its axis (a DejaVu character is ~0.6 em wide)."""
    return 0.15 + max(map(len, labels), default=1) * 0.6 * LABEL_POINTS / 72


def _layout(n_rows: int, n_cols: int, cells: int, labels: Sequence[str], colour_bar: bool):
    """(figure size in inches, heatmap side in inches, a first guess): heatmaps big enough to label every
    token, as wide as MAX_WIDTH_PX allows, never under MIN_SIDE_IN."""
    reach = _label_inches(labels)
    pitch = LABEL_POINTS / 72 * LABEL_PITCH
    room = (MAX_WIDTH_PX / DPI - FRAME_IN - COLOUR_BAR_IN * colour_bar) / n_cols - reach
    side = max(MIN_SIDE_IN, min(cells * pitch, room))
    width = n_cols * (side + reach) + FRAME_IN + COLOUR_BAR_IN * colour_bar
    height = n_rows * (side + reach + 0.45) + FRAME_IN  # 0.45: a panel's title and the gap below
    return (width, height), side


def _ticks(axes, ys: list[str], xs: list[str], every: int) -> None:
    for ax in axes:
        ax.set_yticks(range(0, len(ys), every), ys[::every], fontsize=LABEL_POINTS)
        ax.set_xticks(range(0, len(xs), every), xs[::every], fontsize=LABEL_POINTS, rotation=90)


def _label_every(cells: int, side_px: float, dpi: float) -> int:
    """The smallest k such that labelling every k-th of `cells` tokens leaves each label its pitch."""
    return max(1, math.ceil(cells / max(1, int(side_px / (LABEL_POINTS / 72 * dpi * LABEL_PITCH)))))


def _thin_labels(fig, axes, ys: list[str], xs: list[str], side: float) -> int:
    """Label every k-th token: k guessed from `side` (inches), then checked on the figure laid out with
    those labels (their lengths decide the heatmaps' room) and corrected if the guess was off."""
    cells = max(len(xs), len(ys))
    guess = _label_every(cells, side * fig.dpi, fig.dpi)
    _ticks(axes, ys, xs, guess)
    fig.draw_without_rendering()
    every = _label_every(cells, min(min(ax.bbox.width, ax.bbox.height) for ax in axes), fig.dpi)
    if every != guess:
        _ticks(axes, ys, xs, every)
    return every


def draw_grid(panels, row_tokens, col_tokens, max_tokens, *, cmap, title, scale=None, tick_every=None):
    """A Figure of heatmaps, `panels` being its rows of (title, matrix), queries down and keys across,
    labelled with `row_tokens` / `col_tokens` (or positions, for an int). All panels share one colour
    scale from 0 to the largest value drawn; `scale` names it on a colour bar (None: no bar)."""
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    shown = [[(name, *block_average(matrix, max_tokens)) for name, matrix in row] for row in panels]
    block = shown[0][0][2]
    ys, xs = block_labels(row_tokens, block), block_labels(col_tokens, block)
    n_rows, n_cols = len(shown), max(len(row) for row in shown)
    size, side = _layout(n_rows, n_cols, max(len(xs), len(ys)), xs + ys, scale is not None)
    top = max(float(matrix.max()) for row in shown for _, matrix, _ in row)
    norm = Normalize(0.0, top if top > 0 else 1.0)  # one scale, so shades compare across panels
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    images = []
    for ax_row, row in zip(fig.subplots(n_rows, n_cols, squeeze=False), shown):
        for ax in ax_row[len(row) :]:
            ax.set_axis_off()
        for ax, (name, matrix, _) in zip(ax_row, row):
            images.append(ax.imshow(matrix.numpy(), cmap=cmap, norm=norm, interpolation="nearest"))
            ax.set_box_aspect(len(ys) / len(xs))
            ax.set_title(name if block == 1 else f"{name} (blocks of {block} tokens)", fontsize=9)
    axes = [image.axes for image in images]
    fig.suptitle(title if block == 1 else f"{title} (block-averaged: {block} tokens per cell)")
    fig.supylabel("query", fontsize=10)
    key = fig.supxlabel("key", fontsize=10)
    if scale is not None:
        fig.colorbar(images[0], ax=axes, label=scale, aspect=20 * n_rows, pad=0.01)
    if tick_every:
        _ticks(axes, ys, xs, every := tick_every)
    else:
        every = _thin_labels(fig, axes, ys, xs, side)
    if every > 1:
        key.set_text(f"key (labels on 1 token in {every})")
    return fig
