"""Files that appear whole or not at all, and folders checked before anything is written into them.

Every output of megagate is written under a temporary name beside its final one and renamed when complete
(`os.replace` is atomic within a file system), so a crash, a full disk or a bad input never leaves half a file
under the name a reader looks for:

    write_atomic(path, data)        bytes or text
    with atomic_path(path) as tmp:  a writer that takes a file name (savefig, a profiler trace, tokenizers' save)
    with atomic_dir(out) as tmp:    a whole folder (an export, an import), replacing `out`
    publish_dir(tmp, out)           the folder rename on its own (a collective checkpoint save renames on rank 0)

`check_writable_dir` refuses, in one line, a folder that is a file or not writable before a long job starts;
`refuse_own_input` an output that is, lies inside or (when replaced whole) holds what the command reads.
Layer 0: no torch, nothing of megagate but its errors.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from megagate.errors import MegagateError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: int = 0o644) -> Iterator[Path]:
    """A temporary file name beside `path`: renamed to `path` when the block ends, removed if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, mode)  # mkstemp creates 0600; outputs are meant to be shared
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, mode: int = 0o644) -> Path:
    """Write `data` to `path` through a temporary file in the same folder (flushed to disk), then rename."""
    with atomic_path(path, mode=mode) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def temp_dir_beside(out: str | os.PathLike) -> Path:
    """A fresh, empty temporary folder next to `out` (a stale one of this process is removed first)."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(tmp: str | os.PathLike, out: str | os.PathLike) -> None:
    """Rename the complete folder `tmp` to `out`, replacing what is there."""
    if Path(out).exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder beside `out`, renamed to `out` (replacing it) when the block ends, removed if it raises."""
    tmp = temp_dir_beside(out)
    try:
        yield tmp
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_writable_dir(path: str | os.PathLike, what: str) -> None:
    """MegagateError unless `path` is, or can be created as, a folder this process may write into.

    Walks up to the first existing ancestor: that one must be a folder (not a file) and writable (os.access, so a
    read-only file system counts too). `what` names the setting or flag in the message, e.g. "output.dir".
    """
    path = os.path.abspath(os.fspath(path))
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        where = "is a file" if probe == path else f"is under {probe!r}, which is a file"
        raise MegagateError(f"{what} {path!r} {where}, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "" if probe == path else f" (its first existing folder {probe!r} is not)"
        raise MegagateError(f"{what} {path!r} is not writable{where}")


def refuse_own_input(
    out: str | os.PathLike,
    inputs: Iterator[tuple[str, str | os.PathLike | None]] | list[tuple[str, str | os.PathLike | None]],
    *,
    flag: str = "--out",
    replaces: bool = False,
) -> None:
    """Refuse, in one line, an output that would destroy or change what the command reads: `out` is one of the
    `inputs` ((label, path); None skipped), lies inside one, or — when the command replaces `out` whole (`replaces`:
    an export, an import, a --force) — holds one. Paths are compared resolved (symlinks followed, `..` removed)."""
    if not str(out):
        raise MegagateError(f"{flag} '' is empty: give a path")
    target = Path(out).resolve()
    for label, path in inputs:
        if path is None or not str(path):
            continue
        source = Path(path).resolve()
        if target == source:
            raise MegagateError(f"{flag} {str(out)!r} is the input {label} {str(path)!r}: choose another {flag}")
        if target.is_relative_to(source):
            raise MegagateError(
                f"{flag} {str(out)!r} lies inside the input {label} {str(path)!r} (writing there would change it): "
                f"choose a {flag} outside it"
            )
        if replaces and source.is_relative_to(target):
            raise MegagateError(
                f"{flag} {str(out)!r} holds the input {label} {str(path)!r} (replacing {flag} would delete it): "
                f"choose a {flag} that does not contain it"
            )
