"""Rank helpers that work with or without a process group (OLMo-core's rule: one process is rank 0 of 1).

Every helper is a collective when a process group exists (each rank must call it) and a local no-op otherwise, so
the same code runs under torchrun, under srun and in a plain single-process tool. Layer 0: torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def is_distributed() -> bool:
    """True inside an initialised torch.distributed process group."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in `group` (default: the world); 0 without a process group."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Any = None) -> int:
    """The number of ranks in `group` (default: the world); 1 without a process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def is_global_rank0() -> bool:
    """True on global rank 0 (and in a process without a process group)."""
    return get_rank() == 0


def barrier(group: Any = None) -> None:
    """Wait for every rank of `group`; nothing to wait for without a process group."""
    if is_distributed():
        dist.barrier(group)


def gather_objects[T](obj: T) -> list[T]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object[T](obj: T, src: int = 0) -> T:
    """Rank `src`'s `obj` (picklable) on every rank."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def rank0_first[T](fn: Callable[[], T]) -> T:
    """`fn()` on global rank 0 first (it may build cached files the others then read), then on the other ranks."""
    if is_global_rank0():
        result = fn()
    barrier()
    if not is_global_rank0():
        result = fn()
    return result
