"""The lowest versions pyproject.toml allows, as pip constraints (`name==lower bound`), or with --check,
whether the installed versions are those (exit 1 naming each that is not).

scripts/test_lowest.sh installs these into a second environment and runs part of the suite there, so
every lower bound the package declares is one the tests have run on.
"""

from __future__ import annotations

import pathlib
import re
import sys
from importlib.metadata import PackageNotFoundError, version

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def lower_bounds() -> dict[str, str]:
    """{distribution name: its declared lower bound}, for the dependencies that declare one."""
    text = PYPROJECT.read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.S | re.M).group(1)
    bounds = {}
    for requirement in re.findall(r'"([^"]+)"', block):
        match = re.match(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", requirement)
        if match:
            bounds[match.group(1)] = match.group(2)
    return bounds


def _release(v: str) -> tuple[int, ...]:
    """(2, 13, 0) for "2.13" or "2.13.0+cpu": the numbers of a version, padded to three."""
    numbers = [int(n) for n in re.findall(r"\d+", v.split("+")[0])[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


def main(argv: list[str]) -> int:
    bounds = lower_bounds()
    if "--check" not in argv:
        print("\n".join(f"{name}=={bound}" for name, bound in bounds.items()))
        return 0
    wrong = []
    for name, bound in bounds.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = "not installed"
        if installed == "not installed" or _release(installed) != _release(bound):
            wrong.append(f"{name} {installed} (lower bound {bound})")
    if wrong:
        print("not at the declared lower bounds: " + "; ".join(wrong), file=sys.stderr)
        return 1
    print(f"all {len(bounds)} dependencies at their declared lower bounds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
