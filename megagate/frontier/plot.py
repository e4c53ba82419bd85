"""frontier_lr.png: loss vs LR per variant with the frontier marked.

One panel per variant (shared y): the final validation loss of every trial that ran every step (one marker per
seed, healthy filled, unhealthy open), trials stopped early as crosses at their last training loss (labelled with
the rule), the rule's threshold (the variant's best or the fixed reference, + delta) as a dotted line, the healthy side of the bracket shaded up to h and the
bracket (h, u) hatched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megagate.analysis import plotting
from megagate.frontier import trials as trials_mod
from megagate.frontier.rule import HEALTHY
from megagate.frontier.state import FrontierState


def _last_loss(out: Path, name: str) -> float | None:
    curve = trials_mod.train_losses(out / name)
    finite = [loss for _, loss in curve if math.isfinite(loss)]
    return finite[-1] if finite else None


def plot_frontier(state: FrontierState, results: Sequence[Any], path: str | Path, out: Path) -> Path:
    plt = plotting.pyplot()
    spec = state.spec
    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 4.0), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], results):
        for row in r.rows:
            if row["valid_loss"] is not None and row["outcome"] == "completed":
                healthy = row["verdict"] == HEALTHY
                ax.scatter(
                    [row["lr"]],
                    [row["valid_loss"]],
                    marker="o",
                    s=36,
                    facecolors=f"C{row['seed'] % 10}" if healthy else "none",
                    edgecolors=f"C{row['seed'] % 10}",
                    zorder=3,
                )
            elif row["outcome"].startswith("stopped"):
                y = _last_loss(out, row["name"])
                if y is not None:
                    ax.scatter([row["lr"]], [y], marker="x", s=40, color=f"C{row['seed'] % 10}", zorder=3)
                    ax.annotate(
                        row["outcome"][9:], (row["lr"], y), fontsize=8, xytext=(3, 3), textcoords="offset points"
                    )
        limit = spec.rule.threshold(r.best)
        if limit is not None:
            ax.axhline(limit, ls=":", color="gray", lw=1)
        b = r.bracket
        if b.healthy is not None:
            ax.axvspan(spec.lo, b.healthy, color="green", alpha=0.08, lw=0)
            ax.axvline(b.healthy, color="green", lw=1.2)
        if b.healthy is not None and b.unhealthy is not None:
            ax.axvspan(b.healthy, b.unhealthy, facecolor="none", hatch="//", edgecolor="orange", lw=0, alpha=0.5)
        ax.set_xscale("log")
        ax.set_xlim(spec.lo / 1.3, spec.hi * 1.3)
        ax.set_title(f"{r.variant}: {b.describe()}", fontsize=10)
        ax.set_xlabel("peak learning rate")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("final validation loss\n(x: last training loss, stopped early)")
    ref = "best" if spec.rule.reference is None else f"{spec.rule.reference:g}"
    # the legend names each marker as it is drawn (a proxy per kind, in grey: the colour is the seed)
    kinds = [
        plt.Line2D([], [], ls="", marker="o", color="gray", label="completed, healthy"),
        plt.Line2D([], [], ls="", marker="o", mfc="none", color="gray", label="completed, unhealthy"),
        plt.Line2D([], [], ls="", marker="x", color="gray", label="stopped early (reason beside it)"),
    ]
    axes[0][-1].legend(handles=kinds, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(
        f"stability frontier: healthy up to the green line, bracket hatched\ndotted: {ref} + {spec.rule.delta:g}; "
        f"seeds {','.join(map(str, spec.seeds))} by colour",
        fontsize=11,
        y=1.06,
    )
    return plotting.save(fig, path)


__all__ = ["plot_frontier"]
