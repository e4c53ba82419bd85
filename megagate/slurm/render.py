"""Render a `sbatch` script for a training job: allocation, NCCL knobs, software environment, launcher, requeue protocol.

The requeue protocol (megagate.slurm.requeue, the bash at the end of every script; see slurm/README.md): Slurm sends SIGUSR1 to the batch shell `signal_lead_s` before the time
limit (`--signal=B:USR1@N`); the shell forwards it to the step (srun passes USR1 on to every rank; for torchrun the
shell sends TERM, which torchrun passes on), the trainer checkpoints and exits 0, and the shell requeues the job.
A failed step (a rank exits non-zero or is killed; `--kill-on-bad-exit=1` takes the whole step down) is requeued
too, and the trainer resumes from its latest checkpoint. Requeues stop at `max_restarts`, or earlier when the step
failed `max_same_failures` times in a row the same way (state file under the run directory).

The trainer says why an attempt failed in a file the script names (MEGAGATE_FAILURE_FILE: a hang's diagnosis, or
the error of the one rank that failed; megagate.health): the requeue log and the attempts file record that reason.
A host blamed for `exclude_after_hangs` hangs of the job is excluded when the job is requeued: `scontrol requeuehold`,
`scontrol update ExcNodeList` (Slurm changes it only for a pending job; the hold keeps the scheduler from starting
the job on the bad host first), `scontrol release`. An attempt that lands on an excluded host anyway requeues itself
at once.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from megagate.distributed.launch import PORT_BASE, PORT_SLOTS, PORT_SPAN
from megagate.errors import ConfigError
from megagate.slurm.request import LAUNCHERS, SlurmRequest
from megagate.slurm.requeue import requeue_protocol

# The NCCL / network knobs, in one place. Values are the defaults for GPU clusters; SlurmRequest.env overrides.
DEFAULT_ENV: dict[str, str] = {
    # Megatron's TP/SP communication overlap relies on kernels being issued in order on one connection.
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # A dead peer should fail the step quickly (so the job is requeued) rather than hang until the time limit.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "NCCL_DEBUG": "WARN",
    "NCCL_IB_TIMEOUT": "22",
    # Logs from every rank appear as they are written (they share one file per job).
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
}

# Fabric-specific knobs: shown commented out in every script so the one place to set them is obvious.
FABRIC_HINTS: tuple[tuple[str, str], ...] = (
    ("NCCL_SOCKET_IFNAME", "the bootstrap/TCP interface, e.g. ib0 or ^lo,docker"),
    ("GLOO_SOCKET_IFNAME", "the interface gloo (CPU groups) uses"),
    ("NCCL_IB_HCA", "the InfiniBand HCAs, e.g. mlx5_0,mlx5_1"),
    ("NCCL_NET_GDR_LEVEL", "GPUDirect RDMA distance, e.g. PHB"),
    ("NCCL_CROSS_NIC", "0/1/2: may rings cross NICs"),
    ("NCCL_NVLS_ENABLE", "0 disables NVLink SHARP (some drivers hang with it)"),
)

# Defaults that yield to the submitting shell's own value (sbatch exports it into the job).
SOFT_ENV: tuple[tuple[str, str, str], ...] = (
    # The CUDA caching allocator grows segments instead of fragmenting memory across many: set before CUDA
    # initialises (megagate.distributed.launch sets it too). The older PYTORCH_CUDA_ALLOC_CONF (torch 2.9 reads
    # it, with a deprecation warning at exit) counts as the user's setting too.
    ("PYTORCH_ALLOC_CONF", "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF"),
)


def _q(value: str) -> str:
    return shlex.quote(value)


def bash_master_port_expr() -> str:
    """megagate.distributed.launch.derive_master_port as a bash arithmetic expansion (the torchrun launcher needs it in bash)."""
    return (
        f"$(( {PORT_BASE} + (SLURM_JOB_ID * {PORT_SLOTS} + ${{SLURM_RESTART_COUNT:-0}} % {PORT_SLOTS}) % {PORT_SPAN} ))"
    )


def _env_lines(request: SlurmRequest) -> list[str]:
    env: dict[str, str | None] = dict(DEFAULT_ENV)
    env.update(request.env)
    lines = ["# ---- NCCL / network knobs: the one place to tune the fabric ----"]
    for key, value in env.items():
        if value is None:
            lines.append(f"unset {key}")
        else:
            lines.append(f"export {key}={_q(value)}")
    for key, value, alias in SOFT_ENV:
        if key not in env:  # SlurmRequest.env names it: set or unset above, as asked
            lines.append(f'[[ -n "${{{key}:-}}${{{alias}:-}}" ]] || export {key}={_q(value)}')
    for key, hint in FABRIC_HINTS:
        if key not in env:
            lines.append(f"# export {key}=...   # {hint}")
    lines.append(
        "# export MEGAGATE_DIST_TIMEOUT_MINUTES=30   # the collectives' timeout (default 30: outlasts a checkpoint save)"
    )
    return lines


def _sbatch_lines(request: SlurmRequest, launcher: str, array: str | None) -> list[str]:
    out = "%x-%A_%a.out" if array else "%x-%j.out"
    opts = [
        f"--job-name={request.job_name}",
        f"--nodes={request.nodes}",
        f"--ntasks-per-node={request.ranks_per_node if launcher == 'srun' else 1}",
    ]
    if request.gpus_per_node:
        opts.append(f"--gpus-per-node={request.gpus_per_node}")
    if request.cpus_per_task:
        cpus = request.cpus_per_task * (request.ranks_per_node if launcher == "torchrun" else 1)
        opts.append(f"--cpus-per-task={cpus}")
    opts.append(f"--time={request.time}")
    for name in ("partition", "account", "qos"):
        value = getattr(request, name)
        if value:
            opts.append(f"--{name}={value}")
    if array:
        opts.append(f"--array={array}")
    opts += [
        f"--output={request.log_dir}/{out}",
        # A requeued job appends to the same log instead of truncating the earlier attempts.
        "--open-mode=append",
        # Warn the batch shell (B:) before the limit; it forwards the signal to the step (see the trap below).
        f"--signal=B:USR1@{request.signal_lead_s}",
        "--requeue",
    ]
    lines = [f"#SBATCH {o}" for o in opts]
    for line in request.extra_sbatch:
        line = line.strip()
        lines.append(line if line.startswith("#SBATCH") else f"#SBATCH {line}")
    return lines


def _software_lines(request: SlurmRequest) -> tuple[list[str], str]:
    """Lines that set up the software environment, and the python executable the step runs."""
    python = request.python
    lines = ["# ---- software environment ----"]
    if request.container_image:
        lines.append(f"# container (pyxis/enroot): {request.container_image}; the step runs inside it")
        if request.venv:
            python = f"{request.venv.rstrip('/')}/bin/python"
    elif request.venv:
        lines.append(
            f"source {_q(request.venv.rstrip('/') + '/bin/activate')} || {{ echo 'megagate-slurm: cannot activate venv {request.venv}' >&2; exit 1; }}"
        )
    else:
        lines.append("# (the python on PATH at submission; set venv or container_image to choose one)")
    return lines, python


def _container_flags(request: SlurmRequest) -> list[str]:
    if not request.container_image:
        return []
    flags = [f"--container-image={_q(request.container_image)}"]
    if request.container_mounts:
        flags.append(f"--container-mounts={_q(','.join(request.container_mounts))}")
    if request.container_workdir:
        flags.append(f"--container-workdir={_q(request.container_workdir)}")
    return flags


def _sweep_lines(sweep: Sequence[Sequence[str]] | None) -> list[str]:
    if not sweep:
        return ["SWEEP_ARGS=()"]
    lines = ["# ---- sweep: this array task's overrides ----", 'case "${SLURM_ARRAY_TASK_ID:-0}" in']
    for i, overrides in enumerate(sweep):
        lines.append(f"    {i}) SWEEP_ARGS=({' '.join(_q(o) for o in overrides)}) ;;")
    lines.append('    *) echo "megagate-slurm: no sweep entry for array task ${SLURM_ARRAY_TASK_ID:-}" >&2; exit 1 ;;')
    lines.append("esac")
    return lines


def _step_command(request: SlurmRequest, train_argv: Sequence[str], launcher: str, python: str) -> tuple[str, str]:
    """The srun line (without the trailing '&') and the signal the shell forwards to it."""
    srun = ["srun", "--kill-on-bad-exit=1", *_container_flags(request)]
    argv = " ".join(_q(a) for a in train_argv) + ' "${SWEEP_ARGS[@]}"'
    if request.cpus_per_task:
        # Since Slurm 22.05 srun no longer inherits the job's --cpus-per-task: repeat it on the step.
        per_task = request.cpus_per_task * (request.ranks_per_node if launcher == "torchrun" else 1)
        srun.append(f"--cpus-per-task={per_task}")
    if launcher == "srun":
        # One task per rank; megagate.distributed.launch reads SLURM_PROCID/SLURM_LOCALID/... in each.
        srun += [f"--ntasks-per-node={request.ranks_per_node}"]
        return f"{' '.join(srun)} {_q(python)} {argv}", "USR1"
    # One torchrun per node; torchrun forwards TERM (not USR1) to its workers, so the shell sends TERM.
    srun += ["--ntasks-per-node=1"]
    torchrun = [
        _q(python),
        "-m",
        "torch.distributed.run",
        '--nnodes="$SLURM_JOB_NUM_NODES"',
        f"--nproc-per-node={request.ranks_per_node}",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
        '--rdzv-id="$SLURM_JOB_ID"',
        "--max-restarts=0",
    ]
    return f"{' '.join(srun)} {' '.join(torchrun)} {argv}", "TERM"


def render_batch_script(
    request: SlurmRequest,
    train_argv: Sequence[str],
    launcher: str = "srun",
    *,
    sweep: Sequence[Sequence[str]] | None = None,
    header: str | None = None,
) -> str:
    """A complete sbatch script running `python <train_argv>` on every rank with the requeue protocol.

    `train_argv` follows the interpreter, e.g. ``["-m", "megagate", "train", "--config", "c.yaml"]``.
    `sweep`: one override list per array task (the array spec defaults to ``0-(len-1)``).
    """
    if launcher not in LAUNCHERS:
        raise ConfigError(f"launcher {launcher!r} is not supported: use one of {', '.join(LAUNCHERS)}")
    if not train_argv:
        raise ConfigError("train_argv is empty: give the program the ranks run, e.g. -m megagate train --config C")
    array = request.array
    if sweep is not None:
        if not sweep:
            raise ConfigError("sweep is empty: give one override list per array task")
        array = array or f"0-{len(sweep) - 1}"
    software, python = _software_lines(request)
    step, forward = _step_command(request, train_argv, launcher, python)

    lines = ["#!/bin/bash"]
    lines += _sbatch_lines(request, launcher, array)
    lines.append(f"# Rendered by megagate.slurm (launcher: {launcher}); re-render rather than edit.")
    if header:
        lines += [f"# {h}" for h in header.splitlines()]
    lines += [
        "",
        "set -uo pipefail   # not -e: the requeue protocol below inspects the step's failure itself",
        "",
        "# ---- run settings ----",
        f"export MEGAGATE_RUN_DIR={_q(request.resolved_run_dir)}",
        f"MEGAGATE_MAX_RESTARTS={request.max_restarts}",
        f"MEGAGATE_MAX_SAME_FAILURES={request.max_same_failures}",
        f"MEGAGATE_EXCLUDE_AFTER_HANGS={request.exclude_after_hangs}",
        "",
    ]
    lines += _env_lines(request)
    lines += [""] + software + [""]
    lines += [
        "# ---- rendezvous ----",
        "# Launcher variables leaked from the submitting shell would override the ones srun/torchrun set.",
        "unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT",
    ]
    port = bash_master_port_expr()
    if request.master_addr:
        lines.append(f"export MASTER_ADDR={_q(request.master_addr)}")
    elif launcher == "torchrun":
        lines.append('export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)')
    else:
        lines.append(
            "# srun: each rank takes MASTER_ADDR = first host of SLURM_JOB_NODELIST (megagate.distributed.launch)"
        )
    if launcher == "torchrun":
        lines.append(f"export MASTER_PORT={port}   # = megagate.distributed.launch.derive_master_port")
    else:
        lines.append(
            "# srun: each rank derives MASTER_PORT from SLURM_JOB_ID and SLURM_RESTART_COUNT (megagate.distributed.launch)"
        )
    lines.append("")
    lines += _sweep_lines(sweep)
    return "\n".join(lines) + "\n" + requeue_protocol(launcher, step, forward, request.progress_file)
