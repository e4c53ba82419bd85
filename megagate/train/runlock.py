"""One run per output directory: an exclusive lock on `<dir>/.megagate.lock`, held by rank 0 for the run.

Two launches writing one output.dir (a resubmitted job while the first still runs, a copy-pasted command) would
interleave metrics.jsonl and race on the checkpoints. `fcntl.flock(LOCK_EX | LOCK_NB)` on the lock file, kept open
for the whole run, excludes that; the kernel drops the lock when the process dies, even of SIGKILL, so a stale file
never blocks. The file holds the holder's host, pid, start time and command, so the refusal names it.

Where flock is not available (some NFS mounts raise ENOLCK / EOPNOTSUPP) the lock is the file itself, created with
O_EXCL; a file left by a dead process on this host (its pid gone, or reused by another process) is stale and
taken over; one from another host cannot be checked and refuses, saying which file to remove.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from megagate.errors import MegagateError

LOCK_NAME = ".megagate.lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot, /proc/<pid>/stat field 22), None if not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def holder_record() -> dict:
    """What a lock file says about its holder (this process)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "proc_start": _process_start(os.getpid()),
        "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
    }


def _read_holder(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # being written, or not ours


def _in_use(label: str, directory: Path, holder: dict, hint: str = "") -> MegagateError:
    who = f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {holder.get('since', '?')}"
    return MegagateError(
        f"{label} {str(directory)!r} is in use by another run ({who}); wait for it or choose another {label}{hint}"
    )


def _alive_on_this_host(holder: dict) -> bool:
    """True unless the holder is provably gone: same host and its pid not running (or running a newer process)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return True
    start = _process_start(holder["pid"])
    return start is not None and (holder.get("proc_start") in (None, start))


class RunLock:
    """An acquired lock on one directory; `release()` (or process death) frees it."""

    def __init__(self, path: Path, fd: int, exclusive_file: bool) -> None:
        self.path, self.fd, self.exclusive_file = path, fd, exclusive_file

    def release(self) -> None:
        if self.fd < 0:
            return
        if self.exclusive_file:  # the file *is* the lock: remove it (only ours: we created it)
            with contextlib.suppress(OSError):
                self.path.unlink()
        # a flock'd file stays (unlinking it would let a waiter lock an orphaned inode); closing drops the lock
        os.close(self.fd)
        self.fd = -1


def _write_holder(fd: int) -> None:
    # in place, not temp + rename: the lock belongs to this inode
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder_record()) + "\n").encode(), 0)
    with contextlib.suppress(OSError):
        os.fsync(fd)


def acquire(directory: str | os.PathLike, label: str = "output.dir", use_flock: bool = True) -> RunLock:
    """Lock `directory` for this process (created if missing); MegagateError naming the holder if it is taken.

    `use_flock=False` forces the O_EXCL fallback (what a filesystem without flock gets).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    if use_flock:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _in_use(label, directory, _read_holder(path)) from None
            if exc.errno not in _NO_FLOCK:
                raise MegagateError(f"{label} {str(directory)!r}: cannot lock {path}: {exc.strerror}") from None
        else:
            _write_holder(fd)
            return RunLock(path, fd, exclusive_file=False)
    for _ in range(3):  # fallback: the file is the lock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read_holder(path)
            if not holder and time.time() - _mtime(path) < 10:
                holder = {"host": "?", "pid": "?", "since": "just now"}  # being created right now
            if holder and _alive_on_this_host(holder):
                hint = f" (if that run is gone, remove {path})" if holder.get("host") != socket.gethostname() else ""
                raise _in_use(label, directory, holder, hint) from None
            with contextlib.suppress(FileNotFoundError):  # stale: its process is gone
                path.unlink()
            continue
        _write_holder(fd)
        return RunLock(path, fd, exclusive_file=True)
    raise _in_use(label, directory, _read_holder(path))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def lock_run_dirs(output_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike) -> list[RunLock]:
    """Lock output.dir, and checkpoint.dir when it lies outside it; on a refusal nothing stays locked."""
    out, ckpt = Path(output_dir).resolve(), Path(checkpoint_dir).resolve()
    wanted = [(Path(output_dir), "output.dir")]  # the configured paths: the refusal names what the user wrote
    if ckpt != out and out not in ckpt.parents:
        wanted.append((Path(checkpoint_dir), "checkpoint.dir"))
    locks: list[RunLock] = []
    try:
        for directory, label in wanted:
            locks.append(acquire(directory, label))
    except BaseException:
        release_all(locks)
        raise
    return locks


def release_all(locks: list[RunLock]) -> None:
    for lock in reversed(locks):
        lock.release()


def lock_for_run(output_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike) -> list[RunLock]:
    """Collective: rank 0 locks the run's directories and tells every rank, so all refuse (exit 2) together.

    Call after torch.distributed is initialised (or in a single process); returns rank 0's locks ([] elsewhere).
    """
    from megagate.distributed.utils import broadcast_object, is_global_rank0

    locks: list[RunLock] = []
    refusal: str | None = None
    if is_global_rank0():
        try:
            locks = lock_run_dirs(output_dir, checkpoint_dir)
        except MegagateError as exc:
            refusal = str(exc)
    refusal = broadcast_object(refusal)
    if refusal is not None:
        raise MegagateError(refusal)
    return locks
