"""benchmarks/gpu_check.py (issue 13's GPU check): skipped cleanly without CUDA, and its code paths run
on CPU where they can (a dry run), so a GPU session finds a working script."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def test_without_cuda_it_skips_cleanly():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "skipped: no CUDA device"


@pytest.mark.slow
def test_cpu_dry_run_agrees_with_eager(capsys, one_thread):
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

    assert gpu_check.main(["--device", "cpu", "--length", "128", "--context", "64"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"\| (\w+) \| (\w+) \| ([0-9.e+-]+) \| [0-9.]+ \|", out)
    assert {backend for _, backend, _ in rows} == {"sdpa", "sparse"}  # flash and sdpa_fa need CUDA
    assert len(rows) == 8 and all(float(diff) < 0.1 for _, _, diff in rows), out  # bf16 against fp32
    assert "flash_attention_2 | skipped: needs CUDA and the flash-attn package" in out
    absorbed = re.search(r"\| absorbed at 64 tokens \| [0-9.]+ \| ([0-9.e+-]+) \|", out)
    assert absorbed and float(absorbed.group(1)) < 0.1, out
    assert "bitsandbytes int8: skipped (needs CUDA and the bitsandbytes package)" in out
