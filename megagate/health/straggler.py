"""Straggler detection: each rank's compute time per step against the median of the other ranks of its pipeline stage.

Pure. Every rank's progress record carries cumulative seconds in `forward_backward` (compute) and `grad_sync`
(waiting for the other ranks) and the steps they cover (megagate.health.progress). At the end of each window the
logging rank hands the records to `StragglerDetector.observe`, which takes the differences from the previous window
(so records written a heartbeat apart still compare per step) and compares each rank's compute per step with the
median of the *other* ranks of the same pipeline stage (stages compute different layers; with two ranks the median
of all would hide half the gap). A rank above (1 + margin) x that median in `windows` consecutive windows is
reported, and again every `windows` windows while it stays slow. A slow rank makes the others wait: their
`grad_sync` time grows while its own stays short, which the report shows too.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RankWindow:
    rank: int
    host: str
    stage: int
    steps: int
    compute_s: float  # per step
    wait_s: float  # per step


@dataclass(frozen=True)
class StragglerReport:
    step: int  # the step at the end of the window
    rank: int
    host: str
    ratio: float  # compute per step / median of the other ranks of its stage
    compute_s: float
    median_s: float
    wait_s: float  # its own wait per step
    others_wait_s: float  # the median wait per step of the others
    windows: int  # consecutive windows it was slow in

    def line(self) -> str:
        return (
            f"straggler: rank {self.rank} ({self.host}) computes {self.ratio:.2f}x the median of the other ranks "
            f"({self.compute_s * 1e3:.0f} ms vs {self.median_s * 1e3:.0f} ms per step) for {self.windows} windows up "
            f"to step {self.step}; the others wait {self.others_wait_s * 1e3:.0f} ms per step for it "
            f"(it waits {self.wait_s * 1e3:.0f} ms)"
        )

    def to_dict(self) -> dict:
        return {"kind": "straggler", **{k: getattr(self, k) for k in self.__dataclass_fields__}}


@dataclass(frozen=True)
class WindowSummary:
    step: int
    ratios: dict  # rank -> compute ratio against the others of its stage
    reports: tuple[StragglerReport, ...]

    @property
    def slowest(self) -> tuple[int, float] | None:
        return max(self.ratios.items(), key=lambda kv: kv[1]) if self.ratios else None


class StragglerDetector:
    """Windows of cumulative per-rank totals in, straggler reports out."""

    def __init__(self, margin: float, windows: int) -> None:
        self.margin, self.windows = margin, windows
        self._previous: dict[int, Mapping] = {}
        self._streak: dict[int, int] = {}

    def _window(self, records: Mapping[int, Mapping]) -> list[RankWindow]:
        out = []
        for rank, rec in records.items():
            prev = self._previous.get(rank)
            steps = int(rec.get("timed_steps", 0)) - int(prev.get("timed_steps", 0)) if prev else 0
            if steps > 0:
                out.append(
                    RankWindow(
                        rank,
                        str(rec.get("host", "?")),
                        int(rec.get("stage", 0)),
                        steps,
                        (float(rec.get("compute_s", 0)) - float(prev.get("compute_s", 0))) / steps,
                        (float(rec.get("wait_s", 0)) - float(prev.get("wait_s", 0))) / steps,
                    )
                )
        self._previous = {rank: dict(rec) for rank, rec in records.items()}
        return out

    def observe(self, step: int, records: Mapping[int, Mapping]) -> WindowSummary:
        """Compare the ranks over the window since the previous call (the first call only starts a window)."""
        windows = self._window(records)
        by_stage: dict[int, list[RankWindow]] = {}
        for w in windows:
            by_stage.setdefault(w.stage, []).append(w)
        ratios: dict[int, float] = {}
        medians: dict[int, tuple[float, float]] = {}
        for group in by_stage.values():
            for w in group:
                others = [o for o in group if o.rank != w.rank]
                if not others:
                    continue
                median = statistics.median(o.compute_s for o in others)
                if median > 0:
                    ratios[w.rank] = w.compute_s / median
                    medians[w.rank] = (median, statistics.median(o.wait_s for o in others))
        reports = []
        by_rank = {w.rank: w for w in windows}
        for rank in sorted(ratios):  # a rank without new steps in this window keeps its streak
            slow = ratios[rank] > 1.0 + self.margin
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            streak = self._streak[rank]
            if slow and streak % self.windows == 0:
                w = by_rank[rank]
                median, others_wait = medians[rank]
                reports.append(
                    StragglerReport(
                        step, rank, w.host, ratios[rank], w.compute_s, median, w.wait_s, others_wait, streak
                    )
                )
        return WindowSummary(step, ratios, tuple(reports))
