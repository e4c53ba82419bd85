#!/usr/bin/env python3
"""Render the example batch scripts in this folder from the code (`--check`: fail if any is out of date).

    python slurm/examples/render_examples.py [--check]

Each script is rendered the way `megagate submit` (or `megagate sweep --slurm`) renders it, after the same checks: its
config (under configs/) is read by the trainer's loader and its layout checked for the job's world size.
"""

import sys
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from megagate.commands.submit import render_for_config  # noqa: E402
from megagate.grid import slurm as grid_slurm  # noqa: E402
from megagate.grid import trials as grid  # noqa: E402
from megagate.slurm import SlurmRequest, write_script  # noqa: E402

CONFIG_15A2B = "slurm/examples/configs/15a2b_moe.yaml"
CONFIG_TINY = "slurm/examples/configs/tiny.yaml"
CONFIG_48L = "slurm/examples/configs/1p7b_48l_stability.yaml"
CONFIG_SINK = "slurm/examples/configs/sink_60m.yaml"
CONFIG_PROXY = "slurm/examples/configs/deep_thin_proxy.yaml"


@dataclass(frozen=True)
class Job:
    """One example script: a request, the config it trains (relative to the repository root) and its overrides."""

    name: str  # file name in this folder
    request: SlurmRequest
    config: str
    overrides: tuple[str, ...] = ()
    launcher: str = "srun"
    lrs: tuple[float, ...] = ()  # a job array: one learning rate per array task (`megagate sweep --slurm`)
    variants: tuple[str, ...] = ("g1-elementwise",)  # with lrs: the gate presets of the grid

    def render(self) -> str:
        """The script text; ConfigError if the trainer would refuse the config on this job's world size."""
        if not self.lrs:
            return render_for_config(self.request, self.config, list(self.overrides), launcher=self.launcher)[1]
        specs = grid.expand_grid(
            list(self.overrides), list(self.lrs), list(self.variants), [0], out_dir=f"runs/{self.request.job_name}"
        )
        grid.check_grid(specs, self.config, self.request.world_size)
        tasks = [(spec.name, [*spec.overrides, f"output.dir={spec.run_dir}"]) for spec in specs]
        return grid_slurm.array_script(self.request, self.config, tasks, f"config: {self.config}", self.launcher)[1]


MOE_8X8 = SlurmRequest(
    nodes=8,
    gpus_per_node=8,
    time="04:00:00",
    partition="gpu",
    account="my-account",
    job_name="15a2b",
    container_image="nvcr.io#nvidia/pytorch:25.01-py3",
    container_mounts=("/lustre:/lustre",),
    container_workdir="/lustre/megagate",
    venv="/lustre/megagate/.venv",
    signal_lead_s=600,
    extra_sbatch=("--exclusive",),
    env={"NCCL_SOCKET_IFNAME": "^lo,docker"},
)
MOE_8X8_VENV = replace(
    MOE_8X8, container_image=None, container_mounts=(), container_workdir=None, venv="/shared/megagate/.venv"
)
# the project's own image (container/Dockerfile, imported with enroot: docs/cluster.md); the code and every
# dependency are in it, so the step runs the image's python: no venv
MOE_8X8_IMAGE = replace(
    MOE_8X8,
    container_image="/lustre/images/megagate-0.1.0.sqsh",
    container_mounts=("/lustre:/lustre",),
    container_workdir="/opt/megagate",
    venv=None,
)
TINY = SlurmRequest(
    nodes=2,
    gpus_per_node=0,
    tasks_per_node=2,
    time="00:30:00",
    job_name="tiny",
    venv=".venv",
    signal_lead_s=120,
    max_restarts=5,
    env={"GLOO_SOCKET_IFNAME": "lo"},
)

JOBS = (
    Job("15a2b_8x8.sbatch", MOE_8X8, CONFIG_15A2B),
    Job("15a2b_8x8_torchrun.sbatch", MOE_8X8_VENV, CONFIG_15A2B, launcher="torchrun"),
    Job("15a2b_8x8_container.sbatch", MOE_8X8_IMAGE, CONFIG_15A2B),
    Job("tiny_2x2.sbatch", TINY, CONFIG_TINY, ("train.train_steps=50",)),
    Job(
        "tiny_sweep_array.sbatch",
        replace(TINY, job_name="tiny-sweep", array="0-2%2"),
        CONFIG_TINY,
        lrs=(1e-3, 3e-3, 1e-2),
    ),
    # the paper's stability sweep (docs/science.md): 1.7B-48L, LR 4e-3 vs 8e-3, baseline vs gated vs sandwich norm
    Job(
        "1p7b_48l_stability_array.sbatch",
        replace(MOE_8X8, job_name="1p7b-48l-stability", array="0-5"),
        CONFIG_48L,
        lrs=(4e-3, 8e-3),
        variants=("baseline", "g1-elementwise", "sandwich-norm"),
    ),
    # Gu et al.'s 60M sink setting (docs/monitoring.md §7.2): baseline vs G1, 2.1B tokens each on one 8-GPU node
    Job(
        "sink_60m_array.sbatch",
        replace(MOE_8X8, nodes=1, time="01:00:00", job_name="sink-60m", array="0-1"),
        CONFIG_SINK,
        lrs=(4e-4,),
        variants=("baseline", "g1-elementwise"),
    ),
    # a deep-thin stability proxy (Wortsman et al. 2023; docs/science.md): 32 x d 384, QK-norm, LR 2e-3 .. 3e-2
    Job(
        "deep_thin_proxy_array.sbatch",
        replace(MOE_8X8, nodes=1, time="04:00:00", job_name="deep-thin-proxy", array="0-7"),
        CONFIG_PROXY,
        lrs=(2e-3, 5e-3, 1e-2, 3e-2),
        variants=("baseline", "g1-elementwise"),
    ),
)


def examples() -> dict[str, str]:
    """file name -> script text (run from the repository root: the configs are named relative to it)."""
    return {job.name: job.render() for job in JOBS}


def main(argv: list[str]) -> int:
    stale = []
    for name, text in examples().items():
        path = HERE / name
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            write_script(text, path)
            print(f"wrote {path.relative_to(HERE.parents[1])}")
    unknown = sorted({p.name for p in HERE.glob("*.sbatch")} - {job.name for job in JOBS})
    if unknown:
        print(f"not rendered by this script: {', '.join(unknown)}; add them to JOBS or remove them", file=sys.stderr)
        return 1
    if stale:
        print(f"out of date: {', '.join(stale)}; run python slurm/examples/render_examples.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
