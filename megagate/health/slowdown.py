"""A job slower with no culprit: the step time of a window against the run's own early steps, and the phase that grew.

Pure. Every rank slower alike (a shared file system, the network, thermal throttling) is no straggler — no rank
stands out against the others — but the job is slower. Per window (megagate.health.straggler's windows) the step
time and its parts (`forward_backward`, `grad_sync`, the rest of the step: data, optimizer, callbacks) are the
median over the ranks of each rank's median; the second window of a launch is the baseline (the first holds the
warm-up steps: compilation, first collectives, allocator growth). A step over (1 + margin) x the baseline in
`windows` consecutive windows is reported, again every `windows` windows while it stays slow, naming the phase that
grew most — unless a straggler explains it (the caller says so).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

PARTS = ("forward_backward", "grad_sync", "data, optimizer and callbacks")


@dataclass(frozen=True)
class Phases:
    """A window's median step and its parts, in seconds (`parts` in the order of PARTS)."""

    step_s: float
    parts: tuple[float, float, float]
    steps: tuple[int, int]  # the window's first and last step


def phase_medians(
    steps: Mapping[int, Mapping[int, tuple[float, float]]], totals: Mapping[int, Mapping[int, float]]
) -> Phases | None:
    """The window's Phases from rank -> {step: (compute, wait)} and rank -> {step: step s} (None: no steps)."""
    per_rank = []
    seen: set[int] = set()
    for rank, entries in steps.items():
        if not entries:
            continue
        seen.update(entries)
        total = totals.get(rank, {})
        step = [total.get(s, c + w) for s, (c, w) in entries.items()]
        compute = [c for c, _ in entries.values()]
        wait = [w for _, w in entries.values()]
        step_s, c_s, w_s = statistics.median(step), statistics.median(compute), statistics.median(wait)
        per_rank.append((step_s, c_s, w_s, max(0.0, step_s - c_s - w_s)))
    if not per_rank:
        return None
    med = [statistics.median(r[i] for r in per_rank) for i in range(4)]
    return Phases(med[0], (med[1], med[2], med[3]), (min(seen), max(seen)))


@dataclass(frozen=True)
class SlowdownReport:
    step: int
    step_s: float
    base_s: float
    base_steps: tuple[int, int]
    grown: dict  # part -> seconds it grew by (PARTS)
    windows: int

    @property
    def ratio(self) -> float:
        return self.step_s / self.base_s

    def line(self) -> str:
        part, delta = max(self.grown.items(), key=lambda kv: kv[1])
        rest = ", ".join(f"{p} {d * 1e3:+.0f} ms" for p, d in self.grown.items() if p != part)
        return (
            f"slowdown: the job's step takes {self.step_s * 1e3:.0f} ms, {self.ratio:.2f}x its early median "
            f"({self.base_s * 1e3:.0f} ms at steps {self.base_steps[0]}-{self.base_steps[1]}), every rank alike, for "
            f"{self.windows} windows up to step {self.step}; grew most: {part} {delta * 1e3:+.0f} ms ({rest})"
        )

    def to_dict(self) -> dict:
        return {
            "kind": "slowdown",
            "step": self.step,
            "step_s": self.step_s,
            "base_s": self.base_s,
            "ratio": self.ratio,
            "base_steps": list(self.base_steps),
            "grown": dict(self.grown),
            "windows": self.windows,
            "line": self.line(),
        }


class SlowdownDetector:
    """Windows' Phases in, a SlowdownReport out when the job's step has grown past the margin."""

    def __init__(self, margin: float, windows: int) -> None:
        self.margin, self.windows = margin, windows
        self.seen = 0  # windows observed
        self.base: Phases | None = None
        self.streak = 0

    def observe(self, end: int, phases: Phases | None, explained: bool = False) -> SlowdownReport | None:
        if phases is None:
            return None
        self.seen += 1
        if self.seen == 2:  # the first window holds the warm-up
            self.base = phases
        if self.base is None or self.seen == 2 or self.base.step_s <= 0:
            return None
        slow = phases.step_s > (1.0 + self.margin) * self.base.step_s and not explained
        self.streak = self.streak + 1 if slow else 0
        if not slow or self.streak % self.windows:
            return None
        grown = {p: now - then for p, now, then in zip(PARTS, phases.parts, self.base.parts)}
        return SlowdownReport(end, phases.step_s, self.base.step_s, self.base.steps, grown, self.streak)
