"""Rewrite the generated blocks of README.md (the capability table) from the code."""

import pathlib
import re

import swapformer

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
text = README.read_text()
table = swapformer.capability_table_markdown()
text = re.sub(
    r"(<!-- capability-table:start -->\n).*?(\n<!-- capability-table:end -->)",
    lambda m: m.group(1) + table + m.group(2),
    text,
    flags=re.S,
)
README.write_text(text)
print("README.md capability table updated")
