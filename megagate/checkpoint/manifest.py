"""A checkpoint's manifest (every file's name, size and CRC-32, written last by a save) and the checks before a load:
`verify` (every file as the manifest says), `safety_check` (no pickled code: `safe_files`), `damage` (both).

Collective by default (each rank checksums a share of the files, rank 0 scans for pickles, all ranks agree);
`collective=False` for a single process reading a checkpoint on its own.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from megagate.checkpoint import safe_files
from megagate.checkpoint.naming import MANIFEST, META
from megagate.distributed.utils import broadcast_object, gather_objects, get_rank, get_world_size
from megagate.errors import MegagateError

_BLOCK = 4 << 20  # CRC-32 read size
_LOADER_READS = (".distcp", ".metadata", ".pt")  # files megatron or torch read on load: never unlisted


def first_reason(reasons: list[str | None]) -> str | None:
    """The first non-empty reason of a gathered list (every rank's), or None."""
    return next((r for r in reasons if r), None)


def crc32(path: str | os.PathLike) -> int:
    """zlib CRC-32 of a file, read in 4 MiB blocks."""
    value = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            value = zlib.crc32(block, value)
    return value


def records(folder: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """{name: {"size", "crc32"}} of the files `names` in `folder`."""
    return {name: {"size": (folder / name).stat().st_size, "crc32": crc32(folder / name)} for name in names}


def read_manifest(path: str | os.PathLike) -> dict:
    """A checkpoint's manifest: {"files": {name: {"size", "crc32"}}, "world_size", "total_bytes", ...}."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("size"), int) and isinstance(r.get("crc32"), int)
            for r in files.values()
        ):
            raise ValueError("bad file records")
        int(manifest["world_size"])
    except FileNotFoundError:
        raise MegagateError(f"{MANIFEST}: missing (an unfinished save, or written by an older megagate)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MegagateError(f"{MANIFEST}: unreadable ({type(exc).__name__}: {exc})") from None
    return manifest


def _required(world_size: int) -> list[str]:
    # `common.pt` is not among them: megatron-core 0.19 keeps the common state inside the shards ("common_state");
    # a legacy one, when present, must be listed like every other file
    return [".metadata", "metadata.json", META, *(f"rng_{r}.pt" for r in range(world_size))]


def verify(path: str | os.PathLike, collective: bool = True) -> str | None:
    """Why checkpoint `path` is damaged (one phrase), or None when every file matches its manifest.

    Collective (each rank checksums a share of the files and all ranks agree) unless `collective` is False.
    """
    path = Path(path)
    rank, world = (get_rank(), get_world_size()) if collective else (0, 1)
    reason = None
    try:
        manifest = read_manifest(path)
        files: dict[str, dict[str, int]] = manifest["files"]
        missing = [name for name in _required(int(manifest["world_size"])) if name not in files]
        if missing:
            raise MegagateError(f"{missing[0]}: not in the manifest")
        present = {entry.name for entry in path.iterdir()} if path.is_dir() else set()
        unlisted = sorted(n for n in present - set(files) - {MANIFEST} if n.endswith(_LOADER_READS))
        if unlisted:
            raise MegagateError(f"{unlisted[0]}: not in the manifest (added after the save)")
        for name in sorted(files)[rank::world]:
            record, file = files[name], path / name
            if not file.is_file():
                raise MegagateError(f"{name}: missing")
            size = file.stat().st_size
            if size != record["size"]:
                raise MegagateError(f"{name}: size {size}, manifest says {record['size']}")
            if crc32(file) != record["crc32"]:
                raise MegagateError(f"{name}: checksum differs from the manifest (same size {size})")
    except MegagateError as exc:
        reason = str(exc)
    except OSError as exc:
        reason = f"cannot be read ({exc.strerror or exc})"
    return first_reason(gather_objects(reason)) if collective else reason


def safety_check(path: str | os.PathLike, collective: bool = True) -> str | None:
    """Refuse a checkpoint with pickled code in it (UnsafeFileError on every rank); return a damage reason or None.

    Rank 0 scans (`safe_files.check_checkpoint`) and tells the others, so all raise or go on together.
    """
    result: tuple[str, str] | None = None
    if not collective or get_rank() == 0:
        try:
            safe_files.check_checkpoint(path)
        except safe_files.UnsafeFileError as exc:
            result = ("unsafe", str(exc))
        except safe_files.DamagedFileError as exc:
            result = ("damaged", str(exc))
        except OSError as exc:
            result = ("damaged", f"cannot be read ({exc.strerror or exc})")
    if collective:
        result = broadcast_object(result)
    if result is not None and result[0] == "unsafe":
        raise safe_files.UnsafeFileError(result[1])
    return None if result is None else result[1]


def damage(path: str | os.PathLike, collective: bool = True) -> str | None:
    """Refuse pickled code (UnsafeFileError), then the first damage of `path` (one phrase) or None: what every load
    of a checkpoint checks first. Collective unless `collective` is False."""
    scanned = safety_check(path, collective)  # pickled code is refused even in a damaged checkpoint
    return verify(path, collective) or scanned
