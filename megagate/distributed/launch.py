"""Resolve the distributed environment of this process (torchrun or srun) and start the process group.

Two launchers are supported and nothing else is guessed:
- torchrun sets RANK, WORLD_SIZE, LOCAL_RANK (+ LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT);
- `srun` (one task per GPU) sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_JOB_NODELIST;
  MASTER_ADDR is the first host of the node list and MASTER_PORT is derived from the job id unless they are set.
torchrun wins when both are present (torchrun inside an allocation also sees SLURM_PROCID = the node index).

Starting the process group also fixes three cluster defaults: the CUDA device of this rank under any Slurm GPU
binding (`cuda_device_index`), the collectives' timeout (`distributed_timeout_minutes`, long enough for a checkpoint
save) and the CUDA caching allocator's expandable segments (`set_allocator_defaults`).
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from megagate.errors import MegagateError

# MASTER_PORT derived from the Slurm job id: PORT_BASE + (job_id * PORT_SLOTS + restart % PORT_SLOTS) % PORT_SPAN.
# The restart count moves a requeued job to a fresh port so a socket of the previous attempt cannot collide.
# slurm/render.py emits the same formula in bash for the torchrun launcher (tests check they agree).
PORT_BASE = 20000
PORT_SPAN = 40000
PORT_SLOTS = 4
DEFAULT_PORT = 29500

# The timeout of every collective (torch's own default is 10 minutes for the world group). Ranks that finished their
# share of a checkpoint save wait at a barrier for the slowest writer: 15A2B's ~210 GB (bf16 weights + fp32 Adam)
# written at a degraded shared file system's 0.2 GB/s takes ~18 minutes. 30 minutes is also megatron-core's default
# for the groups it creates, so every group of the job times out alike; a real hang still ends the job within 30.
TIMEOUT_ENV = "MEGAGATE_DIST_TIMEOUT_MINUTES"
DEFAULT_TIMEOUT_MINUTES = 30.0
# Expandable segments let the caching allocator grow a segment instead of fragmenting memory across many (MoE and
# variable-length batches allocate many differently sized blocks); the user's own setting always wins.
ALLOC_ENV, ALLOC_DEFAULT = "PYTORCH_ALLOC_CONF", "expandable_segments:True"


class LaunchError(MegagateError):
    """The launcher's environment is incomplete or inconsistent."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job: ranks, nodes and the rendezvous address."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "srun" or "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list, e.g. ``node[1-3,7],gpu-a[01-02]`` -> node1 node2 node3 node7 gpu-a01 gpu-a02.

    Zero padding follows the range's first number; several bracket groups in one name (``r[1-2]n[01-02]``) expand
    to their product in Slurm's order.
    """
    text = nodelist.strip()
    if not text:
        raise LaunchError("empty Slurm node list: SLURM_JOB_NODELIST must name at least one host")
    hosts: list[str] = []
    for item in _split_top_level(text, nodelist):
        hosts.extend(_expand_host(item, nodelist))
    return hosts


def _split_top_level(text: str, whole: str) -> list[str]:
    # Commas separate hosts only outside brackets: "a[1,3],b" -> ["a[1,3]", "b"].
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LaunchError(f"bad Slurm node list {whole!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"bad Slurm node list {whole!r}: unmatched ']' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise LaunchError(f"bad Slurm node list {whole!r}: unclosed '['")
    items.append(text[start:])
    for item in items:
        if not item.strip():
            raise LaunchError(f"bad Slurm node list {whole!r}: empty host name between commas")
    return [item.strip() for item in items]


_GROUP = re.compile(r"\[([^\]]*)\]")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_host(item: str, whole: str) -> list[str]:
    match = _GROUP.search(item)
    if match is None:
        if any(c in item for c in "[] \t"):
            raise LaunchError(f"bad Slurm node list {whole!r}: bad host name {item!r}")
        return [item]
    prefix, suffix = item[: match.start()], item[match.end() :]
    tails = _expand_host(suffix, whole) if suffix else [""]
    out = []
    for number in _expand_ranges(match.group(1), whole):
        out.extend(prefix + number + tail for tail in tails)
    return out


def _expand_ranges(spec: str, whole: str) -> list[str]:
    numbers: list[str] = []
    for part in spec.split(","):
        m = _RANGE.match(part.strip())
        if m is None:
            raise LaunchError(f"bad Slurm node list {whole!r}: range {part!r} is not N or N-M")
        lo_text, hi_text = m.group(1), m.group(2)
        lo, hi = int(lo_text), int(hi_text if hi_text is not None else lo_text)
        if hi < lo:
            raise LaunchError(f"bad Slurm node list {whole!r}: range {part!r} runs backwards")
        width = len(lo_text)  # "01-10" pads to 2 digits, "1-10" does not
        numbers.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return numbers


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's SLURM_TASKS_PER_NODE form, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise LaunchError(f"bad SLURM_TASKS_PER_NODE {spec!r}: expected forms like '4' or '2(x3),1'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def derive_master_port(job_id: int, restart_count: int = 0) -> int:
    """The rendezvous port for a Slurm job: deterministic on every node, different after a requeue."""
    return PORT_BASE + (job_id * PORT_SLOTS + restart_count % PORT_SLOTS) % PORT_SPAN


def _int(env: Mapping[str, str], name: str, source: str) -> int:
    value = env.get(name)
    if value is None or value.strip() == "":
        raise LaunchError(f"{source} environment is incomplete: {name} is not set")
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{source} environment: {name}={value!r} is not an integer") from None


def _check_ranks(env: DistEnv) -> DistEnv:
    name = env.source
    if env.world_size < 1:
        raise LaunchError(f"{name} environment: world size {env.world_size} must be >= 1")
    if not 0 <= env.rank < env.world_size:
        raise LaunchError(f"{name} environment: rank {env.rank} is outside 0..{env.world_size - 1}")
    if not 0 <= env.local_rank < env.local_world_size:
        raise LaunchError(f"{name} environment: local rank {env.local_rank} is outside 0..{env.local_world_size - 1}")
    if not 0 <= env.node_rank < env.num_nodes:
        raise LaunchError(f"{name} environment: node rank {env.node_rank} is outside 0..{env.num_nodes - 1}")
    if not 0 < env.master_port < 65536:
        raise LaunchError(f"{name} environment: MASTER_PORT={env.master_port} is not a TCP port (1..65535)")
    return env


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    src = "torchrun"
    world = _int(env, "WORLD_SIZE", src)
    local_world = _int(env, "LOCAL_WORLD_SIZE", src) if "LOCAL_WORLD_SIZE" in env else world
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        raise LaunchError("torchrun environment is incomplete: MASTER_ADDR is not set")
    if world % local_world:
        raise LaunchError(
            f"torchrun environment: WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}"
        )
    return _check_ranks(
        DistEnv(
            rank=_int(env, "RANK", src),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", src),
            local_world_size=local_world,
            node_rank=_int(env, "GROUP_RANK", src) if "GROUP_RANK" in env else 0,
            num_nodes=world // local_world,
            master_addr=addr,
            master_port=_int(env, "MASTER_PORT", src),
            source=src,
        )
    )


def _from_srun(env: Mapping[str, str]) -> DistEnv:
    src = "srun"
    # SLURM_STEP_NUM_TASKS is the step's size; SLURM_NTASKS is the job's (srun sets both to the step's).
    world = _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS", src)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError("srun environment is incomplete: SLURM_JOB_NODELIST is not set")
    hosts = expand_nodelist(nodelist)
    node_rank = _int(env, "SLURM_NODEID", src) if "SLURM_NODEID" in env else 0
    tasks_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    per_node = parse_tasks_per_node(tasks_spec) if tasks_spec else [world // len(hosts)] * len(hosts)
    if sum(per_node) != world:
        raise LaunchError(
            f"srun environment is inconsistent: tasks per node {tasks_spec!r} sum to {sum(per_node)}, "
            f"but the step has {world} tasks"
        )
    if len(per_node) != len(hosts):
        raise LaunchError(
            f"srun environment is inconsistent: node list {nodelist!r} has {len(hosts)} hosts "
            f"but tasks per node {tasks_spec!r} names {len(per_node)}"
        )
    if not 0 <= node_rank < len(hosts):
        raise LaunchError(f"srun environment: SLURM_NODEID={node_rank} is outside 0..{len(hosts) - 1}")
    addr = env.get("MASTER_ADDR", "").strip() or hosts[0]
    if env.get("MASTER_PORT", "").strip():
        port = _int(env, "MASTER_PORT", src)
    else:
        job_id = _int(env, "SLURM_JOB_ID", src)
        port = derive_master_port(job_id, int(env.get("SLURM_RESTART_COUNT", "0") or 0))
    return _check_ranks(
        DistEnv(
            rank=_int(env, "SLURM_PROCID", src),
            world_size=world,
            local_rank=_int(env, "SLURM_LOCALID", src),
            local_world_size=per_node[node_rank],
            node_rank=node_rank,
            num_nodes=len(hosts),
            master_addr=addr,
            master_port=port,
            source=src,
        )
    )


def resolve_env(environ: Mapping[str, str] | None = None, *, allow_single: bool = True) -> DistEnv:
    """The distributed environment from torchrun's or srun's variables (a single process when neither is set)."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env or "LOCAL_RANK" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return _from_srun(env)
    if "SLURM_PROCID" in env and "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        # Inside an allocation but not inside a step (e.g. the batch script ran python directly): refuse rather
        # than have every such process claim rank 0 of N and hang.
        raise LaunchError(
            f"SLURM_NTASKS={env['SLURM_NTASKS']} but this process is not an srun task (no SLURM_STEP_ID): "
            "launch with srun or torchrun"
        )
    if not allow_single:
        raise LaunchError("no launcher environment: set RANK/WORLD_SIZE/LOCAL_RANK (torchrun) or run under srun")
    return DistEnv(
        0, 1, 0, 1, 0, 1, env.get("MASTER_ADDR") or "127.0.0.1", int(env.get("MASTER_PORT") or DEFAULT_PORT), "single"
    )


def export_env(dist: DistEnv, environ: dict[str, str] | None = None) -> None:
    """Write the torchrun-style variables (RANK, LOCAL_RANK, ...) so libraries that read them agree with us."""
    env = os.environ if environ is None else environ
    env.update(
        RANK=str(dist.rank),
        WORLD_SIZE=str(dist.world_size),
        LOCAL_RANK=str(dist.local_rank),
        LOCAL_WORLD_SIZE=str(dist.local_world_size),
        MASTER_ADDR=dist.master_addr,
        MASTER_PORT=str(dist.master_port),
    )


def distributed_timeout_minutes(environ: Mapping[str, str] | None = None) -> float:
    """The collectives' timeout in minutes: MEGAGATE_DIST_TIMEOUT_MINUTES, else 30 (see DEFAULT_TIMEOUT_MINUTES)."""
    env = os.environ if environ is None else environ
    text = env.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_MINUTES
    try:
        minutes = float(text)
    except ValueError:
        minutes = float("nan")
    if not minutes > 0 or minutes == float("inf"):
        raise LaunchError(f"{TIMEOUT_ENV}={text!r} must be a positive number of minutes (default 30)")
    return minutes


def set_allocator_defaults(environ: dict[str, str] | None = None) -> None:
    """PYTORCH_ALLOC_CONF=expandable_segments:True unless the user set it (or the older PYTORCH_CUDA_ALLOC_CONF, which
    torch 2.9 still reads but warns about at exit);
    it takes effect only when set before CUDA initialises, so this runs before any CUDA call of the launch."""
    env = os.environ if environ is None else environ
    if ALLOC_ENV not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        env[ALLOC_ENV] = ALLOC_DEFAULT


def visible_devices(environ: Mapping[str, str], count: int) -> list[str]:
    """The ids of the `count` CUDA devices this process sees (CUDA_VISIBLE_DEVICES' entries, else 0..count-1)."""
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return [str(i) for i in range(count)]
    ids = [part.strip() for part in spec.split(",") if part.strip()]
    return ids[:count]  # CUDA stops at the first invalid entry; device_count() is the truth


def gpus_per_task(environ: Mapping[str, str]) -> int | None:
    """SLURM_GPUS_PER_TASK as a count ("2", "a100:2", "gpu:a100:2"), when srun was given --gpus-per-task."""
    match = re.search(r"(\d+)\s*$", environ.get("SLURM_GPUS_PER_TASK", ""))
    return int(match.group(1)) if match else None


def cuda_device_index(local_rank: int, local_world_size: int, visible: list[str], own_gpus: int | None = None) -> int:
    """This rank's CUDA device index among the `visible` ones, under any GPU binding of its tasks.

    `own_gpus`: GPUs bound to each task (srun --gpus-per-task, `gpus_per_task()`), None when not per task.
    - one visible GPU (srun --gpus-per-task=1, --gpu-bind=single:1, a per-task CUDA_VISIBLE_DEVICES): device 0;
    - exactly the task's own GPUs (--gpus-per-task=N, bound): device 0, which no other task sees;
    - at least one GPU per task on the node (no binding, torchrun): the local rank;
    - fewer GPUs than tasks, several each (e.g. --gpu-bind=closest: the GPUs of a task's socket, shared by the
      socket's tasks): the GPU numbered by the local rank, which no other task of the node picks.
    Anything else cannot give each task its own GPU: a one-line LaunchError.
    """
    shown = f"CUDA_VISIBLE_DEVICES={','.join(visible)}" if visible else "no CUDA device is visible"
    if not visible:
        raise LaunchError(f"local rank {local_rank} has no GPU: {shown}")
    if len(visible) == 1 or (own_gpus is not None and len(visible) == own_gpus):
        return 0
    if len(visible) >= local_world_size:
        return local_rank
    if str(local_rank) in visible:
        return visible.index(str(local_rank))
    raise LaunchError(
        f"local rank {local_rank} of {local_world_size} sees {len(visible)} GPUs ({shown}), none of them GPU "
        f"{local_rank}: bind one GPU per task (srun --gpus-per-task=1 or --gpu-bind=single:1) or show every task all "
        "of the node's GPUs"
    )


def init_process_group(
    backend: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
) -> DistEnv:
    """Resolve the environment and start torch.distributed: nccl when CUDA is available, else gloo.

    With nccl this rank's CUDA device is set first (`cuda_device_index`, one process per GPU). `timeout_s` defaults
    to `distributed_timeout_minutes()`.
    """
    if environ is None:
        set_allocator_defaults()  # before the first CUDA call below
    import torch
    import torch.distributed as dist

    env = resolve_env(environ)
    if timeout_s is None:
        timeout_s = 60.0 * distributed_timeout_minutes(environ)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise LaunchError(f"backend {backend!r} is not supported: use 'nccl' (CUDA) or 'gloo' (CPU)")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise LaunchError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False: use 'gloo'")
        source = os.environ if environ is None else environ
        visible = visible_devices(source, torch.cuda.device_count())
        own = gpus_per_task(source) if env.source == "srun" else None
        torch.cuda.set_device(cuda_device_index(env.local_rank, env.local_world_size, visible, own))
    if environ is None:
        export_env(env)
    if not dist.is_initialized():
        from megagate import console

        if backend == "gloo":
            console.install_cpu()
        with console.native_stdout_filtered():  # gloo prints a line per process group it creates
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{_bracket(env.master_addr)}:{env.master_port}",
                rank=env.rank,
                world_size=env.world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
    return env


def _bracket(addr: str) -> str:
    # IPv6 literals need brackets inside a URL.
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
