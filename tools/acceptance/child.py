"""The harness of a part that is a Python module: `python -m tools.acceptance.<part> --result FILE [options]`.

The part records its figures through a `Record` as it measures them; each update rewrites the result file
atomically, so a part killed at its deadline leaves what it had measured. An exception becomes `status: failed`
with the error and the last lines of its traceback, and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def finite(value: Any) -> Any:
    """`value` with non-finite floats as the strings "nan", "inf", "-inf" (strict JSON), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` to `path` through a temporary name and a rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(finite(data), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


class Record:
    """A part's figures, rewritten to its result file on every update."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def update(self, **figures: Any) -> None:
        self.data.update(figures)
        write_json(self.path, self.data)

    def fail(self, reason: str) -> None:
        """The part ran but its result is a failure (a non-finite loss, no CUDA): named in one line."""
        self.update(status="failed", error=reason)

    def skip(self, reason: str) -> None:
        self.update(status="skipped", reason=reason)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--result", type=Path, required=True, help="the part's result file (JSON)")
    p.add_argument("--smoke", action="store_true", help="toy sizes on CPU: the script's plumbing, no figures")
    return p


def main(description: str, body: Callable[[argparse.Namespace, Record], None], extra=None) -> None:
    """Parse the arguments, run `body(args, record)`, turn an exception into a failure record; exit code 0 or 1."""
    p = parser(description)
    if extra is not None:
        extra(p)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    record = Record(args.result)
    try:
        body(args, record)
    except BaseException as exc:  # noqa: BLE001 - every way a part can end is recorded
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        lines = traceback.format_exception(exc)
        record.update(
            status="failed",
            error=f"{type(exc).__name__}: {str(exc)[:500]}",
            traceback=[line.rstrip()[:300] for chunk in lines[-4:] for line in chunk.splitlines()][-12:],
        )
        traceback.print_exc()
        sys.exit(1)
    sys.exit(1 if record.data.get("status") == "failed" else 0)
