"""benchmarks/measure.py: `interleaved`, the side-by-side timer every benchmark table reads."""

from __future__ import annotations

import time

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
