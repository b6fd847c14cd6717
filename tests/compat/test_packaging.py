"""Packaging (issue 28): `pip install -e .` and the wheel build print no warning, and the wheel holds every
module, the C++ sources the sparse backend compiles at run time and the console-script launcher.

Both run on a copy of the checkout (a build writes build/ and *.egg-info beside the sources) and install
into a throwaway environment, never the one running the tests. pip is the running one, driving the
throwaway interpreter through `--python`: a venv's bundled pip may predate pip's relaying of the build
backend's warnings, which would make the check pass unseen.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from conftest import PACKAGES

ROOT = Path(__file__).resolve().parents[2]


def checkout_files() -> list[str]:
    """The checkout's files as a clone would have them: tracked, plus new ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    return [name for name in listed if (ROOT / name).is_file()]


def copy_checkout(dest: Path) -> Path:
    for name in checkout_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return dest


def run(*args: str, env: dict | None = None) -> str:
    """A command's output, stdout and stderr together as a user sees them; fails with it if it fails."""
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def pip(*args: str) -> str:
    return run(sys.executable, "-m", "pip", "--disable-pip-version-check", *args)


def warnings_in(output: str) -> list[str]:
    return [line for line in output.splitlines() if "warning" in line.lower()]


@pytest.mark.slow
def test_editable_install_prints_no_warning_and_runs_the_console_script(tmp_path):
    source = copy_checkout(tmp_path / "checkout")
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    output = pip("--python", str(python), "install", "--no-deps", "-e", str(source))
    assert warnings_in(output) == [], output
    # the launcher answers without the package's dependencies, which this environment lacks
    done = subprocess.run([env / "bin" / "swapformer", "--version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("swapformer "), done.stdout


@pytest.mark.slow
def test_wheel_build_prints_no_warning_and_ships_every_module_and_source(tmp_path):
    source = copy_checkout(tmp_path / "checkout")
    output = pip("wheel", "--no-deps", "-w", str(tmp_path / "wheels"), str(source))
    assert warnings_in(output) == [], output
    assert missing_from(tmp_path / "wheels") == []


@pytest.mark.slow
def test_sdist_builds_a_wheel_that_ships_every_module_and_source_with_no_warning(tmp_path):
    """The release path: `python -m build` makes the sdist, then the wheel from the sdist alone (which
    must carry the build backend pyproject.toml names)."""
    pytest.importorskip("build", reason="the dev extra's `build`: pip install -e '.[dev]'")
    source = copy_checkout(tmp_path / "checkout")
    # this machine's PYTHONDONTWRITEBYTECODE makes setuptools log "warning: byte-compiling is disabled"
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    output = run(sys.executable, "-m", "build", "--outdir", str(tmp_path / "dist"), str(source), env=env)
    assert warnings_in(output) == [], output
    assert len(list((tmp_path / "dist").glob("swapformer-*.tar.gz"))) == 1
    assert missing_from(tmp_path / "dist") == []


def missing_from(folder: Path) -> list[str]:
    """What the wheel in `folder` lacks of the checkout's package files and the console-script launcher."""
    (wheel,) = folder.glob("swapformer-*.whl")
    expected = {"swapformer_command.py"}
    for name in checkout_files():
        package_folder, _, rest = name.partition("/")
        if package_folder in PACKAGES and rest:
            expected.add(f"{PACKAGES[package_folder].replace('.', '/')}/{rest}")
    assert any(name.endswith(".cpp") for name in expected)
    return sorted(expected - set(zipfile.ZipFile(wheel).namelist()))
