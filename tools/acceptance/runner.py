"""One part of the acceptance in its own process group, against its share of one deadline (stdlib only).

A part is a command started in a new session (`start_new_session`: its own process group), its output going to a
log file. When its share of the budget is spent the whole group gets SIGTERM, then SIGKILL after a grace period,
so a trainer started by a test cannot run on into the next part; any process still carrying the part's marker
variable (one that started a session of its own) is killed too. What the part wrote to its result file — figures
written as they were measured, so a killed part leaves a trace — is read back whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARKER = "MEGAGATE_ACCEPTANCE_PART"  # inherited by every process a part starts: found and killed after it
STATUSES = ("ok", "failed", "timed_out", "skipped")
TAIL_LINES = 15  # the last lines of a failed part's output kept in the JSON


class Interrupted(Exception):
    """The acceptance itself was told to stop (SIGTERM/SIGINT): the running part is stopped, the JSON written."""


def raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


@dataclass
class Outcome:
    """How a part ended: status (one of STATUSES), wall seconds, exit code, what it wrote, its output's last lines."""

    status: str
    seconds: float
    rc: int | None = None
    written: dict[str, Any] = field(default_factory=dict)
    tail: list[str] = field(default_factory=list)
    killed_leftovers: int = 0


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, {} if absent or unreadable (a part killed while it wrote leaves the old file)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def tail_lines(path: Path, n: int = TAIL_LINES, max_bytes: int = 64_000) -> list[str]:
    """The last `n` non-empty lines of a log (read from its last `max_bytes`), each cut to 300 characters."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    lines = [line.rstrip()[:300] for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-n:]


def marked_processes(marker: str) -> list[int]:
    """The live processes whose environment carries MARKER=marker (Linux /proc; [] elsewhere)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the part's whole process group, SIGKILL to whatever is left after `grace` seconds."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)  # the leader may be gone while its children still run
    proc.wait()


def kill_marked(marker: str) -> int:
    """SIGKILL every process still carrying the part's marker (one that escaped into a session of its own), wait
    until they are gone (5 s at most); how many there were."""
    pids = marked_processes(marker)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def run_part(
    cmd: list[str],
    *,
    seconds: float,
    log: Path,
    result: Path,
    marker: str,
    env: dict[str, str],
    cwd: Path,
    grace: float = 10.0,
) -> Outcome:
    """Run `cmd` in a new session for at most `seconds`; stop its whole group then. The status is `timed_out`
    when the share ran out, `failed` on a non-zero exit or when the part recorded `status: failed`, `skipped`
    when it recorded that, else `ok`. An Interrupted (the acceptance told to stop) stops the group and re-raises."""
    result.unlink(missing_ok=True)
    start = time.monotonic()
    timed_out = False
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**env, MARKER: marker},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=max(seconds, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_group(proc, grace)
        except BaseException:
            stop_group(proc, min(grace, 3.0))
            kill_marked(marker)
            raise
    # the leader is done: a part's child left in the group (a stray trainer) is stopped the same way
    # what the part left running: a helper that exits with its parent (a resource tracker) gets a moment first
    settle = time.monotonic() + 3
    while marked_processes(marker) and time.monotonic() < settle:
        time.sleep(0.1)
    leftovers = len(marked_processes(marker))
    _signal_group(proc.pid, signal.SIGKILL)
    kill_marked(marker)
    written = read_json(result)
    declared = written.get("status")
    if timed_out:
        status = "timed_out"
    elif proc.returncode != 0 or declared == "failed":
        status = "failed"
    elif declared == "skipped":
        status = "skipped"
    else:
        status = "ok"
    tail = [] if status in ("ok", "skipped") else tail_lines(log)
    return Outcome(status, round(time.monotonic() - start, 1), proc.returncode, written, tail, leftovers)
