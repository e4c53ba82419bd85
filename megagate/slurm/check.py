"""What `megagate submit` and `megagate sweep --slurm` check before anything is rendered or queued: the trainer's own.

A job refused here would have been refused by the trainer on every rank after waiting in the queue (and, through the
requeue protocol, retried), so the config is read by the trainer's loader (`megagate.config_reader.load`: sections, keys,
types, gates, batch and model checks) and its layout is checked for the job's world size, nodes x ranks per node,
with the trainer's rules (`megagate.distributed.layout`).
"""

from __future__ import annotations

from megagate import config_reader, run_config
from megagate.distributed.layout import Layout
from megagate.slurm.request import SlurmRequest


def check_job(request: SlurmRequest, config_path: str, overrides: list[str]) -> tuple[run_config.TrainConfig, Layout]:
    """(config, layout) of the training job, or the trainer's one-line ConfigError.

    With a container image, the job's software and file paths are the image's, not this machine's: the checks of
    the machine (Transformer Engine installed, data files present) are left to the trainer, which makes them first
    thing on every rank.
    """
    cfg = config_reader.load(config_path, overrides, environment=request.container_image is None)
    return cfg, run_config.layout(cfg, request.world_size)
