"""The side channel between ranks: small files in the run folder, never the training collectives.

    <output.dir>/watchdog/<launch>/rank00003.json         rank 3's progress record, rewritten about once a second
    <output.dir>/watchdog/<launch>/hang.json              created by the first rank that detects a hang
    <output.dir>/watchdog/<launch>/stacks-rank00003.txt   rank 3's Python stacks (all threads) at the hang
    <output.dir>/watchdog/<launch>/diagnosis.json         the hang's diagnosis (written by one rank)
    <output.dir>/watchdog/<launch>/failed-rank00003.json  rank 3's fatal error (the others exit when they see it)
    <output.dir>/watchdog/<launch>/lost.json              a rank that vanished: the line every survivor prints
    <output.dir>/health.jsonl                             the run's health events: hangs, failures, stragglers,
                                                          injected faults (one JSON line each, appended)

A launch (one start of `megagate train`) has its own folder, named by rank 0 at start, so records of an earlier
launch are never mistaken for live ones; the newest KEEP_LAUNCHES folders are kept. Records are written to a
temporary name and renamed (a reader never sees half a record); each carries a counter (`beat`) so a reader can
tell a live rank from a stopped one by reading twice, without comparing clocks across hosts. The folder must be on
a file system every rank sees coherently (Lustre, GPFS, NFS with close-to-open consistency): a rank is found
stopped when its record stops changing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from megagate.files import atomic_path

WATCHDOG_DIR = "watchdog"
HEALTH_EVENTS = "health.jsonl"
HANG = "hang.json"
DIAGNOSIS = "diagnosis.json"
LOST = "lost.json"
KEEP_LAUNCHES = 10
# The batch script's file for this attempt's failure reason (megagate.slurm.render exports it)
FAILURE_FILE_ENV = "MEGAGATE_FAILURE_FILE"
_RECORD = re.compile(r"^rank(\d{5})\.json$")
_FAILED = re.compile(r"^failed-rank(\d{5})\.json$")


def write_json_atomic(path: Path, data: dict) -> None:
    """`data` as JSON at `path`, written to a temporary name beside it and renamed (not fsynced, unlike
    `files.write_atomic`: a progress record is rewritten every heartbeat and the next one replaces a lost one)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data))


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def append_event(run_dir: str | os.PathLike, record: dict) -> None:
    """One line in <run>/health.jsonl (one write on an O_APPEND descriptor: lines of several ranks never mix)."""
    path = Path(run_dir) / HEALTH_EVENTS
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_events(run_dir: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """The health events of a run (of one `kind`), oldest first; unreadable lines are skipped."""
    path = Path(run_dir) / HEALTH_EVENTS
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and (kind is None or record.get("kind") == kind):
            out.append(record)
    return out


def write_failure_file(reason: str, hosts: list[str], kind: str) -> None:
    """Tell the batch script why this attempt failed (when it asked: MEGAGATE_FAILURE_FILE), one key=value a line."""
    target = os.environ.get(FAILURE_FILE_ENV)
    if not target:
        return
    path = Path(target)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"kind={kind}", f"hosts={','.join(sorted(set(hosts)))}", "reason=" + " ".join(reason.split())]
        with atomic_path(path) as tmp:
            tmp.write_text("\n".join(lines) + "\n")


class Channel:
    """One launch's folder, seen from one rank."""

    def __init__(self, run_dir: str | os.PathLike, launch: str, rank: int) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / WATCHDOG_DIR
        self.dir = self.root / launch
        self.launch, self.rank = launch, rank

    def create(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def prune(self, keep: int = KEEP_LAUNCHES) -> None:
        """Remove all but the newest `keep` launch folders (names sort by start time)."""
        if not self.root.is_dir():
            return
        launches = sorted(p for p in self.root.iterdir() if p.is_dir() and p != self.dir)
        for old in launches[: max(0, len(launches) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)

    # --- progress records ------------------------------------------------------------------------------------------
    def record_path(self, rank: int) -> Path:
        return self.dir / f"rank{rank:05d}.json"

    def write_record(self, record: dict) -> None:
        write_json_atomic(self.record_path(self.rank), record)

    def records(self) -> dict[int, dict]:
        """rank -> its latest progress record."""
        out = {}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.dir):
                match = _RECORD.match(entry.name)
                if match:
                    record = read_json(Path(entry.path))
                    if record is not None:
                        out[int(match.group(1))] = record
        return out

    # --- hang ------------------------------------------------------------------------------------------------------
    def claim_hang(self, record: dict) -> bool:
        """Create hang.json (True: this rank is the first to detect a hang, and diagnoses it)."""
        try:
            fd = os.open(self.dir / HANG, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        return True

    def hang(self) -> dict | None:
        return read_json(self.dir / HANG) if (self.dir / HANG).exists() else None

    def stacks_path(self, rank: int) -> Path:
        return self.dir / f"stacks-rank{rank:05d}.txt"

    def write_diagnosis(self, diagnosis: dict) -> None:
        write_json_atomic(self.dir / DIAGNOSIS, diagnosis)

    def diagnosis(self) -> dict | None:
        return read_json(self.dir / DIAGNOSIS)

    # --- a vanished rank -------------------------------------------------------------------------------------------
    def claim_lost(self, event: dict) -> bool:
        """Publish the vanished rank's line as lost.json unless a survivor did first (True: this rank's is it).
        Written whole under a temporary name, then linked: a reader never sees it half-written."""
        fd, tmp = tempfile.mkstemp(prefix=f".{LOST}.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(event, f)
            os.link(tmp, self.dir / LOST)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def lost(self) -> dict | None:
        return read_json(self.dir / LOST)

    # --- failures --------------------------------------------------------------------------------------------------
    def publish_failure(self, record: dict) -> None:
        write_json_atomic(self.dir / f"failed-rank{self.rank:05d}.json", record)

    def failures(self) -> dict[int, dict]:
        """rank -> failure record, of the ranks that failed in this launch."""
        out = {}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.dir):
                match = _FAILED.match(entry.name)
                if match:
                    out[int(match.group(1))] = read_json(Path(entry.path)) or {"error": "?"}
        return out

    def events_seen(self) -> tuple[bool, dict[int, dict]]:
        """(a hang was declared, the other ranks' failures) in one directory listing (the watchdog's poll)."""
        hang, failed = False, {}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.dir):
                if entry.name == HANG:
                    hang = True
                else:
                    match = _FAILED.match(entry.name)
                    if match and int(match.group(1)) != self.rank:
                        failed[int(match.group(1))] = read_json(Path(entry.path)) or {"error": "?"}
        return hang, failed


def launch_name(now: float, salt: str) -> str:
    """A launch folder name that sorts by start time: 20250102-153000-<salt>."""
    import time

    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + f"-{salt}"


def describe(record: Any) -> str:
    """'rank 3 (node2)' for a progress record."""
    return f"rank {record.get('rank', '?')} ({record.get('host', '?')})"
