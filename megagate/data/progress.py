"""A dependency-free progress line: documents/s, tokens/s, MB/s and ETA, on stderr.

On a terminal it redraws one line; into a file or pipe (CI logs, Slurm) it prints a line every `log_every`
seconds so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _hms(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Counters plus a rate-limited display. `update(...)` adds to the counters."""

    def __init__(
        self, total_bytes: int, stream: TextIO | None = None, enabled: bool = True, log_every: float = 10.0
    ) -> None:
        self.total_bytes = max(1, total_bytes)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.25 if self.tty else log_every
        self.start = time.perf_counter()
        self.last_draw = 0.0
        self.docs = self.tokens = self.text_bytes = self.bad = 0
        self.disk_done = 0

    def update(
        self, docs: int = 0, tokens: int = 0, text_bytes: int = 0, bad: int = 0, disk_done: int | None = None
    ) -> None:
        self.docs += docs
        self.tokens += tokens
        self.text_bytes += text_bytes
        self.bad += bad
        if disk_done is not None:
            self.disk_done = disk_done
        now = time.perf_counter()
        if self.enabled and now - self.last_draw >= self.interval:
            self.last_draw = now
            self._draw(final=False)

    def line(self) -> str:
        dt = max(1e-9, time.perf_counter() - self.start)
        frac = min(1.0, self.disk_done / self.total_bytes)
        eta = (dt / frac - dt) if frac > 0 else float("inf")
        eta_s = _hms(eta) if eta != float("inf") else "?"
        return (
            f"[{100 * frac:5.1f}%] {self.docs:,} docs {_si(self.tokens)} tok | "
            f"{_si(self.docs / dt)} docs/s {_si(self.tokens / dt)} tok/s {self.text_bytes / dt / 1e6:.1f} MB/s | "
            f"elapsed {_hms(dt)} ETA {eta_s}" + (f" | {self.bad:,} bad" if self.bad else "")
        )

    def _draw(self, final: bool) -> None:
        text = self.line()
        if self.tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(final=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start
