"""The library's shape, as issue 27 set it: no import cycle between its modules, and no module much
over 300 lines (a newcomer reads one in a sitting)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from conftest import PACKAGES, ROOT

MAX_LINES = 310  # "about 300"


def library_modules() -> dict[str, Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    modules = {}
    for file in out.stdout.split():
        parts = Path(file).with_suffix("").parts
        if parts[0] in PACKAGES:
            name = ".".join([PACKAGES[parts[0]], *parts[1:]]).removesuffix(".__init__")
            modules[name] = ROOT / file
    # the top-level modules the wheel installs beside the package (the console script)
    listed = re.search(r"^py-modules = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for name in re.findall(r'"([\w.]+)"', listed):
        modules[name] = ROOT / f"{name}.py"
    return modules


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: the modules it imports (relative imports, inside functions too)} for {module: (source,
    is_package)}. An import deferred into a function still ties the two modules in a cycle (it only
    hides it from the interpreter); one under `if TYPE_CHECKING:` never runs. `from pkg import mod`
    depends on `mod`, not on all of `pkg`."""
    graph = {}
    for name, (source, is_package) in sources.items():
        package = name if is_package else name.rpartition(".")[0]
        deps = set()
        tree = ast.parse(source)
        typing_only = {
            id(inner)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for inner in ast.walk(block)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level and id(node) not in typing_only:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                submodules = {f"{target}.{alias.name}" for alias in node.names} & set(sources)
                deps |= (submodules or {target}) & set(sources) - {name}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, path, found = {}, [], []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                found.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycle_in_the_library():
    modules = library_modules()
    sources = {name: (path.read_text(), path.name == "__init__.py") for name, path in modules.items()}
    found = cycles(import_graph(sources))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_probe_finds_a_cycle():
    sources = {
        "p": ("", True),
        "p.a": ("from .b import x\n", False),
        "p.b": ("def f():\n    from .a import y\n", False),  # deferred into a function: still a cycle
        "p.c": ("from .d import x\n", False),
        "p.d": ("from . import c\n", False),
        "p.e": ("from . import d\n", False),  # imports p.d only, not the package p
        "p.f": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .g import z\n", False),
        "p.g": ("from .f import w\n", False),
    }
    assert cycles(import_graph(sources)) == [["p.a", "p.b", "p.a"], ["p.c", "p.d", "p.c"]]


def test_the_library_includes_the_console_script_module():
    assert library_modules()["swapformer_command"].is_file()


def test_no_library_module_is_much_over_300_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in library_modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
