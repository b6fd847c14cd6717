"""The `swapformer` command in a first hour: it prints its own output and nothing from the libraries it
imports, its output can be piped into `head`, and `swapformer backends` prints the table without torch."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

import swapformer
from swapformer_command import SUBCOMMANDS

# stdout buffered, as a user has it (PYTHONUNBUFFERED lets argparse swallow a failed write of --help)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
ENV.pop("PYTHONUNBUFFERED", None)
# what torchao (the `quant` and `dev` extras) prints when transformers imports it on a CPU build of torch
TORCHAO_NOISE = ("Failed to load", "is an Enum subclass and is now natively supported")


def console_script() -> str:
    """The `swapformer` script pip generated from pyproject.toml, the entry a user runs."""
    script = shutil.which("swapformer", path=os.path.dirname(sys.executable))
    assert script is not None, "reinstall: pip install -e . --no-deps"
    return script


def command(*argv: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [console_script(), *argv], env=ENV, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=600
    )


# Nothing but the command's own output --------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (the quant extra)")
@pytest.mark.parametrize("argv", [["env"], ["backends"]])
def test_a_command_prints_nothing_but_its_own_output_with_the_quant_extra(argv):
    """`--debug` shows what the libraries print as they are imported (the live reference: torchao's lines
    must be there, else this test proves nothing); without it the command prints only its own output."""
    shown = command(*argv, "--debug")
    quiet = command(*argv)
    assert quiet.returncode == shown.returncode == 0, quiet.stderr + shown.stderr
    assert quiet.stdout.splitlines()[0] == shown.stdout.splitlines()[0]
    assert quiet.stderr == "", quiet.stderr
    assert not any(noise in quiet.stdout for noise in TORCHAO_NOISE)
    if argv == ["env"]:  # env imports the package, with it transformers and torchao
        assert all(noise in shown.stderr for noise in TORCHAO_NOISE), shown.stderr


QUIETED_THEN_OTHERS = """
import logging, warnings
from swapformer_command import quiet_third_party_imports
quiet_third_party_imports()
import torch  # torch sets up its own log handlers on import; the filters must survive it
logging.getLogger("torchao").warning("Failed to load /venv/torchao/_C_mxfp8.abi3.so: cannot open")
logging.getLogger("torch.utils._pytree").warning(
    "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
    "Calling register_constant() on Enum subclasses is deprecated", "<enum 'Mode'>")
logging.getLogger("torchao").warning("int8 weights: group size 7 does not divide 64")
logging.getLogger("torch.utils._pytree").warning("pytree node registered twice")
logging.getLogger("torch").warning("a torch warning")
warnings.warn("a warning of the user's run")
"""


def test_only_those_import_messages_are_silenced():
    done = subprocess.run(
        [sys.executable, "-c", QUIETED_THEN_OTHERS], env=ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    for kept in ("group size 7", "registered twice", "a torch warning", "a warning of the user's run"):
        assert kept in done.stderr, done.stderr
    assert "_C_mxfp8" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr


# A closed stdout (`swapformer ... | head -1`) ------------------------------------------------------

# every subcommand's --help, and the subcommands that print without heavy work
PRINTING = [["--help"], ["--version"], ["backends"], ["env"], *([name, "--help"] for name in SUBCOMMANDS)]


@pytest.mark.parametrize("argv", PRINTING, ids=" ".join)
def test_output_into_a_closed_pipe_ends_quietly(argv):
    """The reader has gone before the command writes (as `head -1` goes after one line): the command stops
    without a message, with exit code 141 (128 + SIGPIPE), as a shell reports for a Unix tool."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = command(*argv, stdout=write)
    finally:
        os.close(write)
    assert done.stderr == "", done.stderr
    assert done.returncode == 141


def test_head_reads_the_first_line():
    """What `swapformer backends | head -1` shows: the table's first line; the command ends quietly."""
    pipeline = subprocess.run(
        f"set -o pipefail; '{console_script()}' backends | head -1",
        shell=True,
        executable="/bin/bash",
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pipeline.stderr == "", pipeline.stderr
    assert pipeline.stdout.startswith("| backend | patterns |")
    assert pipeline.returncode in (0, 141)  # 141 when head had gone before the command wrote everything


# `swapformer backends` without torch ---------------------------------------------------------------

WHAT_IT_IMPORTED = """
import sys
from swapformer_command import main
code = main(["backends"])
print("IMPORTED", *sorted(m for m in ("torch", "transformers", "swapformer") if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


def test_backends_prints_the_package_table_without_importing_torch():
    done = subprocess.run(
        [sys.executable, "-c", WHAT_IT_IMPORTED], env=ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "IMPORTED"
    assert done.stdout == swapformer.capability_table_markdown() + "\n"
