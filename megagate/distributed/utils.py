"""The distributed runtime's small helpers, all usable with or without a process group (OLMo-core's
`distributed/utils.py`; its rule: one process is rank 0 of 1).

- this process in the job: `host_name`, `launcher_rank` / `launcher_world_size` (the launcher's variables, read
  before a process group exists), `is_launched`, `single_process_port` (a free rendezvous port when nothing
  launched us), `free_port`, `die_with_parent`;
- the rank helpers: a collective when a process group exists (each rank must call it) and a local no-op otherwise,
  so the same code runs under torchrun, under srun and in a plain single-process tool.

Layer 0: the standard library and torch only; torch is imported at the first rank helper's call, not with the
module, because the trainer's spawned children import this module to run their initializer
(megagate.distributed.children).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# any of these means a launcher (torchrun, srun) or the user chose the rendezvous: leave MASTER_PORT alone
_LAUNCHED = ("RANK", "SLURM_PROCID", "MASTER_PORT")


def host_name() -> str:
    """The node's name as the scheduler knows it (Slurm's SLURMD_NODENAME), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank from the launcher's variables (torchrun's RANK, else srun's SLURM_PROCID; 0)."""
    env = os.environ if environ is None else environ
    return int(env.get("RANK", env.get("SLURM_PROCID", "0")))


def launcher_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The job's process count from the launcher's variables (WORLD_SIZE, else SLURM_NTASKS; 1)."""
    env = os.environ if environ is None else environ
    return int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))


def is_launched(environ: Mapping[str, str] | None = None) -> bool:
    """True when a launcher (or the user) set the rank or the rendezvous port."""
    env = os.environ if environ is None else environ
    return any(v in env for v in _LAUNCHED)


def single_process_port() -> None:
    """Outside a launcher, point MASTER_PORT at a free port: one process needs a rendezvous, not a fixed port that
    another job on the host may hold."""
    if not is_launched():
        os.environ["MASTER_PORT"] = str(free_port())


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send this process `sig` when its parent dies; send it now if the parent is already gone.

    Linux only (elsewhere a no-op). The parent check closes the race of a parent that died before the prctl call
    (this process would then already be reparented, and the death signal would never come).
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not fatal: the child still works, it just may outlive a killed parent
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def is_distributed() -> bool:
    """True inside an initialised torch.distributed process group."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in `group` (default: the world); 0 without a process group."""
    return _dist().get_rank(group) if is_distributed() else 0


def get_world_size(group: Any = None) -> int:
    """The number of ranks in `group` (default: the world); 1 without a process group."""
    return _dist().get_world_size(group) if is_distributed() else 1


def is_global_rank0() -> bool:
    """True on global rank 0 (and in a process without a process group)."""
    return get_rank() == 0


def barrier(group: Any = None) -> None:
    """Wait for every rank of `group`; nothing to wait for without a process group."""
    if is_distributed():
        _dist().barrier(group)


def gather_objects[T](obj: T) -> list[T]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    _dist().all_gather_object(out, obj)
    return out


def broadcast_object[T](obj: T, src: int = 0) -> T:
    """Rank `src`'s `obj` (picklable) on every rank."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    _dist().broadcast_object_list(box, src=src)
    return box[0]


def rank0_first[T](fn: Callable[[], T]) -> T:
    """`fn()` on global rank 0 first (it may build cached files the others then read), then on the other ranks."""
    if is_global_rank0():
        result = fn()
    barrier()
    if not is_global_rank0():
        result = fn()
    return result
