"""Which spike precursor moved first, and by how many steps: each spike event of a run (events.jsonl) against the
precursor series the trainer logged (precursors.jsonl at the diagnostics' probes: update ratio, max attention logit,
log Z; metrics.jsonl: the gradient norm at its logging steps).

A precursor "moved" at a logged step s when its value there is more than `Z` robust noise units above the robust
baseline of its values before s (megagate.monitor.spike.robust_baseline: median of the recent values, noise from
the successive differences; in log space for the update ratio and the grad norm, whose changes are multiplicative,
with a relative floor of `REL_FLOOR`), with at least `MIN_HISTORY` earlier values. For an event at step t, the
earliest such s in [t - horizon, t] gives the lead t - s (0: it moved at the spike's own step). `first` is the
precursor with the longest lead; none is a valid answer (no precursor moved, or too few probes before the event).
The lead is only as fine as the probe interval (monitor.diagnostics.interval) for the probe-based precursors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megagate.monitor import runfiles
from megagate.monitor.spike import robust_baseline

Z = 4.0
REL_FLOOR = 0.05
MIN_HISTORY = 3
HORIZON = 100  # steps before the event a precursor may have moved in
LOG_SPACE = {"update_ratio_max": True, "grad_norm": True, "max_logit": False, "log_z_max": False}


def moved_at(series: Sequence[tuple[int, float]], log: bool, z: float = Z) -> list[int]:
    """The steps of `series` [(step, value)], in order, whose value is more than `z` noise units above the baseline
    of the finite values before it."""
    out, history = [], []
    for step, value in series:
        x = math.log(value) if log and value > 0 else (value if not log else -math.inf)
        if not math.isfinite(value):
            out.append(step)  # a non-finite precursor moved, whatever its history
            continue
        if len(history) >= MIN_HISTORY:
            center, scale = robust_baseline(history, REL_FLOOR, absolute_floor=log)
            if (x - center) / scale > z:
                out.append(step)
        if math.isfinite(x):
            history.append(x)
    return out


def leads(
    event_step: int, series: Mapping[str, Sequence[tuple[int, float]]], horizon: int = HORIZON
) -> dict[str, int | None]:
    """precursor -> steps by which it moved before `event_step` (None: it did not move in the horizon)."""
    out: dict[str, int | None] = {}
    for name, values in series.items():
        before = [(s, v) for s, v in values if s <= event_step]
        steps = [s for s in moved_at(before, LOG_SPACE.get(name, False)) if event_step - horizon <= s]
        out[name] = event_step - steps[0] if steps else None
    return out


def run_series(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The precursor series of a run folder (absent files give empty series)."""
    run_dir = Path(run_dir)
    probes = runfiles.read_jsonl(run_dir / runfiles.PRECURSORS)
    series: dict[str, list[tuple[int, float]]] = {}
    for key in ("update_ratio_max", "max_logit", "log_z_max"):
        series[key] = [(int(r["step"]), float(r[key])) for r in probes if r.get(key) is not None]
    metrics = runfiles.train_metrics(runfiles.read_jsonl(run_dir / runfiles.METRICS))
    series["grad_norm"] = [(int(r["step"]), float(r["grad_norm"])) for r in metrics if r.get("grad_norm") is not None]
    return series


def tag_events(run_dir: str | Path, horizon: int = HORIZON) -> list[dict[str, Any]]:
    """One record per spike step of the run: {"step", "metrics", "samples", "leads", "first", "lead_steps"}."""
    run_dir = Path(run_dir)
    by_step: dict[int, dict[str, Any]] = {}
    for event in runfiles.read_jsonl(run_dir / runfiles.EVENTS):
        entry = by_step.setdefault(int(event["step"]), {"metrics": [], "samples": event.get("samples")})
        entry["metrics"].append(event["metric"])
    series = run_series(run_dir)
    out = []
    for step, entry in sorted(by_step.items()):
        moved = leads(step, series, horizon)
        ranked = sorted((lead, name) for name, lead in moved.items() if lead is not None)
        first = max(ranked)[1] if ranked else None
        out.append(
            {"step": step, **entry, "leads": moved, "first": first, "lead_steps": max(ranked)[0] if ranked else None}
        )
    return out


def section(run_dirs: Sequence[str | Path], names: Sequence[str]) -> str:
    """The report's section: per spike event, the precursor that moved first and its lead ("" without events)."""
    rows = []
    for run_dir, name in zip(run_dirs, names):
        for t in tag_events(run_dir):
            first = "none" if t["first"] is None else f"{t['first']} {t['lead_steps']} steps before"
            samples = "" if t["samples"] is None else f"  samples {t['samples'][0]}-{t['samples'][1] - 1}"
            rows.append(f"  {name}  step {t['step']} ({', '.join(t['metrics'])}): first moved: {first}{samples}")
    if not rows:
        return ""
    return "\n\nspike precursors (precursors.jsonl, grad norm; megagate.analysis.precursors):\n" + "\n".join(rows)
