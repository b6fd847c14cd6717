"""benchmarks/measure.py: `interleaved`, the side-by-side timer every benchmark table reads."""

from __future__ import annotations

import time

import pytest

from conftest import load_benchmark

measure = load_benchmark("measure")


def counting(sleep: float = 0.0):
    calls = []

    def fn():
        calls.append(None)
        if sleep:
            time.sleep(sleep)

    return fn, calls


def test_interleaved_one_call_per_turn_by_default():
    (fast, fast_calls), (slow, slow_calls) = counting(), counting(0.002)
    times = {}
    best = measure.interleaved({"fast": fast, "slow": slow}, rounds=4, times=times)
    assert len(fast_calls) == len(slow_calls) == 1 + 4  # warm-up, then one call per round
    assert {name: len(t) for name, t in times.items()} == {"fast": 4, "slow": 4}
    assert best == {name: min(t) for name, t in times.items()}
    assert best["slow"] >= 0.002


def test_interleaved_alternates_the_order_so_no_function_always_follows_the_same_one():
    """Round 0 runs the functions in the given order, round 1 reversed, and so on after the warm-up."""
    log = []
    fns = {name: (lambda name=name: log.append(name)) for name in "abc"}
    measure.interleaved(fns, rounds=4)
    assert "".join(log) == "abc" + "abc" + "cba" + "abc" + "cba"


def test_interleaved_round_s_repeats_fast_calls_within_their_turn():
    """A call far shorter than `round_s` repeats up to the cap of 20 per turn; one longer than `round_s`
    runs once; each round records the best call of its turn."""
    (fast, fast_calls), (slow, slow_calls) = counting(), counting(0.02)
    times = {}
    best = measure.interleaved({"fast": fast}, rounds=3, times=times, round_s=5.0)
    best.update(measure.interleaved({"slow": slow}, rounds=3, times=times, round_s=0.01))
    assert len(fast_calls) == 1 + 3 * 20
    assert len(slow_calls) == 1 + 3
    assert {name: len(t) for name, t in times.items()} == {"fast": 3, "slow": 3}
    assert best == {name: min(t) for name, t in times.items()}


CHILD = """import json, os, sys
print("a line before the result")
print(json.dumps({"args": sys.argv[1:], "env": {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}}))
"""


def test_json_from_child_runs_the_script_with_the_memory_environment_and_reads_its_last_line(
    tmp_path, monkeypatch
):
    """The benchmarks' memory children: the child's own report of its arguments and environment is
    what comes back; eager freeing is the default environment, another replaces it; a failing child
    raises with its stderr."""
    for name in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    got = measure.json_from_child(str(script), "--memory-child", "64,128")
    assert got == {
        "args": ["--memory-child", "64,128"],
        "env": {**measure.EAGER_FREE, "GLIBC_TUNABLES": None},
    }
    got = measure.json_from_child(str(script), env={"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert got["env"] == {"MALLOC_MMAP_THRESHOLD_": None, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}
    script.write_text("import sys\nsys.exit('the child failed: no such size')\n")
    with pytest.raises(RuntimeError, match="the child failed: no such size"):
        measure.json_from_child(str(script))
