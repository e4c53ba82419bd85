"""Timing under a budget: a deadline shared by the measurements, and the median of repeated calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class Deadline:
    """The time left for calibration: each section asks for its share of what remains."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.end = self.start + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.perf_counter())

    def share(self, fraction: float) -> float:
        """`fraction` of the time left, as an absolute perf_counter() deadline."""
        return time.perf_counter() + fraction * self.left()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], reps: int = 15, min_seconds: float = 0.05, until: float = 0.0) -> float:
    """The median seconds of `fn()` after one warm-up call: at least 5 calls, up to `reps` or until `min_seconds`
    of calls are timed, and never past the perf_counter() time `until` (when given) once 5 are done. The median,
    not the minimum: a shared machine's load is part of what the profile must predict, its spikes are not."""
    fn()
    sync()
    times: list[float] = []
    total = 0.0
    while len(times) < 5 or (len(times) < reps and total < min_seconds):
        if until and len(times) >= 5 and time.perf_counter() > until:
            break
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        total += times[-1]
    return statistics.median(times)


def paired_median(fwd: Callable[[], object], bwd: Callable[[object], None], reps: int = 5) -> tuple[float, float]:
    """Median (forward, backward) seconds of `bwd(fwd())` (one warm-up)."""
    bwd(fwd())
    sync()
    f_times, b_times = [], []
    for _ in range(max(3, reps)):
        start = time.perf_counter()
        out = fwd()
        sync()
        mid = time.perf_counter()
        bwd(out)
        sync()
        f_times.append(mid - start)
        b_times.append(time.perf_counter() - mid)
    return statistics.median(f_times), statistics.median(b_times)
