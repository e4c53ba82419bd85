"""Matplotlib on the Agg backend (no display) and atomic PNG writes (temp name + rename)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported lazily: plotting is optional and slow to import)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str | os.PathLike) -> Path:
    """Write `fig` as PNG to `path` atomically and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; plots are meant to be shared
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        pyplot().close(fig)
    return path
