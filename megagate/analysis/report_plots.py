"""The PNG plots of `megagate report` (run results from megagate.analysis.report, groups from .aggregate).

loss_curves.png                training loss per run, spike-monitor events marked
final_loss_vs_lr.png           one line per variant, mean over all runs (seeds) at each LR; diverged as crosses
lr_sensitivity.png             one panel per (sweep, setting), shared y: mean final loss over seeds per variant with
                               a min-max band over seeds; LRs where a run diverged as crosses at the top (k/n)
diagnostics_over_training.png  F-Attn (uniform reference dotted), M-Act (log y) and gate score vs step, the mean
                               over seeds per (sweep, setting, variant) at one LR per (sweep, setting)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megagate.analysis import plotting
from megagate.analysis.aggregate import uniform_f_attn


def plot_loss_curves(results: Sequence[Any], path: str | Path) -> Path:
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        if not r.curve:
            continue
        steps, losses = zip(*r.curve)
        finite = [(s, loss) for s, loss in r.curve if math.isfinite(loss)]
        (line,) = ax.plot(steps, [x if math.isfinite(x) else float("nan") for x in losses], lw=1, label=r.label)
        by_step = dict(finite)
        marks = [(s, by_step[s]) for s in r.spike_steps if s in by_step]
        if marks:
            ax.scatter(*zip(*marks), marker="x", s=40, color=line.get_color(), zorder=3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss curves (x = spike event)")
    if len(results) <= 24:  # a legend of a large sweep hides the curves
        ax.legend(fontsize=8, ncol=2 if len(results) > 8 else 1)
    ax.grid(alpha=0.3)
    return plotting.save(fig, path)


def _top(results: Sequence[Any]) -> float:
    finite = [r.final_loss for r in results if not r.diverged and math.isfinite(r.final_loss)]
    return max(finite) * 1.05 if finite else 1.0


def plot_final_loss_vs_lr(results: Sequence[Any], path: str | Path) -> Path:
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    top = _top(results)
    for variant in sorted({r.variant for r in results}):
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


def _panels(results: Sequence[Any]) -> list[tuple[str, str]]:
    return sorted({(r.sweep, r.setting) for r in results})


def _sensitivity_metric(results: Sequence[Any]) -> tuple[str, str]:
    """(RunResult attribute, axis label): the validation loss when every run that did not diverge has one (a
    held-out average, far less noisy than the last training batch), else the final training loss."""
    ok = [r for r in results if not r.diverged]
    if ok and all(r.valid_loss is not None and math.isfinite(r.valid_loss) for r in ok):
        return "valid_loss", "final validation loss"
    return "final_loss", "final training loss"


def plot_lr_sensitivity(results: Sequence[Any], path: str | Path) -> Path:
    """Final loss vs LR per (sweep, setting) panel: mean over non-diverged seeds, min-max band, diverged crosses."""
    plt = plotting.pyplot()
    panels = _panels(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), sharey=True, squeeze=False)
    key, label = _sensitivity_metric(results)
    finite = [getattr(r, key) for r in results if not r.diverged and math.isfinite(getattr(r, key))]
    top = max(finite) * 1.05 if finite else 1.0
    variants = sorted({r.variant for r in results})
    colors = {v: f"C{i % 10}" for i, v in enumerate(variants)}
    for ax, (sweep, setting) in zip(axes[0], panels):
        for variant in variants:
            runs = [r for r in results if (r.sweep, r.setting, r.variant) == (sweep, setting, variant) and r.lr]
            if not runs:
                continue
            points = []
            for lr in sorted({r.lr for r in runs}):
                losses = [
                    getattr(r, key) for r in runs if r.lr == lr and not r.diverged and math.isfinite(getattr(r, key))
                ]
                if losses:
                    points.append((lr, statistics.fmean(losses), min(losses), max(losses)))
                at = [r for r in runs if r.lr == lr]
                bad = sum(r.diverged for r in at)
                if bad:
                    ax.scatter([lr], [top], marker="x", s=70, color=colors[variant], zorder=3)
                    ax.annotate(f"{bad}/{len(at)}", (lr, top), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if points:
                lrs, means, lows, highs = zip(*points)
                ax.plot(lrs, means, marker="o", color=colors[variant], label=variant)
                ax.fill_between(lrs, lows, highs, color=colors[variant], alpha=0.2, lw=0)
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_title(f"{sweep}\n{setting}" if setting != "-" else sweep, fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"{label} (mean, min-max over seeds)")
    fig.suptitle("LR sensitivity (x at the top = diverged runs, k/n)", fontsize=9)
    return plotting.save(fig, path)


def default_diag_lrs(results: Sequence[Any]) -> dict[tuple[str, str], float]:
    """Per (sweep, setting): the largest LR at which no run diverged (else the smallest LR)."""
    chosen = {}
    for panel in _panels(results):
        runs = [r for r in results if (r.sweep, r.setting) == panel and r.lr is not None]
        lrs = sorted({r.lr for r in runs})
        if not lrs:
            continue
        clean = [lr for lr in lrs if not any(r.diverged for r in runs if r.lr == lr)]
        chosen[panel] = max(clean) if clean else min(lrs)
    return chosen


def _mean_curve(curves: Sequence[Sequence[tuple[int, float | None]]]) -> list[tuple[int, float]]:
    """Mean over runs at each step (of the runs that have a finite value at that step)."""
    by_step: dict[int, list[float]] = {}
    for curve in curves:
        for step, value in curve:
            if value is not None and math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    return [(s, statistics.fmean(v)) for s, v in sorted(by_step.items())]


def plot_diagnostics_over_training(
    results: Sequence[Any], path: str | Path, lrs: Mapping[tuple[str, str], float]
) -> Path:
    """F-Attn, M-Act and gate score over training (diagnostics.jsonl), mean over seeds, at `lrs[(sweep, setting)]`."""
    plt = plotting.pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    lines = sorted({(r.sweep, r.setting, r.variant) for r in results if (r.sweep, r.setting) in lrs})
    styles = ["-", "--", ":", "-."]
    panels = _panels(results)
    variants = sorted({r.variant for r in results})
    lengths = set()
    for sweep, setting, variant in lines:
        lr = lrs[sweep, setting]
        runs = [r for r in results if (r.sweep, r.setting, r.variant, r.lr) == (sweep, setting, variant, lr)]
        runs = [r for r in runs if r.diagnostics]
        if not runs:
            continue
        lengths |= {r.seq_length for r in runs if r.seq_length}
        label = f"{variant} @ {lr:g}" + ("" if len(panels) == 1 else f" [{sweep} {setting}]")
        style = dict(color=f"C{variants.index(variant) % 10}", ls=styles[panels.index((sweep, setting)) % 4])
        for ax, column in zip(axes, ("f_attn", "m_act", "gate_score")):
            curve = _mean_curve([[(d["step"], d[column]) for d in r.diagnostics] for r in runs])
            if curve:
                ax.plot(*zip(*curve), marker=".", label=label, **style)
    for length in sorted(lengths):
        axes[0].axhline(uniform_f_attn(length), color="k", ls=":", lw=1, label=f"uniform, L={length}")
    axes[0].set_ylabel("F-Attn (first-token attention)")
    axes[1].set_ylabel("M-Act (max |activation|)")
    plotting.value_scale(axes[1], [v for line in axes[1].get_lines() for v in line.get_ydata()])
    axes[2].set_ylabel("gate score (mean)")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the curves stay visible
    axes[0].set_title("diagnostics over training (mean over seeds; layers: F-Attn/gate mean, M-Act max)", fontsize=9)
    return plotting.save(fig, path)
