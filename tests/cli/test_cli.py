"""The `swapformer` command as a new user meets it: help and --version from the console script without
loading torch, one-line errors with exit code 2 from every subcommand, and `swapformer convert`
interrupted by a real signal."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import transformers as T

import swapformer
import swapformer_command
from swapformer import cli

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
HEAVY = {"torch", "transformers"}

# runs the console script's main() (swapformer_command.py) and reports which heavy modules the process imported
RUNNER = f"""
import sys
from swapformer_command import main
code = main(sys.argv[1:])
print("HEAVY " + ",".join(m for m in {sorted(HEAVY)!r} if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


def python(*args: str) -> subprocess.CompletedProcess:
    """`python ARGS` in a fresh process, on CPU, output captured."""
    return subprocess.run([sys.executable, *args], env=ENV, capture_output=True, text=True, timeout=300)


def run(*argv: str) -> subprocess.CompletedProcess:
    return python("-c", RUNNER, *argv)


def heavy_imports(done: subprocess.CompletedProcess) -> list[str]:
    line = [x for x in done.stderr.splitlines() if x.startswith("HEAVY ")][-1]
    return [m for m in line[len("HEAVY ") :].split(",") if m]


# Help and version without torch ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, shown",
    [
        (["--help"], "pretrain a model with Accelerate"),
        (["--version"], f"swapformer {swapformer.__version__}"),
    ],
)
def test_help_and_version_import_neither_torch_nor_transformers(argv, shown):
    done = run(*argv)
    assert done.returncode == 0, done.stderr
    assert shown in done.stdout
    assert heavy_imports(done) == []


def test_the_command_hands_a_subcommand_to_the_package():
    """A subcommand's help is its own parser, in the package (which imports torch and transformers)."""
    done = run("train", "--help")
    assert done.returncode == 0, done.stderr
    assert "--mixed-precision" in done.stdout


def test_the_installed_console_script_help_loads_no_torch():
    """The real entry (the console script pip generated from pyproject.toml), its import list read from
    -X importtime; `python -m swapformer` runs the same command line."""
    script = shutil.which("swapformer", path=os.path.dirname(sys.executable))
    assert script is not None, "reinstall: pip install -e . --no-deps"
    done = python("-X", "importtime", script, "--help")
    assert done.returncode == 0 and "convert" in done.stdout, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "swapformer_command" in imported
    assert not {m for m in imported if m.split(".")[0] in HEAVY | {"swapformer"}}
    module = python("-m", "swapformer", "--help")
    assert module.returncode == 0 and module.stdout == done.stdout, module.stderr[-2000:]


def test_version_is_the_installed_package_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"swapformer {importlib.metadata.version('swapformer')}"


ORDERS = {
    "swapformer, then transformers' Auto classes": """
import swapformer
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model("swapformer_decoder", **SMALL)
model = AutoModelForCausalLM.from_config(config)
""",
    "transformers first": """
import transformers
import swapformer
model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("swapformer_decoder", **SMALL))
""",
    # importing a subpackage imports the package first, which registers
    "the configuration only": """
from swapformer.configuration import DecoderConfig
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_config(DecoderConfig(**SMALL))
""",
}


@pytest.mark.parametrize("order", ORDERS)
def test_auto_classes_are_registered_whatever_is_imported_first(order):
    small = "dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)"
    script = f"SMALL = {small}\n{ORDERS[order]}\nprint('CLASS', type(model).__name__)"
    done = python("-c", script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CLASS DecoderForCausalLM" in done.stdout


def test_public_names_stay_in_place():
    assert swapformer.DecoderForCausalLM is swapformer.modeling.DecoderForCausalLM
    assert set(swapformer.__all__) <= set(dir(swapformer))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        swapformer.NoSuchThing  # noqa: B018


# One-line errors, exit code 2, from every entry point ----------------------------------------------


def save_bert(folder: Path) -> Path:
    config = T.BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48
    )
    T.BertModel(config).save_pretrained(folder)
    return folder


RUN = ["--output-dir", "{tmp}/run"]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["train", *RUN, "--max-steps", "2", "--warmup-steps", "5"], "--warmup-steps must lie in [0, --max-steps=2), got 5"),
        (["train", *RUN, "--bogus"], "swapformer train: error: unrecognized arguments: --bogus (see swapformer train --help)"),
        (["train", *RUN, "--tokenizer", "{tmp}"], "--tokenizer '{tmp}' is not a saved tokenizer folder"),
        (["convert", "{tmp}/nowhere", "{tmp}/out"], "is not a folder; pass the folder that holds config.json"),
        (["convert", "{bert}", "{tmp}/out", "--tolerance", "x"], "argument --tolerance: invalid float value: 'x'"),
        (["convert", "{bert}", "{bert}/inside"], "choose an output folder outside the source"),
        (["backends", "--markdown"], "swapformer backends: error: unrecognized arguments: --markdown"),
        (["nosuch"], "argument {{train,convert,backends,env,build-kernels,attention,pattern}}: invalid choice: 'nosuch'"),
        ([], "the following arguments are required"),
    ],
)  # fmt: skip
def test_errors_are_one_line_with_exit_code_2(argv, says, tmp_path, capsys):
    fill = dict(tmp=tmp_path, bert=save_bert(tmp_path / "bert") if "{bert}" in argv else None)
    assert cli.main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert says.format(**fill) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out"), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ConversionError" in err
    assert err.strip().splitlines()[-1].startswith("swapformer convert: error: The source")


def test_an_unexpected_failure_is_one_line_with_exit_code_1(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(swapformer_command, "print_backends", broken)
    assert cli.main(["backends"]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == "swapformer backends: failed: RuntimeError: something broke; rerun with --debug for the traceback\n"
    )


def test_the_installed_command_exits_with_2_and_one_line(tmp_path):
    """One line of swapformer's; a subcommand imports the package, and with it torch and transformers,
    whose own import may print warnings of theirs (torchao's, where it is installed) above it."""
    done = python("-m", "swapformer", "train", "--set", "oops")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    ours = [line for line in done.stderr.splitlines() if "swapformer" in line]
    assert ours == ["swapformer train: error: --set expects field=value, got 'oops'"], done.stderr
    assert done.stderr.endswith(ours[-1] + "\n")


# swapformer convert stopped by a signal ---------------------------------------------------------------


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def convert_until_paused(src: Path, out: Path, point: str, *flags: str) -> subprocess.Popen:
    """`python -m swapformer convert`, stopped by the test hook at `point` (it waits there for a signal)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "swapformer", "convert", str(src), str(out), *flags],
        env={**ENV, "SWAPFORMER_TEST_PAUSE_CONVERT": point},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:  # ends if the process exits without pausing
        if line.strip() == f"paused at {point}":
            return proc
    proc.wait(timeout=60)
    raise AssertionError(f"the conversion never paused at {point}: {proc.stderr.read()[-3000:]}")


def finish(proc: subprocess.Popen, signum: int) -> str:
    try:
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return err


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize(
    "signum, overwrite",
    [(signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["SIGTERM-new", "SIGINT-overwrite"],
)
def test_a_signal_mid_conversion_leaves_nothing_and_keeps_the_old_folder(signum, overwrite, tmp_path):
    src = save_bert(tmp_path / "src")
    out = tmp_path / "out"
    before = None
    if overwrite:  # the user's earlier folder, which must survive the interrupted replacement
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        before = snapshot(out)
    proc = convert_until_paused(src, out, "verified", *(["--overwrite"] if overwrite else []))
    (partial,) = siblings(out)  # mid-conversion: the whole new folder sits under a hidden name
    assert partial.startswith(".out.partial-") and (out.parent / partial / "model.safetensors").is_file()
    err = finish(proc, signum)
    assert proc.returncode == 128 + signum, err
    assert f"interrupted by {signal.Signals(signum).name}; nothing was written" in err
    assert "Traceback" not in err, err
    assert siblings(out) == []
    assert (snapshot(out) == before) if overwrite else not out.exists()


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_a_signal_during_the_final_swap_waits_until_the_new_folder_is_in_place(tmp_path):
    src = save_bert(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = convert_until_paused(src, out, "swap", "--overwrite")
    err = finish(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM
    assert f"interrupted by SIGTERM after {out} was written completely" in err, err
    assert siblings(out) == [] and not (out / "notes.txt").exists()
    assert type(T.AutoModel.from_pretrained(out)) is swapformer.EncoderModel
    assert (out / "README.md").is_file()


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_what_a_sigkill_leaves_is_cleaned_by_the_next_conversion(tmp_path):
    src = save_bert(tmp_path / "src")
    out = tmp_path / "out"
    proc = convert_until_paused(src, out, "verified")
    finish(proc, signal.SIGKILL)  # no handler runs: the partial folder stays
    assert siblings(out) == [f".out.partial-{proc.pid}"]
    lines = []
    swapformer.convert(src, out, log=lines.append)
    assert siblings(out) == [] and (out / "model.safetensors").is_file()
    assert any(f".out.partial-{proc.pid}, left by a conversion that was killed" in line for line in lines)

    # killed between parking the old `out` and moving the new one in: the old one is put back
    dead = python("-c", "import os; print(os.getpid())")
    parked = tmp_path / f".out.old-{int(dead.stdout)}"
    os.replace(out, parked)
    with pytest.raises(ValueError, match="exists and is not empty; pass --overwrite"):
        swapformer.convert(src, out, log=lines.append)
    assert siblings(out) == [] and (out / "model.safetensors").is_file()
    assert f"restored {out} from {parked.name}" in lines[-1]
