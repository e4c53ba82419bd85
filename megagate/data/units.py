"""Work units of a sharded preprocessing run: the plan, its manifest, and which units are done.

    plan = make_plan(files, settings, unit_bytes, tasks)   # pure but for reading sizes and Parquet footers
    manifest = write_manifest(units_dir, plan)             # refuses a manifest of other settings for the prefix
    done = done_units(units_dir, manifest)                 # a unit is done when its record matches the plan

The inputs, in their fixed order, are cut into units: consecutive small files share a unit up to `unit_bytes`; a
Parquet file bigger than that is cut into row-group ranges. Every input has a fingerprint (size, mtime, a SHA-256 of
its first and last MiB): a unit whose inputs changed no longer matches its done record, so rerunning the same
command redoes it and only it. Everything lives under `<output_prefix>.units/`: `manifest.json`, and per unit
`unit-NNNNN_<key>_document.{bin,idx,meta.json}` plus `unit-NNNNN.done.json` (written last).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megagate.data.formats import input_kind, open_parquet, row_group_bytes
from megagate.data.readers import Piece
from megagate.errors import ConfigError, MegagateError
from megagate.files import write_atomic

MANIFEST = "manifest.json"
_SAMPLE = 1 << 20


def units_dir(output_prefix: str) -> Path:
    return Path(os.path.abspath(output_prefix) + ".units")


def unit_prefix(udir: Path, unit: int) -> str:
    return str(udir / f"unit-{unit:05d}")


def fingerprint(path: Path) -> dict[str, Any]:
    """Size, mtime and a SHA-256 of the first and last MiB (cheap on terabytes, catches rewritten files)."""
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        if st.st_size > _SAMPLE:
            f.seek(max(_SAMPLE, st.st_size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample_sha256": h.hexdigest()}


def make_plan(files: Sequence[Path], settings: dict[str, Any], unit_bytes: int, tasks: int | None) -> dict[str, Any]:
    """The manifest's content: inputs with fingerprints, units (pieces, bytes, task), settings, task count."""
    if unit_bytes < 1:
        raise ConfigError(f"unit size {unit_bytes} bytes: must be positive")
    inputs = [fingerprint(f) for f in files]
    units: list[dict[str, Any]] = []
    current: list[dict[str, Any]] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            units.append({"pieces": current, "bytes": size})
        current, size = [], 0

    for i, f in enumerate(files):
        fsize = inputs[i]["size"]
        if input_kind(f) == "parquet" and fsize > unit_bytes:
            close()
            sizes = row_group_bytes(open_parquet(f))
            start, acc = 0, 0
            for g, b in enumerate(sizes):
                acc += b
                if acc >= unit_bytes or g == len(sizes) - 1:
                    current, size = [{"input": i, "row_groups": [start, g + 1]}], acc
                    close()
                    start, acc = g + 1, 0
            continue
        if size and size + fsize > unit_bytes:
            close()
        current.append({"input": i, "row_groups": None})
        size += fsize
    close()
    n_tasks = len(units) if tasks is None else tasks
    if not 1 <= n_tasks:
        raise ConfigError(f"--tasks {tasks}: must be at least 1")
    n_tasks = min(n_tasks, len(units))
    for k, u in enumerate(units):
        u["id"] = k
        u["task"] = k % n_tasks
        u["inputs"] = [inputs[p["input"]] for p in u["pieces"]]
    return {"version": 1, "settings": settings, "tasks": n_tasks, "unit_bytes": unit_bytes, "units": units}


def read_manifest(udir: Path) -> dict[str, Any]:
    path = udir / MANIFEST
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise MegagateError(f"{path}: no manifest (run the same command with --plan-only first)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MegagateError(f"{path}: not a readable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("version") != 1 or "units" not in manifest:
        raise MegagateError(f"{path}: not a megagate preprocess manifest (version 1)")
    return manifest


def write_manifest(udir: Path, plan: dict[str, Any], overwrite: bool = False) -> dict[str, Any]:
    """Write the plan as the manifest; a manifest of other settings for the same prefix is refused."""
    path = udir / MANIFEST
    if path.exists() and not overwrite:
        old = read_manifest(udir)
        if old.get("settings") != plan["settings"]:
            diff = sorted(
                k
                for k in set(old["settings"]) | set(plan["settings"])
                if old["settings"].get(k) != plan["settings"].get(k)
            )
            raise ConfigError(
                f"{path}: a manifest with other settings ({', '.join(diff)}) exists for this output prefix; "
                "pass --overwrite to replace it or choose another --output-prefix"
            )
    udir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(plan, indent=1) + "\n")
    return plan


def pieces(unit: dict[str, Any]) -> list[Piece]:
    out = []
    for p, fp in zip(unit["pieces"], unit["inputs"]):
        rg = p["row_groups"]
        out.append(Piece(Path(fp["path"]), *(rg if rg else (None, None))))
    return out


def check_unchanged(unit: dict[str, Any]) -> None:
    """Refuse a unit whose inputs changed since the plan (rerunning the same command re-plans and redoes it)."""
    for fp in unit["inputs"]:
        try:
            now = fingerprint(Path(fp["path"]))
        except OSError as exc:
            raise MegagateError(
                f"input {fp['path']!r} of unit {unit['id']}: unreadable since the plan ({exc.strerror})"
            ) from None
        if now != fp:
            what = [k for k in ("size", "mtime_ns", "sample_sha256") if now[k] != fp[k]]
            raise MegagateError(
                f"input {fp['path']!r} of unit {unit['id']} changed since the plan ({', '.join(what)}); "
                "rerun the same command without --unit/--task-id to re-plan: that unit is then redone"
            )


def done_record_path(udir: Path, unit: int) -> Path:
    return udir / f"unit-{unit:05d}.done.json"


def write_done(udir: Path, unit: dict[str, Any], stats: dict[str, Any]) -> None:
    """The unit's record, written last: the unit as planned (pieces and fingerprints) and what it produced."""
    record = {"unit": {k: unit[k] for k in ("id", "pieces", "inputs")}, **stats}
    write_atomic(done_record_path(udir, unit["id"]), json.dumps(record, indent=1) + "\n")


def done_units(udir: Path, manifest: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """unit id -> its done record, for the units whose record matches the manifest and whose outputs exist."""
    keys = manifest["settings"]["keys"]
    out = {}
    for unit in manifest["units"]:
        path = done_record_path(udir, unit["id"])
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            continue
        if record.get("unit") != {k: unit[k] for k in ("id", "pieces", "inputs")}:
            continue
        prefix = unit_prefix(udir, unit["id"])
        if all(os.path.isfile(f"{prefix}_{k}_document{s}") for k in keys for s in (".bin", ".idx")):
            out[unit["id"]] = record
    return out
