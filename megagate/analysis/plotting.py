"""Matplotlib on the Agg backend (no display) and atomic PNG writes (temp name + rename)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megagate.files import atomic_path


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported lazily: plotting is optional and slow to import)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str | os.PathLike) -> Path:
    """Write `fig` as PNG to `path` atomically and close it."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    finally:
        pyplot().close(fig)
    return path


def integer_ticks(ax: Any, axis: str = "x") -> None:
    """Ticks only at whole numbers on `axis` (layers, steps): a 2-layer plot gets 0 and 1, not -0.25 ... 1.25."""
    from matplotlib.ticker import MaxNLocator

    getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True))


def value_scale(ax: Any, values: Any, axis: str = "y", decades: float = 10.0) -> str:
    """A log `axis` where the positive `values` span more than `decades` (max/min), else linear; log labels as plain
    numbers (12, 300, 0.5) rather than powers of ten. Returns the scale chosen. A log axis over 0.80-0.87 labels
    one tick `8x10^-1` and nothing else: a narrow range reads better linear."""
    finite = [float(v) for v in values if v is not None and v == v and 0 < float(v) < float("inf")]
    log = (
        bool(finite)
        and len(finite) == len([v for v in values if v is not None])
        and max(finite) / min(finite) > decades
    )
    if log:
        from matplotlib.ticker import FuncFormatter

        getattr(ax, f"set_{axis}scale")("log")
        getattr(ax, f"{axis}axis").set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    return "log" if log else "linear"


def log2_ticks_at(ax: Any, values: Any, axis: str = "x") -> None:
    """A base-2 log `axis` with a tick at each of `values`, labelled as the plain number (128, 512), not 2^7."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    getattr(ax, f"set_{axis}scale")("log", base=2)
    axis_ = getattr(ax, f"{axis}axis")
    axis_.set_major_locator(FixedLocator(sorted({float(v) for v in values})))
    axis_.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis_.set_minor_locator(NullLocator())
