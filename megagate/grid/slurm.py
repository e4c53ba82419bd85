"""A grid's trials as one Slurm job array: task i runs trial i, through megagate.slurm's renderer (sbatch with the
requeue protocol: a preempted, timed-out or failed task checkpoints, requeues and resumes) and its submit."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megagate.slurm import SlurmRequest, render_batch_script


def array_script(
    request: SlurmRequest,
    config_path: str,
    tasks: Sequence[tuple[str, Sequence[str]]],
    title: str,
    launcher: str = "srun",
) -> tuple[SlurmRequest, str]:
    """The request (its array `0-(n-1)` unless it names one) and the sbatch script running `tasks` ((name, overrides
    with the run's output.dir)) as `megagate train --config CONFIG_PATH <overrides>`; the script's header is `title`
    and one line per array task."""
    if request.array is None:
        request = dataclasses.replace(request, array=f"0-{len(tasks) - 1}")
    header = "\n".join([title, *(f"array task {i}: {name}" for i, (name, _) in enumerate(tasks))])
    script = render_batch_script(
        request,
        ["-m", "megagate", "train", "--config", str(config_path)],
        launcher,
        sweep=[list(overrides) for _, overrides in tasks],
        header=header,
    )
    return request, script


__all__ = ["array_script"]
