"""Every relative link of the README and of the docs/ pages points at a file that exists and, for a
`#anchor`, at a heading (or an `<a id>`) of that file, as GitHub renders them."""

from __future__ import annotations

import pathlib
import re

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without fenced blocks and inline code, where brackets are code, not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    text = path.read_text()
    found, seen = set(), {}
    for line in re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    found |= set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    return found


def relative_links(page: pathlib.Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def broken(page: pathlib.Path) -> list[str]:
    bad = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken(page), f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken(page))


def test_the_checker_sees_links_and_anchors(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Top\n## CPU inference speed\n### Native sparse kernels on CPU\n## `--packing`, again\n"
        '<a id="run-15"></a>\n```\n## not a heading\n[x](missing.md)\n```\n'
    )
    assert anchors(tmp_path / "a.md") == {
        "top",
        "cpu-inference-speed",
        "native-sparse-kernels-on-cpu",
        "--packing-again",
        "run-15",
    }
    (tmp_path / "b.md").write_text(
        "[ok](a.md#top) [gone](c.md) [bad](a.md#nope) ![img](a.md) [web](https://x.org/y) `[code](z.md)`"
    )
    assert relative_links(tmp_path / "b.md") == ["a.md#top", "c.md", "a.md#nope", "a.md"]
    assert [b.split(":")[0] for b in broken(tmp_path / "b.md")] == ["c.md", "a.md#nope"]
