"""Straggler detection: each rank's compute time per step against the median of the other ranks of its pipeline stage.

Pure. Every rank's progress record carries, for each of its last steps, the seconds in `forward_backward`
(compute) and in `grad_sync` (waiting for the other ranks) (megagate.health.progress). At the end of each window the
logging rank hands the records to `StragglerDetector.observe`. A window is the steps since the previous one up to
the last step *every* rank has reported (records are written a heartbeat apart), once it spans at least
`min_steps` steps (a window cut short by lagging records waits for the next look: the fastest of one or two steps
filters no noise); per rank it takes the *fastest*
compute of those steps — noise only ever adds time (a descheduled rank, a garbage collection, rank 0's extra work
after a checkpoint), while a straggler is slower on every step — and compares it with the median of the other ranks
of the same pipeline stage (stages compute different layers; with two ranks the median of all would hide half the
gap). A rank above (1 + margin) x that median in `windows` consecutive windows
is reported, and again every `windows` windows while it stays slow. A slow rank makes the others wait: their
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
    steps: int  # steps of the window this rank reported
    compute_s: float  # the fastest step's compute
    wait_s: float  # median wait per step


@dataclass(frozen=True)
class StragglerReport:
    step: int  # the last step of the window
    rank: int
    host: str
    ratio: float  # its fastest compute / the median of the other ranks' of its stage
    compute_s: float
    median_s: float
    wait_s: float  # its own wait per step
    others_wait_s: float  # the median wait per step of the others
    windows: int  # consecutive windows it was slow in

    def line(self) -> str:
        return (
            f"straggler: rank {self.rank} ({self.host}) computes {self.ratio:.2f}x as long as the other ranks "
            f"(fastest step {self.compute_s * 1e3:.0f} ms vs {self.median_s * 1e3:.0f} ms) for {self.windows} windows "
            f"up to step {self.step}; the others wait {self.others_wait_s * 1e3:.0f} ms per step for it "
            f"(it waits {self.wait_s * 1e3:.0f} ms)"
        )

    def to_dict(self) -> dict:
        return {"kind": "straggler", **{k: getattr(self, k) for k in self.__dataclass_fields__}}


@dataclass(frozen=True)
class WindowSummary:
    step: int  # the window's last step (0: no new window)
    ratios: dict  # rank -> compute ratio against the others of its stage
    reports: tuple[StragglerReport, ...]

    @property
    def slowest(self) -> tuple[int, float] | None:
        return max(self.ratios.items(), key=lambda kv: kv[1]) if self.ratios else None


def _steps(record: Mapping) -> list[tuple[int, float, float]]:
    return [(int(s), float(c), float(w)) for s, c, w in record.get("recent") or []]


class StragglerDetector:
    """Progress records in, straggler reports out."""

    def __init__(self, margin: float, windows: int, min_steps: int = 1) -> None:
        self.margin, self.windows, self.min_steps = margin, windows, min_steps
        self._last_step = 0  # the previous window's last step
        self._streak: dict[int, int] = {}

    def _window(self, records: Mapping[int, Mapping]) -> tuple[int, list[RankWindow]]:
        steps = {rank: _steps(rec) for rank, rec in records.items()}
        reported = [max(s for s, _, _ in entries) for entries in steps.values() if entries]
        if len(reported) < len(records) or not reported:
            return self._last_step, []  # a rank with nothing yet: wait for it
        end = min(reported)
        if end - self._last_step < max(1, self.min_steps):
            return self._last_step, []
        out = []
        for rank, entries in steps.items():
            inside = [(c, w) for s, c, w in entries if self._last_step < s <= end]
            if inside:
                rec = records[rank]
                out.append(
                    RankWindow(
                        rank,
                        str(rec.get("host", "?")),
                        int(rec.get("stage", 0)),
                        len(inside),
                        min(c for c, _ in inside),
                        statistics.median(w for _, w in inside),
                    )
                )
        return end, out

    def observe(self, records: Mapping[int, Mapping]) -> WindowSummary:
        """Compare the ranks over the steps since the previous window (none when no rank has reported a new one)."""
        end, windows = self._window(records)
        if not windows:
            return WindowSummary(0, {}, ())
        self._last_step = end
        by_stage: dict[int, list[RankWindow]] = {}
        for w in windows:
            by_stage.setdefault(w.stage, []).append(w)
        ratios: dict[int, float] = {}
        others_of: dict[int, tuple[float, float]] = {}
        for group in by_stage.values():
            for w in group:
                others = [o for o in group if o.rank != w.rank]
                if not others:
                    continue
                median = statistics.median(o.compute_s for o in others)
                if median > 0:
                    ratios[w.rank] = w.compute_s / median
                    others_of[w.rank] = (median, statistics.median(o.wait_s for o in others))
        reports = []
        by_rank = {w.rank: w for w in windows}
        for rank in sorted(ratios):
            slow = ratios[rank] > 1.0 + self.margin
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            streak = self._streak[rank]
            if slow and streak % self.windows == 0:
                w = by_rank[rank]
                median, others_wait = others_of[rank]
                reports.append(
                    StragglerReport(end, rank, w.host, ratios[rank], w.compute_s, median, w.wait_s, others_wait, streak)
                )
        return WindowSummary(end, ratios, tuple(reports))
