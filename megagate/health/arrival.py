"""Who the others wait for: per step, the rank that arrived last at the gradient reduction, and what it cost.

Pure. Each rank's progress record carries, per step, the wall-clock time it entered `grad_sync` and its compute and
wait there (megagate.health.progress): nothing is exchanged beyond the records, no collective is added. On a step,
the rank that entered last is the one the others waited for. Two measures of what it cost them, each right where
the other can mislead, and the smaller is taken:

- the arrival gap: its entry time minus the median of the others' (wrong by the hosts' clock skew, a few ms);
- the wait gap: the median of the others' wait minus its own (the last to arrive waits for the reduction alone;
  wrong when a rank stalls inside the reduction: its own wait is then long too).

Both must name the same rank, else the step costs nothing (skew or a stall inside the collective, not lateness).
Over a window, per rank of a pipeline stage:

- `last_share`: the share of the window's steps it arrived last in;
- `lost_s`: the time per step (over all the window's steps) the others lost to it;
- `slowdown`: how much longer the job's step is than it would be without that loss: step / (step - lost);
- `blame`: its share of all the time the stage's ranks lost to late ranks in the window;
- `late_steps`: the steps on which it made the others wait more than half the window's median step (one such step
  is a hiccup — a rank descheduled once — not a pattern: a report needs MIN_LATE_STEPS).

A rank that stalls on some steps only (a noisy neighbour, host-side pauses, a throttling GPU, a flapping link) is
seen here while its fastest step, the steady-straggler rule's measure (megagate.health.straggler), stays normal.
Noise spreads the lateness over the ranks (blame near 1 / ranks); a real straggler takes most of it.
Records without entry times (an older launch) use the wait gap alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MIN_LATE_STEPS = 2  # steps of a window a rank must be late on (more than half a step) to be reported


@dataclass(frozen=True)
class Arrival:
    rank: int
    steps: int  # steps of the window compared (every rank of the stage reported them)
    last_share: float  # share of those steps this rank arrived last in
    lost_s: float  # the others' lost time per step, to this rank
    step_s: float  # the mean over those steps of the stage's median step time
    compute_mean_s: float
    compute_p90_s: float
    others_p90_s: float  # the median of the other ranks' compute p90
    compute_max_s: float = 0.0  # its slowest step's compute (a stall on one step in ten is above the p90)
    late_steps: int = 0  # steps it made the others wait more than half the window's median step
    blame: float = 0.0  # its share of all the time lost to late ranks of the stage in the window

    @property
    def slowdown(self) -> float:
        """The job's step over the step it would take without this rank's lateness (1.0: it costs nothing)."""
        rest = self.step_s - self.lost_s
        return self.step_s / rest if rest > 0 else float("inf")

    @property
    def lost_share(self) -> float:
        """The share of the step the others spend waiting for this rank."""
        return self.lost_s / self.step_s if self.step_s > 0 else 0.0


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (nearest rank: one of the values, never an interpolation past the largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-9 * len(ordered) // 10) - 1))]


def arrivals(
    steps: Mapping[int, Mapping[int, tuple[float, float]]],
    totals: Mapping[int, Mapping[int, float]],
    entered: Mapping[int, Mapping[int, float]] | None = None,
) -> dict[int, Arrival]:
    """rank -> its arrivals over a window, for the ranks of one pipeline stage.

    `steps`: rank -> {step: (compute s, wait s)} of the window; `totals`: rank -> {step: step s} (a rank's record
    may lack a step's total: the step time then counts compute + wait, a lower bound); `entered`: rank -> {step:
    wall-clock time it entered grad_sync}.
    """
    entered = entered or {}
    ranks = sorted(steps)
    if len(ranks) < 2:
        return {}
    common = sorted(set.intersection(*(set(steps[r]) for r in ranks)))
    if not common:
        return {}
    last_count = dict.fromkeys(ranks, 0)
    lost = dict.fromkeys(ranks, 0.0)
    step_times = []
    costs: list[tuple[int, float]] = []  # (the last rank, what it cost) per step
    for s in common:
        waits = {r: steps[r][s][1] for r in ranks}
        last = min(ranks, key=lambda r: waits[r])
        cost = statistics.median(waits[r] for r in ranks if r != last) - waits[last]
        times = {r: entered.get(r, {}).get(s) for r in ranks}
        if all(t is not None for t in times.values()):
            by_time = max(ranks, key=lambda r: times[r])
            gap = times[by_time] - statistics.median(times[r] for r in ranks if r != by_time)
            cost = min(cost, gap) if by_time == last else 0.0
            last = by_time
        last_count[last] += 1
        lost[last] += max(0.0, cost)
        costs.append((last, max(0.0, cost)))
        step_times.append(statistics.median(totals.get(r, {}).get(s, steps[r][s][0] + steps[r][s][1]) for r in ranks))
    step_s = statistics.fmean(step_times)  # lost_s is a mean over the steps: so is the step it is a share of
    typical = statistics.median(step_times)
    late_steps = {r: sum(1 for who, c in costs if who == r and c > 0.5 * typical) for r in ranks}
    compute = {r: [steps[r][s][0] for s in common] for r in ranks}
    p90s = {r: p90(compute[r]) for r in ranks}
    out = {}
    total_lost = sum(lost.values())
    for r in ranks:
        out[r] = Arrival(
            rank=r,
            steps=len(common),
            last_share=last_count[r] / len(common),
            lost_s=lost[r] / len(common),
            step_s=step_s,
            compute_mean_s=statistics.fmean(compute[r]),
            compute_p90_s=p90s[r],
            others_p90_s=statistics.median(p90s[o] for o in ranks if o != r),
            compute_max_s=max(compute[r]),
            late_steps=late_steps[r],
            blame=lost[r] / total_lost if total_lost > 0 else 0.0,
        )
    return out
