"""The frontier search of one variant, as a pure function of the trials run so far: what to run next, and the
bracket it ends with.

Points live in log-LR between the bounds `lo` and `hi`. The search, recomputed from all outcomes at every round (so
an interrupted search resumes by simply planning again):

1. anchor: the first seed at `lo` alone (its curve is the reference the next rounds' trials are stopped against);
   with a fixed reference (`HealthRule.reference`) `lo` is assumed healthy instead and run only when the bisection
   ends next to it;
2. coarse: the first seed at the other `coarse` points, log-spaced up to `hi`;
3. bisection on the first seed's verdicts: `u` = the smallest unhealthy LR above the lowest healthy one, `h` = the
   largest healthy LR below `u`; while log10(u/h) > `resolution` decades, run the geometric mean of h and u;
4. confirmation: the other seeds at `h` (and at `u` when one failing seed does not decide it); a seed that fails
   at `h` makes it unhealthy and the bisection goes on below it.

That is the `wide` schedule: few rounds (what a cluster queue wants). The `thrifty` schedule spends fewer
trial-steps for more rounds:

- the top of the range is assumed unhealthy, like the bottom is assumed healthy under a fixed reference, so the
  first probe is the middle (or the inner coarse points); the top is run as soon as a healthy probe above the
  bottom has the bracket resting on it (healthy there ends the search at ">= hi");
- with `HealthRule.decisive`, the bisection only moves past decided points: a healthy first seed too close to the
  threshold to be decisive is confirmed before anything above it is probed, since a failing seed there sends the
  search below it;
- seeds are confirmed one per round, so a failing seed spares the rest.

The bracket is (h, u): h healthy on the required seeds, u unhealthy; u None means healthy up to `hi` (the frontier
is at or above the range), h None that no LR in range was healthy. Healthy points above u (seed noise, a
non-monotone response) are reported in `notes`, not used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megagate.frontier.rule import (
    HEALTHY,
    UNHEALTHY,
    HealthRule,
    PointStatus,
    TrialOutcome,
    best_loss,
    decisive_side,
    point_status,
)
from megagate.frontier.rule import verdict as trial_verdict

EPS = 1e-4  # decades: LRs are rounded to 6 significant digits


def round_lr(x: float) -> float:
    """LRs are kept to 6 significant digits: stable names and exact equality between rounds."""
    return float(f"{x:.6g}")


def coarse_points(lo: float, hi: float, n: int) -> list[float]:
    """`n` >= 2 log-spaced LRs from lo to hi, both included."""
    a, b = math.log10(lo), math.log10(hi)
    return [round_lr(10 ** (a + (b - a) * i / (n - 1))) for i in range(n)]


def midpoint(a: float, b: float, lo: float | None = None, spacing: float | None = None) -> float:
    """The geometric mean of two LRs (the bisection point in log-LR). With the lattice (`lo`, coarse `spacing` in
    decades) the point snaps to it (multiples of spacing / 2^20), so rounded LRs never drift: 10^-1.25, not a
    neighbour of it."""
    mid = (math.log10(a) + math.log10(b)) / 2
    if lo is not None and spacing:
        base = math.log10(lo)
        mid = base + round((mid - base) / spacing * 2**20) / 2**20 * spacing
    return round_lr(10**mid)


def decades(a: float, b: float) -> float:
    return abs(math.log10(b / a))


SCHEDULES = ("wide", "thrifty")


@dataclass(frozen=True)
class Bracket:
    healthy: float | None  # the largest healthy LR (None: none in range)
    unhealthy: float | None  # the smallest unhealthy LR above it (None: healthy up to the top of the range)

    @property
    def width(self) -> float | None:
        """Width in decades (None when open on one side)."""
        if self.healthy is None or self.unhealthy is None:
            return None
        return decades(self.healthy, self.unhealthy)

    def describe(self) -> str:
        if self.healthy is None:
            return f"below the range (unhealthy at {self.unhealthy:.3g})" if self.unhealthy else "nothing run"
        if self.unhealthy is None:
            return f">= {self.healthy:.3g} (healthy up to the top of the range)"
        return f"[{self.healthy:.3g}, {self.unhealthy:.3g})"


@dataclass(frozen=True)
class Plan:
    requests: tuple[tuple[float, int], ...]  # (lr, seed) trials to run next
    bracket: Bracket
    phase: str  # anchor | coarse | bisect | confirm | done
    notes: tuple[str, ...] = ()

    @property
    def done(self) -> bool:
        return self.phase == "done"


def judge(
    outcomes: Mapping[tuple[float, int], TrialOutcome], seeds: Sequence[int], rule: HealthRule
) -> tuple[dict[float, PointStatus], dict[tuple[float, int], tuple[str, str]]]:
    """Every point's status and every trial's (verdict, why), against the variant's best over all its trials."""
    best = best_loss(outcomes.values(), rule)
    verdicts = {key: trial_verdict(o, best, rule) for key, o in outcomes.items()}
    by_lr: dict[float, dict[int, str]] = {}
    losses: dict[float, list[float | None]] = {}
    for (lr, seed), (v, _) in verdicts.items():
        by_lr.setdefault(lr, {})[seed] = v
        o = outcomes[(lr, seed)]
        losses.setdefault(lr, []).append(o.valid_loss if o.passes_absolute else None)
    limit = rule.threshold(best)
    return {
        lr: point_status(vs, len(seeds), rule, decisive_side(losses[lr], limit, rule)) for lr, vs in by_lr.items()
    }, verdicts


def bracket_of(status: Mapping[float, PointStatus]) -> tuple[Bracket, tuple[str, ...]]:
    """(h, u) from the points' leanings: u the first unhealthy LR above the lowest healthy one, h the largest healthy
    LR below u. Also notes on points the bracket leaves out."""
    run = sorted(lr for lr, s in status.items() if s.leaning is not None)
    healthy = [lr for lr in run if status[lr].leaning == HEALTHY]
    if not healthy:
        return Bracket(None, run[0] if run else None), ()
    lowest = healthy[0]
    u = next((lr for lr in run if lr > lowest and status[lr].leaning == UNHEALTHY), None)
    h = max(lr for lr in healthy if u is None or lr < u)
    notes = []
    above = [lr for lr in healthy if u is not None and lr > u]
    if above:
        notes.append(
            f"healthy again above {u:g} at {', '.join(f'{x:g}' for x in above)} (not used: first failure wins)"
        )
    below = [lr for lr in run if lr < lowest]
    if below:
        notes.append(f"unhealthy below the lowest healthy LR at {', '.join(f'{x:g}' for x in below)}")
    return Bracket(h, u), tuple(notes)


def _more_seeds(lr: float, count: int, seeds: Sequence[int], outcomes: Mapping) -> list[tuple[float, int]]:
    return [(lr, s) for s in seeds if (lr, s) not in outcomes][:count]


def plan_variant(
    lo: float,
    hi: float,
    coarse: int,
    resolution: float,
    seeds: Sequence[int],
    rule: HealthRule,
    outcomes: Mapping[tuple[float, int], TrialOutcome],
    schedule: str = "wide",
) -> Plan:
    """The next trials of one variant (none: done) from its outcomes so far, keyed by (lr, seed)."""
    first = seeds[0]
    thrifty = schedule == "thrifty"
    points = coarse_points(lo, hi, coarse)
    # A fixed reference needs no anchor: the lower bound is assumed healthy and run only if the bracket ends on it.
    lazy = rule.reference is not None and (points[0], first) not in outcomes
    if (points[0], first) not in outcomes and not lazy:
        return Plan(((points[0], first),), Bracket(None, None), "anchor")
    missing = [(lr, first) for lr in points[1 : -1 if thrifty else None] if (lr, first) not in outcomes]
    if missing:
        return Plan(tuple(missing), Bracket(None, None), "coarse")
    status, _ = judge(outcomes, seeds, rule)
    if lazy:
        status[points[0]] = PointStatus(HEALTHY, HEALTHY, 0, 0)  # assumed, not run
    top_assumed = thrifty and (points[-1], first) not in outcomes
    if top_assumed:
        status[points[-1]] = PointStatus(UNHEALTHY, UNHEALTHY, 0, 0)  # assumed, not run
    bracket, notes = bracket_of(status)
    h, u = bracket.healthy, bracket.unhealthy
    n, need = len(seeds), rule.required(len(seeds))
    at_resolution = u is None or (h is not None and decades(h, u) <= resolution + EPS)
    if lazy and h == points[0] and at_resolution:
        return Plan(((points[0], first),), bracket, "anchor", notes)  # the bracket ends on the assumption: test it
    if top_assumed and h is not None and u == points[-1] and (h > points[0] or at_resolution):
        return Plan(((points[-1], first),), bracket, "coarse", notes)  # it rests on the assumed top: test it
    if h is None:  # nothing healthy: make sure the lowest point really is unhealthy
        s = status[u]
        if s.decided is None:
            more = _more_seeds(u, n - need + 1 - s.fails, seeds, outcomes)
            return Plan(tuple(more[:1] if thrifty else more), bracket, "confirm", notes)
        return Plan((), bracket, "done", notes)
    # the seeds still needed to decide each end (thrifty: one per round, and before the bisection moves on)
    pending = []
    if status[h].decided is None:
        pending += _more_seeds(h, need - status[h].passes, seeds, outcomes)
    if u is not None and status[u].decided is None:
        pending += _more_seeds(u, n - need + 1 - status[u].fails, seeds, outcomes)
    # thrifty, with a decisive margin: a point it left undecided lies near the threshold, where another seed may
    # well fail and send the search below it, so it is settled before the bisection moves past it
    if thrifty and pending and (rule.decisive is not None or at_resolution):
        return Plan(tuple(pending[:1]), bracket, "confirm", notes)
    if not at_resolution:
        spacing = decades(lo, hi) / (coarse - 1)
        return Plan(((midpoint(h, u, lo, spacing), first),), bracket, "bisect", notes)
    if pending:
        return Plan(tuple(pending), bracket, "confirm", notes)
    return Plan((), bracket, "done", notes)


__all__ = [
    "SCHEDULES",
    "Bracket",
    "Plan",
    "bracket_of",
    "coarse_points",
    "decades",
    "judge",
    "midpoint",
    "plan_variant",
    "round_lr",
]
