"""A frontier round on Slurm: the trials as one job array (megagate.slurm's sbatch with the requeue protocol: a
preempted, timed-out or failed task checkpoints/requeues and resumes), and the next driver as a small job that
starts when the array has ended (`--dependency=afterany`). That driver harvests the round, plans the next, submits
it and its own successor: the chain needs no terminal. The last driver writes the report.

To stop the chain, cancel the driver job (`<job>-driver`) and the array; `megagate frontier --resume OUT` continues
it from a terminal (it waits for nothing: a round whose array is still queued or running is left to its driver).
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

from megagate.errors import MegagateError
from megagate.frontier.state import FrontierState
from megagate.grid import slurm as grid_slurm
from megagate.slurm import SlurmRequest, submit

ACTIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")


def request_from(backend: dict[str, Any]) -> SlurmRequest:
    fields = dict(backend["request"])
    for key in ("container_mounts", "extra_sbatch"):
        fields[key] = tuple(fields.get(key, ()))
    return SlurmRequest(**fields)


def backend_record(request: SlurmRequest, max_parallel: int | None, driver_time: str) -> dict[str, Any]:
    d = dataclasses.asdict(request)
    d["env"] = dict(request.env)
    return {"kind": "slurm", "request": d, "max_parallel": max_parallel, "driver_time": driver_time}


def array_script(state: FrontierState, out: Path, rnd: dict) -> tuple[SlurmRequest, str]:
    """The round's job array: task i runs trial rnd['trials'][i]."""
    backend = state.backend
    names = rnd["trials"]
    spec = state.spec
    array = f"0-{len(names) - 1}" + (f"%{backend['max_parallel']}" if backend.get("max_parallel") else "")
    base = request_from(backend)
    request = dataclasses.replace(
        base,
        job_name=f"{base.job_name}-r{rnd['index']}",
        array=array,
        run_dir=str(out),
        log_dir=str(out / "logs"),
    )
    tasks = [(n, rnd["overrides"][n]) for n in names]
    return grid_slurm.array_script(request, spec.config, tasks, f"frontier round {rnd['index']} of {out}")


def driver_script(state: FrontierState, out: Path, after: int, cwd: Path) -> str:
    """The next driver: after job `after` has ended (any way), `megagate frontier --resume OUT`."""
    request = request_from(state.backend)
    python = f"{request.venv.rstrip('/')}/bin/python" if request.venv else request.python
    opts = [
        f"--job-name={request.job_name}-driver",
        "--nodes=1",
        "--ntasks=1",
        f"--time={state.backend.get('driver_time', '00:30:00')}",
        f"--output={out / 'logs'}/driver-%j.out",
        "--open-mode=append",
        f"--dependency=afterany:{after}",
        "--requeue",
    ]
    opts += [f"--{name}={getattr(request, name)}" for name in ("partition", "account", "qos") if getattr(request, name)]
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts)]
    lines += [
        "# Rendered by megagate.frontier.slurm: the frontier's next driver step (harvest, plan, submit the next round).",
        f"cd {shlex.quote(str(cwd))} || exit 1",
        f"exec {shlex.quote(python)} -m megagate frontier --resume {shlex.quote(str(out))}",
    ]
    return "\n".join(lines) + "\n"


def submit_round(state: FrontierState, out: Path, rnd: dict) -> None:
    """Submit the round's array, then the driver that follows it; job ids go into the round record."""
    cwd = Path.cwd()
    request, script = array_script(state, out, rnd)
    scripts = out / "slurm"
    array_id = submit(request, script, script_path=scripts / f"round-{rnd['index']}.sbatch", cwd=cwd)
    rnd["jobs"] = {"array": array_id}
    rnd["jobs"]["driver"] = submit(
        request,
        driver_script(state, out, array_id, cwd),
        script_path=scripts / f"driver-{rnd['index']}.sbatch",
        cwd=cwd,
    )
    print(
        f"[frontier] round {rnd['index']}: job array {array_id} ({len(rnd['trials'])} trials), then driver job "
        f"{rnd['jobs']['driver']}",
        flush=True,
    )


def job_active(job_id: int) -> bool:
    """True while any task of the job is queued or running (squeue knows it)."""
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return any(s.strip() in ACTIVE_STATES for s in proc.stdout.splitlines())


def round_running(state: FrontierState) -> int | None:
    """The open round's array job while it is still queued or running (its driver job will continue), else None."""
    rnd = state.open_round
    job = (rnd or {}).get("jobs", {}).get("array")
    return job if job is not None and job_active(job) else None


def check_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise MegagateError("--slurm: 'sbatch' not found on PATH (submit from a Slurm login node)")


__all__ = ["array_script", "backend_record", "check_sbatch", "driver_script", "round_running", "submit_round"]
