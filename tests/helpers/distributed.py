"""Run a function in several processes joined by a gloo process group (real torch.distributed, no mocks).

The processes are forked from helpers.forked's preloaded server (torch and megatron-core already imported), not
spawned as fresh interpreters: each rank is still its own process with its own process group and megatron state.
"""

from __future__ import annotations

import os
import pathlib
import traceback
from collections.abc import Callable
from typing import Any

import torch

from helpers import forked


def _entry(rank: int, fn: Callable, world_size: int, out_dir: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings

    warnings.filterwarnings("ignore")
    from megagate.distributed import parallel

    try:
        parallel.init_distributed(rank, world_size, os.path.join(out_dir, "rendezvous"), backend="gloo")
        try:
            result = fn(rank, world_size, *args)
            torch.save(result, os.path.join(out_dir, f"result_{rank}.pt"))
        finally:
            parallel.destroy()
    except BaseException:
        with open(os.path.join(out_dir, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run(fn: Callable, world_size: int, tmp_path: pathlib.Path, *args: Any, timeout: float = 1800) -> list[Any]:
    """Call fn(rank, world_size, *args) in `world_size` processes; return each rank's result (a rank's exception
    fails the caller with that rank's traceback)."""
    procs = forked.start(_entry, [(rank, fn, world_size, str(tmp_path), args) for rank in range(world_size)])
    codes = forked.join_all(procs, timeout)
    errors = [
        f"rank {rank} (exit code {code}):\n" + _read(tmp_path / f"error_{rank}.txt")
        for rank, code in enumerate(codes)
        if code != 0
    ]
    assert not errors, f"{fn.__name__} failed in {len(errors)} of {world_size} processes:\n" + "\n".join(errors)
    return [torch.load(tmp_path / f"result_{r}.pt", weights_only=False) for r in range(world_size)]


def _read(path: pathlib.Path) -> str:
    return path.read_text() if path.exists() else "(no traceback: killed, or it ran past the timeout)\n"
