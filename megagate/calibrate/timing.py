"""Timing under a budget: a deadline shared by the measurements, and per-call seconds averaged over time windows.

A sample is a window of back-to-back calls (at least `WINDOW` seconds), its seconds per call; the result is the
median over windows. On a machine shared with other work, a window sees the other work's share of the cores the way
a training step of similar length does, so the profile predicts the step under the load it was measured in; a
single short call would either miss the load or be hit by one whole preemption.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

WINDOW = 0.03  # seconds per sample (training steps on a CPU last 20 ms to seconds)


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


def _calls_per_window(fn: Callable[[], object], window: float) -> int:
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, min(10_000, int(window / once)))


def median_seconds(fn: Callable[[], object], samples: int = 7, until: float = 0.0, window: float = WINDOW) -> float:
    """Seconds per call of `fn()`: the median over `samples` windows of back-to-back calls (after a warm-up call),
    fewer (3 at least) once the perf_counter() time `until` has passed."""
    fn()
    sync()
    calls = _calls_per_window(fn, window)
    out: list[float] = []
    while len(out) < samples:
        if until and len(out) >= 3 and time.perf_counter() > until:
            break
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        out.append((time.perf_counter() - start) / calls)
    return statistics.median(out)


def paired_median(
    fwd: Callable[[], object], bwd: Callable[[object], None], samples: int = 5, window: float = WINDOW
) -> tuple[float, float]:
    """Median (forward, backward) seconds per call of `bwd(fwd())` over windows of back-to-back pairs."""
    bwd(fwd())
    sync()
    calls = _calls_per_window(lambda: bwd(fwd()), window)
    f_out, b_out = [], []
    for _ in range(max(3, samples)):
        f_total = b_total = 0.0
        for _ in range(calls):
            start = time.perf_counter()
            out = fwd()
            sync()
            mid = time.perf_counter()
            bwd(out)
            sync()
            f_total += mid - start
            b_total += time.perf_counter() - mid
        f_out.append(f_total / calls)
        b_out.append(b_total / calls)
    return statistics.median(f_out), statistics.median(b_out)
