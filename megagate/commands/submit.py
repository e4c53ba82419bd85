"""`megagate submit CONFIG [overrides] [--nodes N --gpus-per-node G ...] [--dry-run]`.

Reads the training config with the trainer's own loader and checks its layout for nodes x ranks per node (whatever
the trainer would refuse is refused here, before anything is rendered or queued), renders the batch script, prints it
and submits it with sbatch (or only prints it with --dry-run).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from megagate.distributed.layout import Layout
from megagate.errors import ConfigError
from megagate.plan import Plan, plan
from megagate.slurm.check import check_job
from megagate.slurm.render import render_batch_script
from megagate.slurm.request import LAUNCHERS, SlurmRequest
from megagate.slurm.submit import submit

DEFAULT_COMMAND = "-m megagate train"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="training config (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides passed to the trainer")
    a = parser.add_argument_group("allocation")
    a.add_argument("--nodes", type=int, default=1)
    a.add_argument("--gpus-per-node", type=int, default=8, help="0 for a CPU job (then give --tasks-per-node)")
    a.add_argument("--tasks-per-node", type=int, default=None, help="ranks per node (default: one per GPU)")
    a.add_argument("--cpus-per-task", type=int, default=None)
    a.add_argument("--time", default="04:00:00", help="Slurm time limit (default 04:00:00)")
    a.add_argument("--partition")
    a.add_argument("--account")
    a.add_argument("--qos")
    a.add_argument("--job-name", default=None, help="default: the config file's stem")
    a.add_argument("--array", default=None, help="Slurm job array spec, e.g. 0-7%%2")
    a.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="extra #SBATCH option, e.g. --exclusive (repeatable)",
    )
    s = parser.add_argument_group("software")
    s.add_argument("--container-image", help="pyxis/enroot image for srun --container-image")
    s.add_argument(
        "--container-mounts",
        action="append",
        default=[],
        metavar="SRC:DST",
        help="container mount (repeatable or comma-separated)",
    )
    s.add_argument("--container-workdir")
    s.add_argument("--venv", help="virtual environment to activate")
    s.add_argument("--python", default="python", help="python executable (default: python on PATH)")
    s.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set an environment knob in the script (KEY= unsets a default; repeatable)",
    )
    r = parser.add_argument_group("launch and restarts")
    r.add_argument(
        "--launcher", choices=LAUNCHERS, default="srun", help="srun: one task per GPU; torchrun: one torchrun per node"
    )
    r.add_argument(
        "--command",
        default=DEFAULT_COMMAND,
        help=f"what each rank runs after python, before --config (default: {DEFAULT_COMMAND!r})",
    )
    r.add_argument(
        "--signal-lead",
        type=int,
        default=300,
        metavar="SECONDS",
        help="SIGUSR1 this long before the time limit (default 300)",
    )
    r.add_argument("--max-restarts", type=int, default=50)
    r.add_argument("--max-same-failures", type=int, default=3)
    r.add_argument(
        "--exclude-after-hangs",
        type=int,
        default=2,
        metavar="N",
        help="exclude a node from the job on requeue after N hangs blamed on it (0: never; default 2)",
    )
    r.add_argument("--run-dir", default=None, help="restart state and scripts (default runs/<job-name>)")
    r.add_argument(
        "--progress-file",
        default=None,
        help="the trainer's latest-checkpoint marker (e.g. SAVE/latest_checkpointed_iteration.txt): "
        "repeated failures only count as the same when no progress was made",
    )
    r.add_argument("--log-dir", default="logs")
    r.add_argument("--master-addr", default=None, help="rendezvous host (default: first node)")
    m = parser.add_argument_group("memory plan (megagate plan)")
    m.add_argument("--gpu", default="h100-sxm", help="the nodes' GPU, for the memory plan (see megagate plan --help)")
    m.add_argument(
        "--force",
        "--ignore-memory-plan",
        dest="ignore_memory_plan",
        action="store_true",
        help="submit even if the plan predicts the job does not fit in GPU memory (its numbers are printed)",
    )
    parser.add_argument("--script-out", default=None, help="where to write the script (default under run dir)")
    parser.add_argument("--dry-run", action="store_true", help="print the script; do not submit")


def _parse_env(items: list[str]) -> dict[str, str | None]:
    env: dict[str, str | None] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--env {item!r} is not KEY=VALUE")
        env[key.strip()] = value if value != "" else None
    return env


def request_from_args(args: argparse.Namespace) -> SlurmRequest:
    """The SlurmRequest the flags describe."""
    from pathlib import Path

    mounts = tuple(m.strip() for item in args.container_mounts for m in item.split(",") if m.strip())
    return SlurmRequest(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        job_name=args.job_name or Path(args.config).stem,
        array=args.array,
        container_image=args.container_image,
        container_mounts=mounts,
        container_workdir=args.container_workdir,
        venv=args.venv,
        python=args.python,
        signal_lead_s=args.signal_lead,
        max_restarts=args.max_restarts,
        max_same_failures=args.max_same_failures,
        exclude_after_hangs=args.exclude_after_hangs,
        run_dir=args.run_dir,
        progress_file=args.progress_file,
        log_dir=args.log_dir,
        master_addr=args.master_addr,
        extra_sbatch=tuple(args.sbatch),
        env=_parse_env(args.env),
    )


def train_argv(command: str, config_path: str, overrides: list[str]) -> list[str]:
    """argv after the python executable: the command, then --config CONFIG, then the overrides."""
    argv = shlex.split(command)
    if not argv:
        raise ConfigError("--command is empty: give what python runs, e.g. '-m megagate train'")
    return [*argv, "--config", config_path, *overrides]


def render_for_config(
    request: SlurmRequest,
    config_path: str,
    overrides: list[str],
    *,
    command: str = DEFAULT_COMMAND,
    launcher: str = "srun",
    gpu: str = "h100-sxm",
    memory_plan: bool = True,
) -> tuple[Layout, str, Plan | None]:
    """Check the config and its layout as the trainer will, and (GPU jobs, `memory_plan`) that the plan predicts it
    fits in `gpu`'s memory; then render the script. (layout, script, the plan of a GPU job); nothing is written."""
    cfg, layout = check_job(request, config_path, overrides)
    predicted = None
    if request.gpus_per_node > 0:
        predicted = plan(cfg, request.world_size, gpu, gpus_per_node=request.gpus_per_node)
        if memory_plan and not predicted.fits:
            raise ConfigError(
                f"{predicted.refusal()}; see `megagate plan {config_path} --nodes {request.nodes} --gpus-per-node "
                f"{request.gpus_per_node} --gpu {gpu} --search`, or pass --force"
            )
    script = render_batch_script(
        request,
        train_argv(command, config_path, overrides),
        launcher=launcher,
        header=f"config: {config_path}\nlayout: {layout.describe()}\nbatch: {layout.describe_batch()}",
    )
    return layout, script, predicted


def run(args: argparse.Namespace) -> int:
    request = request_from_args(args)
    _, script, predicted = render_for_config(
        request,
        args.config,
        args.overrides,
        command=args.command,
        launcher=args.launcher,
        gpu=args.gpu,
        memory_plan=not args.ignore_memory_plan,
    )
    print(script, end="")
    if predicted is not None and not predicted.fits:  # --force: through, with the plan's numbers
        print(f"warning: {predicted.refusal()}; submitting anyway (--force)", file=sys.stderr)
    if args.dry_run:
        if predicted is not None:  # the plan's table, on stderr: stdout stays the script
            print(f"memory plan:\n{predicted.table()}", file=sys.stderr)
        return 0
    job_id = submit(request, script, script_path=args.script_out)
    print(f"Submitted batch job {job_id}", file=sys.stderr)
    return 0
