"""Run a grid's trials on this machine: one after another on the console (`run_local`, `megagate sweep`), or a pool
of `megagate train` processes sized to the machine (`run_pool`, a `megagate frontier` round).

In the pool each trial is its own process (`python -m megagate train --config C <overrides>`), its console output
appended to OUT/logs/<name>.log. Workers: one per GPU when there are GPUs (each trial sees only its own), else one per
`threads` CPU cores. A trial dies with the driver: the kernel sends it SIGTERM when the driver process ends (even
of SIGKILL), so it checkpoints and exits at its next step boundary, and the rerun resumes it instead of running a
second copy next to an orphan. SIGTERM/SIGINT to the driver are passed on the same way.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from megagate.distributed.utils import die_with_parent
from megagate.errors import MegagateError
from megagate.grid.trials import TRAIN_COMMAND, RunSpec


class Interrupted(MegagateError):
    """The driver got SIGTERM/SIGINT: its trials were told to checkpoint and stop; a rerun resumes the search."""


def default_workers(threads: int) -> tuple[int, list[str]]:
    """(workers, GPU ids): one worker per visible GPU, else cpu_count // threads (at least 1)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    else:
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            gpus = [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]
        except (OSError, subprocess.SubprocessError):
            gpus = []
    if gpus:
        return len(gpus), gpus
    return max(1, (os.cpu_count() or 1) // max(1, threads)), []


def run_pool(
    jobs: Sequence[tuple[str, list[str]]],
    log_dir: Path,
    workers: int,
    threads: int = 1,
    gpus: Sequence[str] = (),
    on_start: Callable[[str, int], None] | None = None,
    poll: float = 0.5,
) -> dict[str, int]:
    """Run `jobs` ((name, argv)) at most `workers` at a time; name -> exit status (negative: killed by a signal).

    Raises Interrupted after passing a SIGTERM/SIGINT on to the running trials and waiting for them to stop.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    queue = list(jobs)
    running: dict[str, tuple[subprocess.Popen, str | None]] = {}
    free_gpus = list(gpus)
    results: dict[str, int] = {}
    stop = {"signal": None}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while queue or running:
            if stop["signal"] is not None:
                for proc, _ in running.values():
                    proc.send_signal(signal.SIGTERM)  # checkpoint and stop at the next step boundary
                for name, (proc, _) in running.items():
                    results[name] = proc.wait()
                raise Interrupted(
                    f"interrupted by signal {stop['signal']}: {len(running)} running trial(s) checkpointed and "
                    "stopped; rerun the same command to resume"
                )
            while queue and len(running) < workers:
                name, argv = queue.pop(0)
                gpu = free_gpus.pop(0) if free_gpus else None
                env = dict(os.environ, OMP_NUM_THREADS=str(threads))
                if gpus:
                    env["CUDA_VISIBLE_DEVICES"] = gpu
                with open(log_dir / f"{name}.log", "ab") as logf:
                    proc = subprocess.Popen(
                        argv,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        env=env,
                        preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM),
                    )
                running[name] = (proc, gpu)
                if on_start is not None:
                    on_start(name, proc.pid)
            for name in [n for n, (p, _) in running.items() if p.poll() is not None]:
                proc, gpu = running.pop(name)
                results[name] = proc.returncode
                if gpu is not None:
                    free_gpus.append(gpu)
            time.sleep(poll)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return results


__all__ = ["Interrupted", "default_workers", "run_pool"]


def run_local(
    specs: Sequence[RunSpec], config_path: str, command: Sequence[str] = TRAIN_COMMAND, keep_going: bool = True
) -> dict[str, int]:
    """Run each spec in turn (`command` + spec.argv); return name -> exit status.

    A diverged run that aborts (non-zero exit) is a result of a stability sweep, not a failure of the sweep:
    with `keep_going` the remaining runs still execute.
    """
    results: dict[str, int] = {}
    for i, spec in enumerate(specs, start=1):
        Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
        print(f"[sweep {i}/{len(specs)}] {spec.name}", flush=True)
        status = subprocess.run([*command, *spec.argv(config_path)]).returncode
        results[spec.name] = status
        if status != 0:
            print(f"[sweep] {spec.name} exited with status {status}", file=sys.stderr, flush=True)
            if not keep_going:
                break
    return results
