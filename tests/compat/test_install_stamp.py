"""scripts/train.sh, test.sh and test_lowest.sh install only when the environment does not already match
the checkout (issue 28): a first run installs, a rerun does not, a changed pyproject.toml, build backend,
TORCH_SPEC or checkout path installs again, and a failed install leaves nothing that would skip the next.

The scripts run for real, on a copy of scripts/ and pyproject.toml, against an environment whose `python`
and `swapformer` are stand-ins that log each call: what pip would be asked to do is what is checked.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# logs its arguments; installing the checkout (the last step) fails when FAIL_INSTALL is set
STAND_IN = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CALLS"
case "$*" in *"pip install"*" -e "*) [ -z "$FAIL_INSTALL" ] || exit 1 ;; esac
"""
# what the scripts read from the caller's environment, cleared so each test sets its own
SETTINGS = ("TORCH_SPEC", "SWAPFORMER_REINSTALL", "SWAPFORMER_VENV", "SWAPFORMER_LOWEST_VENV", "FAIL_INSTALL")
SCRIPTS = {"train": "train.sh", "test": "test.sh", "lowest": "test_lowest.sh"}


@pytest.fixture
def repo(tmp_path) -> Path:
    """A checkout holding what the scripts read: scripts/ and pyproject.toml."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    return repo


def environment(folder: Path) -> Path:
    """A virtual environment's bin/ whose python and swapformer only log (so nothing is installed)."""
    for name in ("python", "swapformer"):
        path = folder / "bin" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(STAND_IN)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def bash(repo: Path, script: str, venv: Path, **env: str) -> subprocess.CompletedProcess:
    """`bash scripts/SCRIPT` with `venv` as its environment (test.sh given pytest arguments: the main suite
    only), the stand-ins' calls logged to venv/calls.log."""
    (venv / "calls.log").unlink(missing_ok=True)
    variables = {name: value for name, value in os.environ.items() if name not in SETTINGS}
    variables.update(
        CALLS=str(venv / "calls.log"), SWAPFORMER_VENV=str(venv), SWAPFORMER_LOWEST_VENV=str(venv)
    )
    args = ["bash", str(repo / "scripts" / SCRIPTS[script])] + (["-q"] if script == "test" else [])
    return subprocess.run(args, cwd=repo, env={**variables, **env}, capture_output=True, text=True)


def run(repo: Path, script: str, venv: Path, **env: str) -> list[str]:
    """The calls a successful `bash scripts/SCRIPT` made of the environment's python and swapformer."""
    done = bash(repo, script, venv, **env)
    assert done.returncode == 0, done.stderr
    return (venv / "calls.log").read_text().splitlines()


def installs(calls: list[str]) -> list[str]:
    return [call for call in calls if "pip install" in call]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_rerun_installs_nothing_and_still_runs(repo, tmp_path, script):
    venv = environment(tmp_path / "venv")
    first = run(repo, script, venv)
    assert any("-e" in call.split() for call in installs(first)), first
    again = run(repo, script, venv)
    assert installs(again) == []
    assert again[-1].split()[:2] == first[-1].split()[:2]  # what the script is for: training, the tests


@pytest.mark.parametrize("change", ["pyproject.toml", "build backend", "TORCH_SPEC", "checkout moved"])
def test_a_change_the_install_depends_on_installs_again(repo, tmp_path, change):
    venv = environment(tmp_path / "venv")
    run(repo, "train", venv)
    env = {}
    if change == "pyproject.toml":
        (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n# changed\n")
    elif change == "build backend":
        (repo / "scripts" / "build_backend.py").write_text("# changed\n")
    elif change == "TORCH_SPEC":
        env["TORCH_SPEC"] = "torch==2.13.1"
    else:
        repo = repo.rename(tmp_path / "moved")
    assert installs(run(repo, "train", venv, **env)) != []
    assert installs(run(repo, "train", venv, **env)) == []


def test_a_failed_install_installs_again_next_time(repo, tmp_path):
    venv = environment(tmp_path / "venv")
    run(repo, "train", venv)
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n# changed\n")
    assert bash(repo, "train", venv, FAIL_INSTALL="1").returncode != 0
    assert installs(run(repo, "train", venv)) != []


def test_swapformer_reinstall_forces_an_install(repo, tmp_path):
    venv = environment(tmp_path / "venv")
    run(repo, "test", venv)
    assert installs(run(repo, "test", venv, SWAPFORMER_REINSTALL="1")) != []
