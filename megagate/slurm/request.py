"""What a Slurm training job asks for: allocation, software environment, preemption and restart policy."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from megagate.errors import ConfigError

LAUNCHERS = ("srun", "torchrun")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Slurm's --array forms: "0-7", "1,3,5", "0-15:4", with an optional "%N" concurrency limit.
_ARRAY = re.compile(r"^\d+(-\d+(:\d+)?)?(,\d+(-\d+(:\d+)?)?)*(%\d+)?$")
# Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_limit(text: str) -> int:
    """Seconds in a Slurm --time value ("90", "1:30:00", "2-00:00:00"); ConfigError for anything else."""
    m = _TIME.match(text.strip())
    if m is None:
        raise ConfigError(
            f"time {text!r} is not a Slurm time limit: use MINUTES, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
        )
    days, a, b, c = m.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # H:M:S
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:  # M:S
        return int(a) * 60 + int(b)
    return int(a) * 60  # M


@dataclass(frozen=True)
class SlurmRequest:
    """One batch job. `gpus_per_node=0` means a CPU job (no GPU request; `tasks_per_node` ranks per node)."""

    nodes: int = 1
    gpus_per_node: int = 8
    tasks_per_node: int | None = None  # ranks per node; defaults to gpus_per_node (one rank per GPU)
    cpus_per_task: int | None = None
    time: str = "04:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str = "megagate"
    array: str | None = None  # Slurm --array spec, e.g. "0-7%2"
    container_image: str | None = None  # pyxis/enroot image, e.g. "nvcr.io#nvidia/pytorch:25.01-py3"
    container_mounts: tuple[str, ...] = ()  # "SRC:DST[:FLAGS]" each
    container_workdir: str | None = None
    venv: str | None = None  # virtual environment to activate (or whose python to run inside the container)
    python: str = "python"
    signal_lead_s: int = 300  # --signal=B:USR1@N: warning this long before the time limit
    max_restarts: int = 50  # requeues of any kind (wall time, preemption, failures)
    max_same_failures: int = 3  # stop when the step fails this many times in a row the same way
    exclude_after_hangs: int = 2  # exclude a host on requeue after this many hangs blamed on it (0: never)
    run_dir: str | None = None  # where the restart state lives; default runs/<job_name>
    progress_file: str | None = None  # e.g. <save>/latest_checkpointed_iteration.txt: failures differ by progress
    log_dir: str = "logs"
    master_addr: str | None = None  # rendezvous host; default: first host of the node list
    extra_sbatch: tuple[str, ...] = ()  # more "#SBATCH" options, e.g. "--exclusive"
    env: Mapping[str, str | None] = field(default_factory=dict)  # overrides of the NCCL/network knobs; None unsets

    def __post_init__(self) -> None:
        def positive(name: str, value: object, minimum: int = 1) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ConfigError(f"{name}={value!r} is invalid: it must be an integer >= {minimum}")

        positive("nodes", self.nodes)
        positive("gpus_per_node", self.gpus_per_node, 0)
        if self.tasks_per_node is not None:
            positive("tasks_per_node", self.tasks_per_node)
            if self.gpus_per_node and self.tasks_per_node != self.gpus_per_node:
                raise ConfigError(
                    f"tasks_per_node={self.tasks_per_node} with gpus_per_node={self.gpus_per_node}: "
                    "a GPU job runs one rank per GPU (leave tasks_per_node unset)"
                )
        elif self.gpus_per_node == 0:
            raise ConfigError("gpus_per_node=0 (a CPU job) needs tasks_per_node (the ranks per node)")
        if self.cpus_per_task is not None:
            positive("cpus_per_task", self.cpus_per_task)
        positive("signal_lead_s", self.signal_lead_s)
        if self.signal_lead_s > 65535:
            raise ConfigError(f"signal_lead_s={self.signal_lead_s} is too large: Slurm allows at most 65535")
        limit = parse_time_limit(self.time)
        if limit and self.signal_lead_s >= limit:
            raise ConfigError(
                f"signal_lead_s={self.signal_lead_s} is not shorter than the time limit {self.time!r} ({limit} s)"
            )
        positive("max_restarts", self.max_restarts, 0)
        positive("max_same_failures", self.max_same_failures)
        positive("exclude_after_hangs", self.exclude_after_hangs, 0)
        if not _NAME.match(self.job_name):
            raise ConfigError(f"job_name={self.job_name!r} is invalid: use letters, digits and _ . + -")
        if self.array is not None and not _ARRAY.match(self.array):
            raise ConfigError(
                f"array={self.array!r} is not a Slurm array spec: use forms like 0-7, 1,3,5, 0-15:4, 0-7%2"
            )
        for name in (
            "partition",
            "account",
            "qos",
            "container_image",
            "container_workdir",
            "venv",
            "master_addr",
            "run_dir",
            "progress_file",
            "log_dir",
            "python",
        ):
            value = getattr(self, name)
            if value is not None and (not value.strip() or any(c in value for c in "\n\r\0")):
                raise ConfigError(f"{name}={value!r} is invalid: it must be a non-empty single line")
        for mount in self.container_mounts:
            if "," in mount or not mount.strip() or "\n" in mount:
                raise ConfigError(f"container mount {mount!r} is invalid: one SRC:DST[:FLAGS] per entry, no commas")
        for line in self.extra_sbatch:
            if "\n" in line or not line.strip():
                raise ConfigError(f"extra sbatch line {line!r} is invalid: one non-empty option per line")
        for key, value in self.env.items():
            if not _ENV_KEY.match(key):
                raise ConfigError(f"environment variable name {key!r} is invalid: use letters, digits and _")
            if value is not None and ("\n" in value or "\0" in value):
                raise ConfigError(f"environment variable {key} has a multi-line value; one line only")

    @property
    def ranks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def time_limit_s(self) -> int:
        return parse_time_limit(self.time)

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir or f"runs/{self.job_name}"
