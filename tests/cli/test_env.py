"""`swapformer env` (the bug-report block) and the native kernels as a dependency: `swapformer
build-kernels`, one build for processes that start at once, and a machine without a compiler or ninja."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import accelerate.utils
import pytest
import torch

import swapformer
from swapformer import env as env_module
from swapformer.modeling.cpu import route_choice, sparse_native
from swapformer.modeling.cpu import routes as routes_module

from conftest import route_env_fixture

SWAPFORMER = [sys.executable, "-m", "swapformer"]
ROUTE_LINES = ("linear", "MLP chunking", "decoding copies", "sparse native")
env_linear = route_env_fixture(routes_module, "_default", "Seam.environment", env="LINEAR_ENV")
VECTOR_CPU = torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AVX2"))


def run(args, env=None, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, env={**os.environ, **(env or {})}, **kwargs)


def test_env_reports_versions_machine_routes_and_touch_points():
    done = run([*SWAPFORMER, "env", "--json"], check=True)
    data = json.loads(done.stdout)
    for package in env_module.REQUIRED:
        assert data["packages"][package] == version(package), package
    assert data["machine"]["torch CPU capability"] == torch.backends.cpu.get_cpu_capability()
    assert data["machine"]["torch threads"] == torch.get_num_threads()
    routes = data["speed routes"]
    assert routes["CPU routes"] == "on"
    assert routes["linear"].startswith(f"{swapformer.cpu_linear_route()} (")
    assert routes["sparse native"].startswith(swapformer.sparse_cpu_route())
    assert routes["MLP chunking"].startswith("on (") and routes["decoding copies"].startswith("on (")
    assert routes["sparse native kernels"]  # a state sentence (tested below)
    assert data["attention backends"]["eager"] == "ok"
    assert set(data["touch points"].values()) == {"ok"}, data["touch points"]
    text = run([*SWAPFORMER, "env"], check=True).stdout
    assert f"    - transformers: {version('transformers')}" in text and "- speed routes:" in text


def test_env_says_which_routes_are_in_force_and_why():
    """Each route's line names what chose it: the one switch (environment or call), a route's own
    variable, or what "auto" found on this machine."""
    env = {"SWAPFORMER_CPU_ROUTES": "off", "SWAPFORMER_CPU_LINEAR": "onednn"}
    data = json.loads(run([*SWAPFORMER, "env", "--json"], env=env, check=True).stdout)["speed routes"]
    assert data["CPU routes"] == "off (SWAPFORMER_CPU_ROUTES=off)"
    assert all(data[line] == "off (SWAPFORMER_CPU_ROUTES=off)" for line in ROUTE_LINES), data
    env = {"SWAPFORMER_CPU_LINEAR": "torch", "SWAPFORMER_SPARSE_CPU": "torch"}
    data = json.loads(run([*SWAPFORMER, "env", "--json"], env=env, check=True).stdout)["speed routes"]
    assert data["linear"] == "torch (SWAPFORMER_CPU_LINEAR=torch)"
    assert data["sparse native"] == "torch (SWAPFORMER_SPARSE_CPU=torch)"
    with swapformer.cpu_routes(False):
        data = env_module.report()["speed routes"]
    assert all(data[line] == "off (cpu_routes(False))" for line in ("CPU routes", *ROUTE_LINES)), data


@pytest.mark.skipif(not route_choice.onednn_available(), reason="this torch build has no oneDNN linear op")
@pytest.mark.parametrize(
    "capability, vendor, line",
    [
        ("AVX512", "AuthenticAMD", "onednn (auto: AMD CPU with AVX-512)"),
        ("AVX512", "GenuineIntel", "torch (auto: Intel CPU)"),
        ("AVX512", "", "torch (auto: CPU vendor unknown)"),
        ("AVX2", "AuthenticAMD", "torch (auto: no AVX-512)"),
    ],
)
def test_env_says_why_auto_chose_the_linear_route(capability, vendor, line, env_linear, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(route_choice, "cpu_vendor", lambda: vendor)
    env_linear(None)
    data = env_module.report()["speed routes"]
    assert data["linear"] == line and swapformer.cpu_linear_route() == line.split()[0]
    copies = "nothing on the oneDNN linear route" if line.startswith("onednn") else "at most 2 rows"
    assert copies in data["decoding copies"]


def test_env_names_a_missing_touch_point_and_still_reports(monkeypatch):
    monkeypatch.delattr(accelerate.utils, "is_fp8_available")
    data = env_module.report()
    line = data["touch points"]["accelerate is_fp8_available"]
    assert f"accelerate {version('accelerate')} has no accelerate.utils.is_fp8_available" in line
    assert data["packages"]["torch"] == version("torch")  # the rest is there


def test_a_failing_section_is_one_line_of_the_report(monkeypatch):
    def broken():
        raise ImportError("cannot import name 'X' from 'transformers.cache_utils'")

    monkeypatch.setattr(env_module, "_routes", broken)
    data = env_module.report()
    assert (
        data["speed routes"]
        == "could not be read: ImportError: cannot import name 'X' from 'transformers.cache_utils'"
    )
    assert "- speed routes: could not be read" in env_module.markdown(data)


SPARSE_FORWARD = textwrap.dedent(
    """
    import sys, warnings
    {prelude}
    import torch, swapformer
    from swapformer.modeling.cpu import sparse_native
    config = swapformer.EncoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=48, layer_types=["sliding_attention"], sliding_window=5, attention_block_size=8,
        max_position_embeddings=64)
    torch.manual_seed(0)
    model = swapformer.EncoderModel._from_config(config, attn_implementation="sparse").eval()
    ids = torch.randint(3, 50, (2, 40))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = model(ids).last_hidden_state
        model(ids)  # a second call: no second notice
    with sparse_native.sparse_cpu("torch"), torch.no_grad():
        ref = model(ids).last_hidden_state
    print("ROUTE", sparse_native.sparse_cpu_route())
    print("SAME", bool((out - ref).abs().max() <= 1e-5))
    for w in caught:
        if "swapformer" in str(w.message):
            print("NOTICE", str(w.message))
    """
)


@pytest.mark.skipif(not VECTOR_CPU, reason="the native kernels serve AVX2 / AVX-512 CPUs only")
@pytest.mark.parametrize("hidden", ["compiler", "ninja"])
def test_without_a_compiler_or_ninja_the_pytorch_path_runs_with_one_notice(hidden, tmp_path):
    """The tools are hidden from a fresh process: PATH holds only what the case keeps, and the ninja
    installed beside this Python is out of sight (swapformer also looks there for an unactivated
    virtual environment)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if hidden == "ninja":
        (bin_dir / "c++").symlink_to(
            subprocess.run(["which", "c++"], capture_output=True, text=True).stdout.strip()
        )
    prelude = "sys.executable = '/nowhere/python'  # no ninja beside it"
    env = {"PATH": str(bin_dir), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    clean = {k: v for k, v in os.environ.items() if k not in ("CXX", "SWAPFORMER_SPARSE_CPU")}
    done = subprocess.run(
        [sys.executable, "-c", SPARSE_FORWARD.format(prelude=prelude)],
        capture_output=True,
        text=True,
        env={**clean, **env},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "ROUTE torch" in lines and "SAME True" in lines
    notices = [line for line in lines if line.startswith("NOTICE")]
    assert len(notices) == 1, lines
    why = "no C++ compiler was found" if hidden == "compiler" else "ninja was not found (pip install ninja)"
    assert why in notices[0] and "SWAPFORMER_SPARSE_CPU=torch" in notices[0]
    assert not (tmp_path / "ext").exists()  # nothing was built or attempted


@pytest.mark.skipif(
    sparse_native._missing() is not None, reason=f"cannot build here: {sparse_native._missing()}"
)
@pytest.mark.slow
def test_processes_starting_at_once_build_once_and_build_kernels_ahead(tmp_path):
    """Three processes with an empty kernel cache at once (two models' first sparse forward and
    `swapformer build-kernels`): one compiles and says so in one line, the others wait and load its
    library; afterwards `swapformer env` reports it built and `build-kernels` does not compile again."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "SWAPFORMER_SPARSE_CPU": "native"}
    code = SPARSE_FORWARD.format(prelude="")
    commands = [[sys.executable, "-c", code], [sys.executable, "-c", code], [*SWAPFORMER, "build-kernels"]]
    processes = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for c in commands
    ]
    outputs = [p.communicate(timeout=600) for p in processes]
    for p, (_, err) in zip(processes, outputs):
        assert p.returncode == 0, err[-2000:]
    compiled = [err for _, err in outputs if "compiling the sparse backend's native CPU kernels" in err]
    assert len(compiled) == 1, [err[-500:] for _, err in outputs]
    assert "swapformer build-kernels" in compiled[0] and "SWAPFORMER_SPARSE_CPU=torch" in compiled[0]
    for out, _ in outputs[:2]:
        assert "ROUTE native" in out and "SAME True" in out
    libraries = list(Path(tmp_path).rglob("swapformer_sparse_native_*.so"))
    assert len(libraries) == 1
    again = run([*SWAPFORMER, "build-kernels"], env={"TORCH_EXTENSIONS_DIR": str(tmp_path)}, check=True)
    assert "compiling" not in again.stderr and str(libraries[0]) in again.stdout
    data = json.loads(run([*SWAPFORMER, "env", "--json"], env={"TORCH_EXTENSIONS_DIR": str(tmp_path)}).stdout)
    assert data["speed routes"]["sparse native kernels"].startswith(f"built ({libraries[0]})")


def test_kernel_state_sentences(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(sparse_native, "_built", None)
    monkeypatch.setattr(sparse_native, "_missing", lambda: None)
    assert sparse_native.state().startswith(
        f"not built yet: compiled at the first use (about 10-30 s) into {tmp_path}"
    )
    monkeypatch.setattr(sparse_native, "_missing", lambda: "ninja was not found (pip install ninja)")
    assert sparse_native.state() == "cannot be built here: ninja was not found (pip install ninja)"
    monkeypatch.setattr(sparse_native, "_built", False)
    assert sparse_native.state() == "the build failed in this process (the PyTorch path runs)"


def test_build_kernels_refuses_where_they_cannot_be_built(monkeypatch, capsys):
    from swapformer import cli

    monkeypatch.setattr(
        sparse_native, "_missing", lambda: "no C++ compiler was found ('c++' is not on PATH; set CXX)"
    )
    assert cli.main(["build-kernels"]) == 2
    assert "the native kernels cannot be built here: no C++ compiler was found" in capsys.readouterr().err
