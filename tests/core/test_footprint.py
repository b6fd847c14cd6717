"""The files a plain forward reads hold the plain path (issue 27, step 5): the code of a variant, of the
capability table and of the losses runs only when the forward uses it, and a decoder forward on sdpa reads
few files and lines, counted as `scripts/forward_footprint.py` counts them (its functions are used here).
The per-forward backend checks read the table as sets; they must refuse exactly what the table's own check
refuses."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import swapformer
from swapformer import DecoderForCausalLM
from swapformer.configuration.backends import BACKENDS, PATTERNS, check_backend_for_forward
from swapformer.modeling.core.layers import check_backend_for_batch
from swapformer.modeling.cpu import cpu_linear

from conftest import ROOT, tiny_config

PACKAGE = Path(swapformer.__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "forward_footprint", ROOT / "scripts" / "forward_footprint.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FOOTPRINT = _script()


def files_run_by(call) -> set[str]:
    """The package's files (relative paths) whose code runs during `call()`."""
    return {str(path.relative_to(PACKAGE)) for path in FOOTPRINT.files_run_by(call)}


def test_a_decoder_forward_on_sdpa_reads_few_files_and_lines():
    """The measure of issue 27: 6 files, at most 1,650 lines (1,608 when this was written; at 82af14c: 7
    files, 1,855 lines; at 23e3c62: 12 files, 2,713 lines; the issue's goal is 6 files and about 1,500). On
    torch's linear route, where no file of cpu/ runs (the seam, layers.project, reads the route as
    values); where "auto" picks oneDNN (AMD with AVX-512) a projection also reads that route's own modules
    (cpu/routes.py, cpu/linear.py and torch's ledger), by design behind the seam."""
    with cpu_linear("torch"):
        executed = FOOTPRINT.footprint(FOOTPRINT.build("decoder", "sdpa"), 32)
    lengths = FOOTPRINT.file_lengths(executed)
    shown = {str(p.relative_to(PACKAGE)): n for p, n in sorted(lengths.items())}
    assert len(lengths) <= 6 and sum(lengths.values()) <= 1650, shown


def plain_decoder(backend: str = "sdpa") -> DecoderForCausalLM:
    return DecoderForCausalLM(tiny_config("decoder", attn_implementation=backend)).eval()


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_a_plain_forward_reads_no_configuration_losses_or_variants(backend):
    model = plain_decoder(backend)
    ids = torch.randint(3, 90, (2, 12))
    with torch.no_grad():
        model(ids)  # first-call work (lazy imports) is not the forward
        run = files_run_by(lambda: model(ids))
    assert "modeling/core/plan.py" in run  # the tracer sees the core
    outside = sorted(f for f in run if f.startswith("configuration/"))
    assert not outside, f"a plain forward ran the configuration modules {outside}"
    variants = ("losses.py", "packing.py", "sparse", "bigbird", "global_rows.py", "sinks.py", "streaming.py")
    ran = sorted(f for f in run if any(Path(f).name.startswith(v) for v in variants))
    assert not ran, f"a plain forward without labels ran {ran}"


def test_labels_still_reach_the_loss():
    model = plain_decoder()
    ids = torch.randint(3, 90, (2, 12))
    with torch.no_grad():
        run = files_run_by(lambda: model(ids, labels=ids))
    assert "modeling/heads/losses.py" in run


def refusal(check, *args, **kwargs) -> str | None:
    try:
        check(*args, **kwargs)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_forward_checks_read_from_sets_refuse_what_the_table_refuses(backend, monkeypatch):
    """Every combination of training, gradients, attention dropout, torch.compile, layer kind and
    device: the sets the forward reads refuse a batch exactly when `check_backend_for_forward` does,
    with its words."""
    states = itertools.product(
        (False, True), (False, True), (0.0, 0.1), (False, True), PATTERNS, ("cpu", "cuda", "mps")
    )
    for training, grads, dropout, compiling, kind, device in states:
        module = SimpleNamespace(training=training, config=SimpleNamespace(attention_dropout=dropout))
        monkeypatch.setattr(torch.compiler, "is_compiling", (lambda flag: lambda: flag)(compiling))
        with torch.set_grad_enabled(grads):
            got = refusal(check_backend_for_batch, backend, kind, module, torch.device(device))
        expected = refusal(
            check_backend_for_forward,
            backend,
            kind,
            module.config,
            device,
            training=training,
            needs_grad=grads,
            compiling=compiling,
        )
        assert got == expected, (training, grads, dropout, compiling, kind, device)


def test_on_torchs_linear_route_a_forward_runs_no_cpu_module():
    """The seam (layers.project) reads the route in force as values: on torch's route, inside a switch or
    by the environment's choice, no file of modeling/cpu/ runs in a short forward."""
    model = plain_decoder()
    ids = torch.randint(3, 90, (2, 12))
    with cpu_linear("torch"), torch.no_grad():
        model(ids)
        run = files_run_by(lambda: model(ids))
    assert "modeling/core/layers.py" in run
    assert not sorted(f for f in run if f.startswith("modeling/cpu/")), run
