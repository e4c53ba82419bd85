"""What a run prints: `log` once per job (global rank 0), `warn` as one `warning:` line on stderr.

Layer 0: any module may import it. torch is not imported for a print: a process that has not imported torch has
no process group either, and prints as rank 0.
"""

from __future__ import annotations

import sys
from typing import Any


def _global_rank0() -> bool:
    if "torch" not in sys.modules:
        return True
    from megagate.distributed.utils import is_global_rank0

    return is_global_rank0()


def log(message: str, *, file: Any = None) -> None:
    """Print `message` once per job (on global rank 0), flushed; `file` defaults to stdout."""
    if _global_rank0():
        print(message, file=sys.stdout if file is None else file, flush=True)


def warn(message: str) -> None:
    """`warning: message` on stderr, once per job."""
    log(f"warning: {message}", file=sys.stderr)
