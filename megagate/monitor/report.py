"""`megagate report RUNS...`: aggregate run directories into a table and PNG plots.

Table columns: run, variant, lr, seed, steps, final loss, validation ppl, spikes, diverged, F-Attn, M-Act, gate score
(the diagnostics of the last probe: F-Attn and gate score averaged over layers, M-Act the maximum over layers).
Plots: `loss_curves.png` (training loss per run, spike events marked) and `final_loss_vs_lr.png` (one line per
variant, mean over seeds; diverged runs drawn as crosses at the top).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megagate.errors import MegagateError
from megagate.monitor import plotting, runfiles


@dataclass
class RunResult:
    name: str
    run_dir: str
    variant: str
    lr: float | None
    seed: int | None
    steps: int
    final_loss: float
    valid_ppl: float | None
    num_spikes: int
    diverged: bool
    f_attn: float | None = None
    m_act: float | None = None
    gate_score: float | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, train loss)
    spike_steps: list[int] = field(default_factory=list)


def load_run(run_dir: str | Path) -> RunResult:
    """Read one run directory (runfiles schema); missing optional files leave their columns empty."""
    run_dir = Path(run_dir)
    config = runfiles.read_config(run_dir)
    metrics = runfiles.read_jsonl(run_dir / runfiles.METRICS)
    train = [r for r in runfiles.train_metrics(metrics) if "loss" in r]
    valid = runfiles.valid_metrics(metrics)
    summary = runfiles.read_json(run_dir / runfiles.SUMMARY) or {}
    events = runfiles.read_jsonl(run_dir / runfiles.EVENTS)
    if not train and not summary:
        raise MegagateError(
            f"{run_dir}: no {runfiles.METRICS} train lines and no {runfiles.SUMMARY}: not a run directory"
        )
    metrics_path, summary_path = run_dir / runfiles.METRICS, run_dir / runfiles.SUMMARY
    curve = [
        (_number(r.get("step"), int, metrics_path, "step"), _number(r["loss"], float, metrics_path, "loss"))
        for r in train
    ]
    if "final_loss" in summary:
        final_loss = _number(summary["final_loss"], float, summary_path, "final_loss")
    else:
        final_loss = curve[-1][1] if curve else math.nan
    if "steps" in summary:
        _number(summary["steps"], int, summary_path, "steps")
    if "diverged" in summary:
        diverged = bool(summary["diverged"])
    else:  # a run without a summary (crashed or still running): judge from its curve
        losses = [loss for _, loss in curve]
        diverged = runfiles.is_diverged(
            losses[0] if losses else None, final_loss, any_nonfinite=any(not math.isfinite(x) for x in losses)
        )
    valid_ppl = None
    if valid:
        last = valid[-1]
        key = "ppl" if "ppl" in last else "loss"
        value = _number(last.get(key), float, metrics_path, f"valid {key}")
        valid_ppl = value if key == "ppl" else math.exp(min(value, 709.0))  # exp overflows past 709
    spike_steps = {_number(e.get("step"), int, run_dir / runfiles.EVENTS, "step") for e in events}
    result = RunResult(
        name=run_dir.name,
        run_dir=str(run_dir),
        variant=runfiles.gate_label(config),
        lr=_float(runfiles.lookup(config, "train.lr")),
        seed=_int(runfiles.lookup(config, "seed")),
        steps=int(summary.get("steps", curve[-1][0] if curve else 0)),
        final_loss=final_loss,
        valid_ppl=valid_ppl,
        num_spikes=len(spike_steps),
        diverged=diverged,
        curve=curve,
        spike_steps=sorted(spike_steps),
    )
    diags_path = run_dir / runfiles.DIAGNOSTICS
    diags = runfiles.read_jsonl(diags_path)
    if diags:
        steps = [_number(d.get("step"), int, diags_path, "step") for d in diags]
        layers = [d for d, step in zip(diags, steps) if step == max(steps)]
        result.f_attn = statistics.fmean(_number(d.get("f_attn"), float, diags_path, "f_attn") for d in layers)
        result.m_act = max(_number(d.get("m_act"), float, diags_path, "m_act") for d in layers)
        gates = [
            _number(d["gate_score_mean"], float, diags_path, "gate_score_mean")
            for d in layers
            if d.get("gate_score_mean") is not None
        ]
        result.gate_score = statistics.fmean(gates) if gates else None
    return result


def _number(value: Any, kind: type, path: Path, key: str) -> Any:
    """`value` as an int or float, or a one-line MegagateError naming the file, the key and the value."""
    whole = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not whole):
        shown = "missing" if value is None else repr(value)
        raise MegagateError(f"{path}: {key} {shown} is not {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _float(x: Any) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, ValueError):
        return None


def _int(x: Any) -> int | None:
    try:
        return None if x is None else int(x)
    except (TypeError, ValueError):
        return None


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories among `paths`: a path with metrics/summary is a run; otherwise its sub-directories that are."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise MegagateError(f"{p}: no such run directory")
        if _is_run(p):
            runs.append(p)
            continue
        children = sorted(c for c in p.iterdir() if c.is_dir() and _is_run(c))
        if not children:
            raise MegagateError(
                f"{p}: neither a run directory ({runfiles.METRICS}/{runfiles.SUMMARY}) nor a folder of them"
            )
        runs += children
    return runs


def _is_run(p: Path) -> bool:
    return (p / runfiles.METRICS).exists() or (p / runfiles.SUMMARY).exists()


# --- table -------------------------------------------------------------------------------------------------------
COLUMNS = (
    "run",
    "variant",
    "lr",
    "seed",
    "steps",
    "final_loss",
    "valid_ppl",
    "spikes",
    "diverged",
    "F-Attn",
    "M-Act",
    "gate_score",
)


def _fmt(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return format(x, spec) if math.isfinite(x) else str(x)
    return str(x)


def table(results: Sequence[RunResult]) -> str:
    """A fixed-width text table, one row per run."""
    rows = [list(COLUMNS)]
    for r in results:
        rows.append(
            [
                r.name,
                r.variant,
                _fmt(r.lr),
                _fmt(r.seed),
                _fmt(r.steps),
                _fmt(r.final_loss),
                _fmt(r.valid_ppl),
                _fmt(r.num_spikes),
                _fmt(r.diverged),
                _fmt(r.f_attn, ".3f"),
                _fmt(r.m_act, ".3g"),
                _fmt(r.gate_score, ".3f"),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --- plots -------------------------------------------------------------------------------------------------------
def plot_loss_curves(results: Sequence[RunResult], path: str | Path) -> Path:
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        if not r.curve:
            continue
        steps, losses = zip(*r.curve)
        finite = [(s, loss) for s, loss in r.curve if math.isfinite(loss)]
        (line,) = ax.plot(steps, [x if math.isfinite(x) else float("nan") for x in losses], lw=1, label=r.name)
        by_step = dict(finite)
        marks = [(s, by_step[s]) for s in r.spike_steps if s in by_step]
        if marks:
            ax.scatter(*zip(*marks), marker="x", s=40, color=line.get_color(), zorder=3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss curves (x = spike event)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return plotting.save(fig, path)


def plot_final_loss_vs_lr(results: Sequence[RunResult], path: str | Path) -> Path:
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    variants = sorted({r.variant for r in results})
    finite = [r.final_loss for r in results if not r.diverged and math.isfinite(r.final_loss)]
    top = max(finite) * 1.05 if finite else 1.0
    for variant in variants:
        runs = [r for r in results if r.variant == variant and r.lr is not None]
        lrs = sorted({r.lr for r in runs})
        ok = [
            (lr, statistics.fmean(r.final_loss for r in runs if r.lr == lr and not r.diverged))
            for lr in lrs
            if any(r.lr == lr and not r.diverged for r in runs)
        ]
        (line,) = ax.plot(*zip(*ok), marker="o", label=variant) if ok else ax.plot([], [], label=variant)
        bad = sorted({r.lr for r in runs if r.diverged})
        if bad:
            ax.scatter(bad, [top] * len(bad), marker="x", s=60, color=line.get_color(), zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final training loss (mean over seeds)")
    ax.set_title("final loss vs LR (x at the top = diverged)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return plotting.save(fig, path)


def report(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None) -> str:
    """Load the runs, return the table; with `out_dir`, also write the plots (and the table as report.txt)."""
    if out_dir is not None:  # refuse an unusable --out before reading anything
        from megagate.data.indexed import check_writable_dir

        check_writable_dir(out_dir, "--out")
    results = [load_run(p) for p in find_runs(run_dirs)]
    results.sort(key=lambda r: (r.variant, r.lr if r.lr is not None else math.inf, r.seed or 0, r.name))
    text = table(results)
    if out_dir is not None:
        out = Path(out_dir)
        plot_loss_curves(results, out / "loss_curves.png")
        plot_final_loss_vs_lr(results, out / "final_loss_vs_lr.png")
        runfiles.write_atomic(out / "report.txt", text + "\n")
    return text
