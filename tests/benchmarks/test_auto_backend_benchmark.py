"""benchmarks/auto_backend.py runs at a tiny size over every cell kind: auto ran a backend the cell offers,
its outputs and gradients equal eager's, and every figure the table prints is there. No timing is asserted."""

from __future__ import annotations

from conftest import load_benchmark


def test_auto_backend_benchmark_runs_every_cell_kind(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SWAPFORMER_CACHE_DIR", str(tmp_path))  # the benchmark sets it again; restored after
    benchmark = load_benchmark("auto_backend")
    # 2 rounds: the second runs the backends in reverse, so auto is not the last one the model was set to
    results = benchmark.main(["--tiny", "--lengths", "64", "--rounds", "2", "--cache-dir", str(tmp_path)])
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
        ran = max(r["seconds"][b] for b in r["auto_ran"])
        assert r["ran_over_best"] == ran / min(t for b, t in r["seconds"].items() if b != "auto")
        assert f"| {arch} | {kind} | {length} | {mode} |" in out
    assert "auto / best | ran / best" in out and "load average" in out


def test_the_reference_above_eager_max_is_named_and_can_be_eager(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SWAPFORMER_CACHE_DIR", str(tmp_path))
    benchmark = load_benchmark("auto_backend")
    cell = ["--tiny", "--lengths", "64", "--rounds", "1", "--cache-dir", str(tmp_path)]
    cell += ["--archs", "decoder", "--kinds", "sliding", "--modes", "training"]
    common = [*cell, "--eager-max", "32"]
    (skipped,) = benchmark.main(common).values()
    assert skipped["reference"] == "sdpa" and "eager" not in skipped["seconds"]
    assert " (sdpa) |" in capsys.readouterr().out
    (against_eager,) = benchmark.main([*common, "--eager-reference"]).values()
    assert against_eager["reference"] == "eager" and "eager" not in against_eager["seconds"]
    assert against_eager["max_diff"] <= 1e-4
    assert " (sdpa) |" not in capsys.readouterr().out
    # eager timed (under --eager-max) gives its plain gradients; the untimed reference above took them
    # with activation checkpointing: recomputing the same ops must not move a single bit
    (timed,) = benchmark.main([*cell, "--eager-max", "64"]).values()
    assert "eager" in timed["seconds"] and timed["max_diff"] == against_eager["max_diff"]
