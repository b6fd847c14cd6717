"""The repository describes itself: no tracked file points at documents outside it (a person who
clones it has nothing else), and docs/architecture.md puts its map before its decisions."""

import re
import subprocess
from pathlib import Path

from conftest import ROOT

# documents that lived beside the repository while it was written, and the notes file they replaced
OUTSIDE = re.compile(r"\.\./shared|HF_NOTES|\bSTYLE\.md|(?<![\w/])DESIGN\.md|DESIGN_NOTES")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    suffixes = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".yaml", ".yml", ".json", ".j2", ""}
    return [ROOT / p for p in out.split() if Path(p).suffix in suffixes and (ROOT / p).is_file()]


def test_no_file_points_outside_the_repository():
    me = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in tracked_text_files()
        if path != me
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def test_the_probe_catches_each_kind():
    for line in (
        "see ../shared/DESIGN.md",
        "(HF_NOTES.md)",
        "STYLE.md says",
        "refines DESIGN.md",
        "DESIGN_NOTES",
    ):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search("docs/architecture.md")


def test_architecture_puts_the_map_before_the_decisions():
    text = (ROOT / "docs" / "architecture.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    names = [h.lower() for h in headings]
    assert any("map" in h for h in names) and any("decisions" in h for h in names), headings
    first_map = next(i for i, h in enumerate(names) if "map" in h)
    first_decisions = next(i for i, h in enumerate(names) if "decisions" in h)
    assert first_map < first_decisions, headings
    assert not (ROOT / "DESIGN_NOTES.md").exists()
