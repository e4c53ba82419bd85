"""The main thread seen from the watchdog thread: where it is, whether it waits for other ranks; stack dumps.

A rank blocked in a collective (gloo, NCCL's host-side wait) has released the GIL, so a Python thread of the same
process still runs and can read the main thread's frames (`sys._current_frames`) and dump every thread's stack
(`faulthandler.dump_traceback(all_threads=True)`). Whether the main thread *waits for other ranks* is read from its
innermost Python frame: inside `torch.distributed` (every collective and barrier goes through distributed_c10d.py),
or on a line that waits on a communication handle (`handle.wait()`, megatron's overlapped gradient reduction and
pipeline receives). Anything else is computing (or blocked on something of its own: a file system, a lock).
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import sys
import threading
from pathlib import Path

_COMMUNICATION_FILES = (f"{os.sep}torch{os.sep}distributed{os.sep}",)


def _short(filename: str) -> str:
    """A path relative to its package root (…/site-packages/torch/x.py -> torch/x.py)."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "megagate", "tests"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[i + 1 :] if anchor == "site-packages" else parts[i:])
    return filename


def main_thread_position() -> tuple[bool, str]:
    """(waiting for other ranks, 'file:line in function') of the main thread's innermost Python frame."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return False, "?"
    code = frame.f_code
    where = f"{_short(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
    if any(part in code.co_filename for part in _COMMUNICATION_FILES):
        return True, where
    line = linecache.getline(code.co_filename, frame.f_lineno)
    return ".wait(" in line, where


def dump(path: Path, header: str) -> None:
    """Every thread's Python stack into `path` (the main thread marked by faulthandler as 'Thread 0x...')."""
    with open(path, "w") as f:
        f.write(header.rstrip() + "\n\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
