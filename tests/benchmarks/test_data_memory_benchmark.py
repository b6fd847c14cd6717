"""benchmarks/data_memory.py runs at a tiny size: it generates its corpora, trains on each in a child process
and prints one row per size with the child's peak RSS, then the ratio of the largest to the smallest. No
figure is asserted beyond what the run itself must show (more text, more tokens)."""

from __future__ import annotations

import pytest

from conftest import load_benchmark


@pytest.mark.slow
def test_data_memory_benchmark_prints_a_row_per_corpus_size(tmp_path, capsys):
    benchmark = load_benchmark("data_memory")
    results = benchmark.main(["--sizes", "0.002", "0.001", "--workdir", str(tmp_path)])
    table = capsys.readouterr().out
    assert sorted(results) == [0.001, 0.002]
    for size, r in results.items():
        assert f"| {size:g} GB | {r['tokens']:,} |" in table
        assert r["peak_rss_mib"] > 0 and r["tokenize_s"] >= 0
    assert results[0.002]["tokens"] > results[0.001]["tokens"]
    assert "peak RSS at 0.002 GB / at 0.001 GB:" in table
    files = sorted((tmp_path / "corpus-0.002GB").glob("*.txt"))
    assert sum(f.stat().st_size for f in files) >= 0.002e9  # the size asked for was generated
