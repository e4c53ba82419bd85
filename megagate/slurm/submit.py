"""Write a rendered batch script to disk (atomically) and hand it to `sbatch`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from megagate.errors import MegagateError
from megagate.files import write_atomic
from megagate.slurm.request import SlurmRequest


class SubmitError(MegagateError):
    """sbatch is missing or refused the job."""


def write_script(script: str, path: str | os.PathLike[str]) -> Path:
    """Write `script` to `path` (atomically: a reader never sees half a script); mode 0755."""
    return write_atomic(path, script, mode=0o755)


def default_script_path(request: SlurmRequest) -> Path:
    """Where a submitted script is kept: <run_dir>/slurm/<job_name>-<time>.sbatch (one per submission)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(request.resolved_run_dir) / "slurm" / f"{request.job_name}-{stamp}.sbatch"


def submit(
    request: SlurmRequest,
    script: str,
    *,
    script_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    sbatch: str = "sbatch",
) -> int:
    """Write the script, create the log folder, run `sbatch --parsable`, return the job id.

    `cwd` is the submission directory (relative log/run paths resolve there); `env` the environment sbatch runs
    with (the job inherits it: Slurm's default --export=ALL).
    """
    base = Path(cwd) if cwd is not None else Path.cwd()
    path = Path(script_path) if script_path is not None else default_script_path(request)
    path = write_script(script, path if path.is_absolute() else base / path)
    # Slurm does not create the --output folder; a missing one loses the whole log silently.
    log_dir = Path(request.log_dir)
    (log_dir if log_dir.is_absolute() else base / log_dir).mkdir(parents=True, exist_ok=True)
    search_path = (env or os.environ).get("PATH")
    if shutil.which(sbatch, path=search_path) is None:
        raise SubmitError(f"{sbatch!r} not found on PATH: submit from a Slurm login node (or use --dry-run)")
    proc = subprocess.run(
        [sbatch, "--parsable", str(path)],
        cwd=base,
        env=dict(env) if env is not None else None,
        text=True,
        capture_output=True,
        timeout=120,
    )
    if proc.returncode != 0:
        detail = " ".join((proc.stderr or proc.stdout).split())
        raise SubmitError(f"sbatch refused {path}: {detail}")
    # --parsable prints "JOBID" or "JOBID;CLUSTER".
    m = re.match(r"^\s*(\d+)", proc.stdout)
    if m is None:
        raise SubmitError(f"sbatch printed no job id for {path}: {proc.stdout.strip()!r}")
    return int(m.group(1))
