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
