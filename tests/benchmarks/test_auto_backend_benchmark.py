"""benchmarks/auto_backend.py runs at a tiny size over every cell kind: auto ran a backend the cell offers,
its outputs and gradients equal eager's, and every figure the table prints is there. No timing is asserted."""

from __future__ import annotations

from conftest import load_benchmark


def test_auto_backend_benchmark_runs_every_cell_kind(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SWAPFORMER_CACHE_DIR", str(tmp_path))  # the benchmark sets it again; restored after
    benchmark = load_benchmark("auto_backend")
    results = benchmark.main(["--tiny", "--lengths", "64", "--rounds", "1", "--cache-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert set(results) == {
        (arch, kind, 64, mode)
        for arch in benchmark.ARCHS
        for kind in benchmark.KINDS
        for mode in benchmark.MODES
    }
    for (arch, kind, length, mode), r in results.items():
        assert r["auto_ran"] and set(r["auto_ran"]) <= set(r["seconds"]), (arch, kind, mode, r)
        assert benchmark.DEFAULT in r["seconds"] and "eager" in r["seconds"]
        assert r["max_diff"] <= 1e-4, (arch, kind, mode, r["max_diff"])
        assert f"| {arch} | {kind} | {length} | {mode} |" in out
    assert "auto / best" in out and "load average" in out
