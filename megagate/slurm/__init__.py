"""Slurm jobs for megagate: requests, layout checks, batch-script rendering with the requeue protocol, submission."""

from megagate.slurm.config import ParallelConfig, apply_overrides, read_parallel_config
from megagate.slurm.layout import ParallelLayout, check_layout
from megagate.slurm.render import DEFAULT_ENV, render_batch_script
from megagate.slurm.request import LAUNCHERS, SlurmRequest, parse_time_limit
from megagate.slurm.submit import SubmitError, submit, write_script

__all__ = [
    "DEFAULT_ENV",
    "LAUNCHERS",
    "ParallelConfig",
    "ParallelLayout",
    "SlurmRequest",
    "SubmitError",
    "apply_overrides",
    "check_layout",
    "parse_time_limit",
    "read_parallel_config",
    "render_batch_script",
    "submit",
    "write_script",
]
