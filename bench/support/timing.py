"""Seconds per call, and the figures the benchmarks draw from them."""

from __future__ import annotations

import time


def timings(call, count: int, warmup: int) -> list[float]:
    """Seconds per call of C{call()}, after C{warmup} untimed calls."""
    for _ in range(warmup):
        call()
    times = []
    clock = time.perf_counter
    for _ in range(count):
        started = clock()
        call()
        times.append(clock() - started)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"
