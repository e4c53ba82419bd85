"""Run a function in several processes joined by a gloo process group (real torch.distributed, no mocks)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch


def _entry(rank: int, fn: Callable, world_size: int, out_dir: str, args: tuple, backend: str = "gloo") -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings

    warnings.filterwarnings("ignore")
    from megagate.distributed import parallel

    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    parallel.init_distributed(rank, world_size, os.path.join(out_dir, "rendezvous"), backend=backend)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"result_{rank}.pt"))
    finally:
        parallel.destroy()


def run(fn: Callable, world_size: int, tmp_path: pathlib.Path, *args: Any, backend: str = "gloo") -> list[Any]:
    """Call fn(rank, world_size, *args) in `world_size` spawned processes (process group `backend`: gloo, or nccl
    with one GPU per rank); return each rank's result."""
    torch.multiprocessing.spawn(
        _entry, args=(fn, world_size, str(tmp_path), args, backend), nprocs=world_size, join=True
    )
    return [torch.load(tmp_path / f"result_{r}.pt", weights_only=False) for r in range(world_size)]
