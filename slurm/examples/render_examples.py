#!/usr/bin/env python3
"""Render the example batch scripts in this folder from the code (`--check`: fail if any is out of date).

    python slurm/examples/render_examples.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from megagate.commands.submit import render_for_config  # noqa: E402
from megagate.slurm import SlurmRequest, render_batch_script, write_script  # noqa: E402

CONFIG_15A2B = "slurm/examples/configs/15a2b_moe.yaml"
CONFIG_TINY = "slurm/examples/configs/tiny.yaml"

MOE_8X8 = SlurmRequest(
    nodes=8, gpus_per_node=8, time="04:00:00", partition="gpu", account="my-account", job_name="15a2b",
    container_image="nvcr.io#nvidia/pytorch:25.01-py3", container_mounts=("/lustre:/lustre",),
    container_workdir="/lustre/megagate", venv="/lustre/megagate/.venv", signal_lead_s=600,
    extra_sbatch=("--exclusive",), env={"NCCL_SOCKET_IFNAME": "^lo,docker"},
)


def examples() -> dict[str, str]:
    """file name -> script text."""
    out: dict[str, str] = {}
    out["15a2b_8x8.sbatch"] = render_for_config(MOE_8X8, CONFIG_15A2B, [])[1]
    torchrun = SlurmRequest(**{**MOE_8X8.__dict__, "container_image": None, "container_mounts": (),
                               "container_workdir": None, "venv": "/shared/megagate/.venv"})
    out["15a2b_8x8_torchrun.sbatch"] = render_for_config(torchrun, CONFIG_15A2B, [], launcher="torchrun")[1]
    tiny = SlurmRequest(nodes=2, gpus_per_node=0, tasks_per_node=2, time="00:30:00", job_name="tiny",
                        venv=".venv", signal_lead_s=120, max_restarts=5, env={"GLOO_SOCKET_IFNAME": "lo"})
    out["tiny_2x2.sbatch"] = render_for_config(tiny, CONFIG_TINY, ["train.train_iters=50"])[1]
    sweep = SlurmRequest(**{**tiny.__dict__, "job_name": "tiny-sweep", "array": "0-2%2"})
    out["tiny_sweep_array.sbatch"] = render_batch_script(
        sweep, ["-m", "megagate", "train", "--config", CONFIG_TINY],
        sweep=[["optimizer.lr=1e-3"], ["optimizer.lr=3e-4"], ["optimizer.lr=1e-4"]],
        header="sweep: one learning rate per array task",
    )
    return out


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
    if stale:
        print(f"out of date: {', '.join(stale)}; run python slurm/examples/render_examples.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
