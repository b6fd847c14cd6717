"""The README's generated parts stay in sync with the code."""

from __future__ import annotations

import re

import swapformer
from swapformer.cli import main

from conftest import ROOT

README = ROOT / "README.md"


def test_capability_table_in_readme_is_generated_from_the_code():
    text = README.read_text()
    block = re.search(r"<!-- capability-table:start -->\n(.*?)\n<!-- capability-table:end -->", text, re.S)
    assert block, "README lost its capability-table markers"
    assert block.group(1).strip() == swapformer.capability_table_markdown().strip()


def test_cli_prints_the_table(capsys):
    assert main(["backends"]) == 0
    assert capsys.readouterr().out.strip() == swapformer.capability_table_markdown().strip()
