"""The frontier report: per variant the bracket (largest healthy, smallest unhealthy LR), the seeds behind it, the
trials and why each was judged as it was, the compute spent against the full grid at the same resolution, and —
given a grid's run folders (a `megagate sweep` of the same config) — the same rule applied to the grid, side by
side. `megagate report OUT` prints it for a folder with frontier.json (and writes frontier.txt, frontier_report.json
and frontier_lr.png with --out); the driver writes it into OUT when the search ends.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagate.console import cell
from megagate.console import table as render_table
from megagate.errors import MegagateError
from megagate.files import write_atomic
from megagate.frontier import state as state_mod
from megagate.frontier import trials as trials_mod
from megagate.frontier.rule import PointStatus, TrialOutcome, best_loss
from megagate.frontier.search import Bracket, bracket_of, judge
from megagate.frontier.spec import FrontierSpec
from megagate.frontier.state import FrontierState
from megagate.monitor import runfiles

REPORT_JSON = "frontier_report.json"  # not frontier.json: that is the search's state


@dataclass
class VariantResult:
    variant: str
    bracket: Bracket
    phase: str  # done, or what the search was about to do when it stopped
    notes: tuple[str, ...]
    status: dict[float, PointStatus]
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per trial
    spent: int = 0
    best: float | None = None

    @property
    def stopped_early(self) -> int:
        return sum(1 for r in self.rows if r["outcome"] not in ("completed", "pending", "lost"))


def _outcome_label(trial: state_mod.Trial) -> str:
    if trial.status != "done" or trial.outcome is None:
        return trial.status
    o = trial.outcome
    return "completed" if o.completed else f"stopped: {o.stop_rule}"


def variant_results(state: FrontierState) -> list[VariantResult]:
    spec = state.spec
    results = []
    for variant in spec.variants:
        trials = dict(state.of_variant(variant))
        outcomes = {(t.lr, t.seed): t.outcome for t in trials.values() if t.status == "done"}
        status, verdicts = judge(outcomes, spec.seeds, spec.rule)
        plan = spec.plan(outcomes)
        result = VariantResult(variant, plan.bracket, plan.phase, plan.notes, status)
        result.best = best_loss(outcomes.values(), spec.rule)  # the reference of the delta rule
        for name, t in sorted(trials.items(), key=lambda kv: (kv[1].lr, kv[1].seed)):
            v, why = verdicts.get((t.lr, t.seed), ("-", "; ".join(t.history[-1:])))
            o = t.outcome
            result.rows.append(
                {
                    "name": name,
                    "lr": t.lr,
                    "seed": t.seed,
                    "round": t.round,
                    "attempts": t.attempts,
                    "steps": t.steps_run,
                    "outcome": _outcome_label(t),
                    "valid_loss": None if o is None else o.valid_loss,
                    "verdict": v,
                    "why": why,
                }
            )
            result.spent += t.steps_run
        results.append(result)
    return results


def ordering(brackets: dict[str, Bracket]) -> str:
    """Variants by their frontier, largest first ('>=' for a frontier at or above the range); variants with the same
    bracket are joined by '='."""

    def key(b: Bracket) -> tuple[float, float]:
        top = math.inf if b.unhealthy is None else b.unhealthy
        return (math.inf if b.healthy is not None and b.unhealthy is None else (b.healthy or 0.0), top)

    groups: dict[tuple[float, float], list[str]] = {}
    for variant, b in brackets.items():
        groups.setdefault(key(b), []).append(variant)
    parts = []
    for k in sorted(groups, reverse=True):
        names, b = " = ".join(groups[k]), brackets[groups[k][0]]
        if b.healthy is None:
            parts.append(f"{names} (< {b.unhealthy:.3g})" if b.unhealthy else f"{names} (-)")
        else:
            parts.append(f"{names} ({'>= ' if b.unhealthy is None else ''}{b.healthy:.3g})")
    return " > ".join(parts)


def separated(a: Bracket, b: Bracket) -> int:
    """+1 when the frontier of `a` is surely above that of `b` (a's healthy LR >= b's unhealthy one), -1 the other
    way, 0 when the brackets overlap."""
    if a.healthy is not None and b.unhealthy is not None and a.healthy >= b.unhealthy:
        return 1
    if b.healthy is not None and a.unhealthy is not None and b.healthy >= a.unhealthy:
        return -1
    return 0


def same_order(grid: dict[str, Bracket], frontier: dict[str, Bracket]) -> tuple[bool, list[str]]:
    """Does the frontier order every pair the grid separates the same way? Also the pairs the grid cannot order."""
    names = [v for v in frontier if v in grid]
    agree, ties = True, []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            g = separated(grid[a], grid[b])
            if g == 0:
                ties.append(f"{a}/{b}")
            elif separated(frontier[a], frontier[b]) != g:
                agree = False
    return agree, ties


@dataclass
class GridResult:
    folders: list[str]
    runs: int
    spent: int
    brackets: dict[str, Bracket]
    lrs: list[float]


def grid_result(folders: Sequence[str | Path], spec: FrontierSpec) -> GridResult:
    """The frontier's rule applied to a full grid's runs (run folders, or folders of them), variant by variant; their
    loss spikes are those of this code's monitor replayed over their logged curves (megagate.frontier.trials)."""
    from megagate.analysis.report import find_runs

    runs = find_runs(folders)
    outcomes: dict[str, dict[tuple[float, int], TrialOutcome]] = {}
    spent, lrs = 0, set()
    for run in runs:
        config = runfiles.read_config(run)
        lr, seed = runfiles.lookup(config, "train.lr"), runfiles.lookup(config, "seed")
        steps = int(runfiles.lookup(config, "train.train_steps") or 0)
        warmup = int(runfiles.lookup(config, "train.warmup_steps") or 0)
        outcome = trials_mod.read_outcome(run, steps, warmup)
        if lr is None or seed is None or outcome is None:
            spent += trials_mod.last_step(run)
            continue
        replayed = trials_mod.replayed_loss_spikes(run, warmup)  # judged by the monitor the trials ran with
        if replayed is not None:
            outcome = dataclasses.replace(outcome, loss_spikes=replayed)
        spent += outcome.steps
        lrs.add(float(lr))
        outcomes.setdefault(runfiles.gate_label(config), {})[(float(lr), int(seed))] = outcome
    brackets = {}
    for variant, found in outcomes.items():
        seeds = sorted({s for _, s in found})
        status, _ = judge(found, seeds, spec.rule)
        brackets[variant] = bracket_of(status)[0]
    return GridResult([str(f) for f in folders], len(runs), spent, brackets, sorted(lrs))


def _seeds(status: dict[float, PointStatus], lr: float | None) -> str:
    if lr is None or lr not in status:
        return "-"
    s = status[lr]
    note = " (undecided)" if not s.decided else " (decisive)" if s.decisive else ""
    return f"{s.passes}/{s.passes + s.fails} healthy{note}"


def text_report(state: FrontierState, out: Path, grid: GridResult | None = None) -> tuple[str, dict[str, Any]]:
    """The report's text and its JSON record."""
    spec = state.spec
    results = variant_results(state)
    width = spec.reached_width()
    points, grid_steps = spec.grid_compute(width)
    spent = state.spent
    status = "done" if state.done else f"in progress (round {len(state.rounds)})"
    lines = [
        f"frontier search in {out}: {spec.config}, variants {', '.join(spec.variants)}, seeds "
        f"{','.join(map(str, spec.seeds))}, LR {spec.lo:g}..{spec.hi:g} (coarse {spec.coarse}, bisection to "
        f"{width:.3g} decades), {spec.train_steps} steps per trial; {status} after {len(state.rounds)} rounds"
        + (f"; stopped: {state.stop_reason}" if state.stop_reason else ""),
        f"rule: {spec.rule.describe()}",
        "early stop: "
        + (
            f"non-finite loss, loss above its start after warm-up ({spec.warmup_steps} steps), loss spikes beyond the "
            f"rule, and successive halving at steps {', '.join(map(str, spec.rungs())) or '(none)'}: mean loss of the "
            f"last {spec.early.window} steps > the variant's best trial there + {spec.early.margin:g} nats"
            if spec.early.enabled
            else "off"
        ),
        "",
    ]
    rows = [
        ["variant", "frontier", "bracket", "width", "seeds at h", "seeds at u", "trials", "stopped", "steps", "phase"]
    ]
    for r in results:
        b = r.bracket
        rows.append(
            [
                r.variant,
                ("-" if b.healthy is None else (">= " if b.unhealthy is None else "") + f"{b.healthy:.3g}"),
                b.describe(),
                cell(b.width, ".3g"),
                _seeds(r.status, b.healthy),
                _seeds(r.status, b.unhealthy),
                str(len(r.rows)),
                str(r.stopped_early),
                f"{r.spent:,}",
                r.phase,
            ]
        )
    lines.append(render_table(rows))
    trials_n = sum(len(r.rows) for r in results)
    lines += [
        "",
        f"compute: {spent:,} trial-steps ({trials_n} trials, {sum(r.stopped_early for r in results)} stopped early) "
        f"against {grid_steps:,} for the full grid at the same resolution ({points} LRs x {len(spec.variants)} "
        f"variants x {len(spec.seeds)} seeds x {spec.train_steps} steps): {100 * spent / grid_steps:.1f} %",
        f"ordering (largest healthy LR first): {ordering({r.variant: r.bracket for r in results})}",
    ]
    notes = [f"{r.variant}: {n}" for r in results for n in r.notes]
    if notes:
        lines += ["notes:", *(f"  {n}" for n in notes)]
    record: dict[str, Any] = {
        "spec": spec.to_dict(),
        "done": state.done,
        "stop_reason": state.stop_reason,
        "rounds": len(state.rounds),
        "spent_trial_steps": spent,
        "grid_same_resolution": {"lrs": points, "width_decades": width, "trial_steps": grid_steps},
        "variants": {
            r.variant: {
                "frontier": r.bracket.healthy,
                "bracket": [r.bracket.healthy, r.bracket.unhealthy],
                "width_decades": r.bracket.width,
                "phase": r.phase,
                "notes": list(r.notes),
                "spent_trial_steps": r.spent,
                "best_valid_loss": r.best,
                "trials": r.rows,
            }
            for r in results
        },
    }
    if grid is not None:
        lines += ["", *grid_lines(grid, results, spent)]
        record["grid"] = {
            "folders": grid.folders,
            "runs": grid.runs,
            "trial_steps": grid.spent,
            "lrs": grid.lrs,
            "brackets": {v: [b.healthy, b.unhealthy] for v, b in grid.brackets.items()},
        }
    lines += ["", "trials:"]
    trows = [["trial", "lr", "seed", "round", "attempts", "steps", "outcome", "valid_loss", "verdict", "why"]]
    for r in results:
        for t in r.rows:
            trows.append(
                [
                    t["name"],
                    f"{t['lr']:g}",
                    str(t["seed"]),
                    str(t["round"]),
                    str(t["attempts"]),
                    str(t["steps"]),
                    t["outcome"],
                    cell(t["valid_loss"]),
                    t["verdict"],
                    t["why"],
                ]
            )
    lines.append(render_table(trows))
    return "\n".join(lines), record


def grid_lines(grid: GridResult, results: Sequence[VariantResult], spent: int) -> list[str]:
    frontier = {r.variant: r.bracket for r in results}
    lines = [
        f"side by side with the grid in {', '.join(grid.folders)} ({grid.runs} runs at LR "
        f"{', '.join(f'{x:g}' for x in grid.lrs)}), judged by the same rule:"
    ]
    rows = [["variant", "grid bracket", "frontier bracket", "inside the grid's", "frontier steps"]]
    for r in results:
        g = grid.brackets.get(r.variant)
        inside = "-" if g is None else "yes" if _within(r.bracket, g) else "no"
        rows.append([r.variant, "-" if g is None else g.describe(), r.bracket.describe(), inside, f"{r.spent:,}"])
    lines.append(render_table(rows))
    agree, ties = same_order(grid.brackets, frontier)
    lines += [
        f"compute: frontier {spent:,} trial-steps vs grid {grid.spent:,} ({100 * spent / max(grid.spent, 1):.1f} %)",
        f"grid ordering:     {ordering({v: b for v, b in grid.brackets.items() if v in frontier})}",
        f"frontier ordering: {ordering(frontier)}",
        f"same ordering as the grid: {'yes' if agree else 'NO'}"
        + (f" (pairs the grid cannot separate: {', '.join(ties)})" if ties else ""),
    ]
    return lines


def _within(inner: Bracket, outer: Bracket) -> bool:
    """The frontier bracket refines the grid's: it lies inside it (open ends allowed)."""
    lo_ok = outer.healthy is None or (inner.healthy is not None and inner.healthy >= outer.healthy * (1 - 1e-9))
    hi_ok = outer.unhealthy is None or (inner.unhealthy is not None and inner.unhealthy <= outer.unhealthy * (1 + 1e-9))
    return lo_ok and hi_ok


def frontier_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """The paths among `paths` that hold a frontier search (frontier.json)."""
    return [Path(p) for p in paths if (Path(p) / state_mod.STATE_FILE).is_file()]


def write_report(out: Path, grid_folders: Sequence[str | Path] = (), dest: Path | None = None) -> str:
    """Print-ready text of the frontier in `out`; with `dest`, frontier.txt, frontier_report.json and frontier_lr.png
    there."""
    from megagate.frontier.plot import plot_frontier

    state = state_mod.load(out)
    if state is None:
        raise MegagateError(f"{out}: no {state_mod.STATE_FILE}")
    grid = grid_result(grid_folders, state.spec) if grid_folders else None
    text, record = text_report(state, out, grid)
    if dest is not None:
        write_atomic(dest / "frontier.txt", text + "\n")
        runfiles.write_json(dest / REPORT_JSON, record)
        plot_frontier(state, variant_results(state), dest / "frontier_lr.png", out)
    return text


__all__ = ["frontier_dirs", "grid_result", "ordering", "same_order", "text_report", "variant_results", "write_report"]
