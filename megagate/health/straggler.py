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

A rank slow on some steps only (a stall that comes and goes) keeps a normal fastest step; it is seen by who the
others wait for (megagate.health.arrival): a rank whose lateness makes the job's step more than (1 + margin) x the
step without it, in `windows` consecutive windows, is reported with the share of steps it arrived last, the others'
lost time and its compute mean and p90 (an `intermittent` straggler; a rank both slow on every step and late is
reported as the steady one). Every rank slower alike is no straggler: megagate.health.slowdown compares the job's
step with its own early steps. A rank the others wait for must also hold more than `late_share` of all the
time lost to late ranks in the window: noise (a rank descheduled on a loaded machine) moves from rank to rank.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from megagate.health.arrival import MIN_LATE_STEPS, Arrival, arrivals
from megagate.health.slowdown import SlowdownDetector, SlowdownReport, phase_medians


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
        return {"kind": "straggler", "pattern": "steady", **{k: getattr(self, k) for k in self.__dataclass_fields__}}


@dataclass(frozen=True)
class LateReport:
    """A rank the others wait for on many steps though its fastest step is normal (an intermittent straggler)."""

    step: int  # the last step of the window
    rank: int
    host: str
    arrival: Arrival
    ratio: float  # its fastest compute / the others' (under the margin: else it is a steady straggler)
    windows: int

    def line(self) -> str:
        a = self.arrival
        p90_ratio = a.compute_p90_s / a.others_p90_s if a.others_p90_s > 0 else float("inf")
        return (
            f"straggler: rank {self.rank} ({self.host}) arrived last in {a.last_share * 100:.0f} % of steps; the "
            f"others waited {a.lost_s * 1e3:.0f} ms/step ({a.lost_share * 100:.0f} % of the step) for it; its compute "
            f"p90 {p90_ratio:.1f}x the others' (mean {a.compute_mean_s * 1e3:.0f} ms, p90 "
            f"{a.compute_p90_s * 1e3:.0f} ms, slowest {a.compute_max_s * 1e3:.0f} ms), the job {a.slowdown:.2f}x slower for {self.windows} windows up to "
            f"step {self.step}"
        )

    def to_dict(self) -> dict:
        a = self.arrival
        return {
            "kind": "straggler",
            "pattern": "intermittent",
            "step": self.step,
            "rank": self.rank,
            "host": self.host,
            "ratio": self.ratio,
            "windows": self.windows,
            "last_share": a.last_share,
            "lost_s": a.lost_s,
            "step_s": a.step_s,
            "slowdown": a.slowdown,
            "blame": a.blame,
            "late_steps": a.late_steps,
            "compute_mean_s": a.compute_mean_s,
            "compute_p90_s": a.compute_p90_s,
            "others_p90_s": a.others_p90_s,
            "compute_max_s": a.compute_max_s,
            "line": self.line(),
        }


@dataclass(frozen=True)
class WindowSummary:
    step: int  # the window's last step (0: no new window)
    ratios: dict  # rank -> compute ratio against the others of its stage
    reports: tuple[StragglerReport | LateReport, ...]
    costs: dict = field(default_factory=dict)  # rank -> the job's slowdown from its lateness (Arrival.slowdown)
    slowdown: SlowdownReport | None = None  # every rank slower alike than the run's early steps

    @property
    def costliest(self) -> tuple[int, float] | None:
        return max(self.costs.items(), key=lambda kv: kv[1]) if self.costs else None

    @property
    def slowest(self) -> tuple[int, float] | None:
        return max(self.ratios.items(), key=lambda kv: kv[1]) if self.ratios else None


def _steps(record: Mapping) -> list[tuple[int, float, float]]:
    return [(int(s), float(c), float(w)) for s, c, w in record.get("recent") or []]


def _pairs(record: Mapping, key: str) -> dict[int, float]:
    return {int(s): float(t) for s, t in record.get(key) or []}


class StragglerDetector:
    """Progress records in, straggler reports out."""

    def __init__(self, margin: float, windows: int, min_steps: int = 1, late_share: float = 0.5) -> None:
        self.margin, self.windows, self.min_steps, self.late_share = margin, windows, min_steps, late_share
        self._last_step = 0  # the previous window's last step
        self._streak: dict[int, int] = {}
        self._late: dict[int, int] = {}  # rank -> consecutive windows its lateness cost the job over the margin
        self._steps: dict[int, dict[int, tuple[float, float]]] = {}  # the window's (compute, wait) per rank
        self._totals: dict[int, dict[int, float]] = {}
        self._entered: dict[int, dict[int, float]] = {}
        self.slowdown = SlowdownDetector(margin, windows)

    def _window(self, records: Mapping[int, Mapping]) -> tuple[int, list[RankWindow]]:
        steps = {rank: _steps(rec) for rank, rec in records.items()}
        reported = [max(s for s, _, _ in entries) for entries in steps.values() if entries]
        if len(reported) < len(records) or not reported:
            return self._last_step, []  # a rank with nothing yet: wait for it
        end = min(reported)
        if end - self._last_step < max(1, self.min_steps):
            return self._last_step, []
        out = []
        self._steps, self._totals, self._entered = {}, {}, {}
        for rank, entries in steps.items():
            inside = [(c, w) for s, c, w in entries if self._last_step < s <= end]
            self._steps[rank] = {s: (c, w) for s, c, w in entries if self._last_step < s <= end}
            self._totals[rank] = {
                s: t for s, t in _pairs(records[rank], "totals").items() if self._last_step < s <= end
            }
            self._entered[rank] = {
                s: t for s, t in _pairs(records[rank], "arrivals").items() if self._last_step < s <= end
            }
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
        late: dict[int, Arrival] = {}
        for group in by_stage.values():
            late.update(arrivals({w.rank: self._steps[w.rank] for w in group}, self._totals, self._entered))
        reports: list[StragglerReport | LateReport] = []
        by_rank = {w.rank: w for w in windows}
        for rank in sorted(ratios):
            slow = ratios[rank] > 1.0 + self.margin
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            streak = self._streak[rank]
            costly = rank in late and not slow and late[rank].slowdown > 1.0 + self.margin
            costly = costly and late[rank].blame > self.late_share and late[rank].late_steps >= MIN_LATE_STEPS
            self._late[rank] = self._late.get(rank, 0) + 1 if costly else 0
            w = by_rank[rank]
            if slow and streak % self.windows == 0:
                median, others_wait = others_of[rank]
                reports.append(
                    StragglerReport(end, rank, w.host, ratios[rank], w.compute_s, median, w.wait_s, others_wait, streak)
                )
            elif costly and self._late[rank] % self.windows == 0:
                reports.append(LateReport(end, rank, w.host, late[rank], ratios[rank], self._late[rank]))
        # the job as a whole against its early steps; not when a rank explains it (slow, or late at a cost)
        culprit = any(self._streak.get(r) or self._late.get(r) for r in ratios)
        slowdown = self.slowdown.observe(end, phase_medians(self._steps, self._totals), explained=culprit)
        costs = {r: a.slowdown for r, a in late.items()}
        return WindowSummary(end, ratios, tuple(reports), costs, slowdown)
