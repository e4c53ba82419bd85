"""Slurm jobs for megagate: requests, the trainer's config and layout checks, batch-script rendering with the requeue
protocol, submission."""

from megagate.slurm.check import check_job
from megagate.slurm.render import DEFAULT_ENV, render_batch_script
from megagate.slurm.request import LAUNCHERS, SlurmRequest, parse_time_limit
from megagate.slurm.submit import SubmitError, submit, write_script

__all__ = [
    "DEFAULT_ENV",
    "LAUNCHERS",
    "SlurmRequest",
    "SubmitError",
    "check_job",
    "parse_time_limit",
    "render_batch_script",
    "submit",
    "write_script",
]
