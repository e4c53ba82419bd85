"""Checkpoints with megatron's dist_checkpointing: model, optimizer, scheduler, data position, RNG, step.

Layout under the checkpoint root:

    iter_0000040/            a complete checkpoint (dist_checkpointing files + megagate.json + rng_<rank>.pt)
    .iter_0000060.tmp/       a save in progress (or killed): never loaded, removed by the next save

A save writes everything into the temporary folder, then rank 0 renames it to its final name after a barrier, so
a crash during a save never damages the last good checkpoint and `latest()` only ever sees complete ones. The
model is saved through megatron's sharded state dicts and the optimizer in the `fully_reshardable` format by
default, so a run can resume with different TP/PP sizes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megagate.distributed import megatron_cpu
from megagate.errors import MegagateError

_NAME = re.compile(r"^iter_(\d{7})$")
META = "megagate.json"


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and (entry / META).is_file() and (entry / "metadata.json").is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under root, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def read_meta(path: str | os.PathLike) -> dict:
    """The megagate metadata of a checkpoint (step, consumed samples, scheduler, layout, config, ...)."""
    meta = Path(path) / META
    try:
        return json.loads(meta.read_text())
    except (OSError, ValueError) as exc:
        raise MegagateError(f"checkpoint {str(path)!r} has no readable {META}: {exc}") from None


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def rng_state() -> dict[str, Any]:
    """This rank's random number generator states (CPU, CUDA, numpy, python, megatron's model-parallel tracker)."""
    from megatron.core import tensor_parallel

    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _model_state(model_chunks: list) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def _sharded_state(model_chunks: list, optimizer: Any, optimizer_format: str, is_loading: bool) -> dict:
    state = _model_state(model_chunks)
    if optimizer is not None:
        # the chunks' dicts stay separate (their keys repeat, with different layer offsets); megatron finds the
        # parameters in the nested dict
        model_sd = dict(state)
        metadata = {"distrib_optim_sharding_type": optimizer_format}
        if not torch.cuda.is_available():
            # without CUDA, gather the fully-reshardable optimizer state over gloo onto DP rank 0
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return state


def _materialize_optimizer_state(optimizer: Any) -> None:
    # A fresh optimizer has no per-parameter state, and megatron's DistributedOptimizer (with torch's Adam, i.e.
    # without TE/apex) reads the Adam step from it while building the state dict to load into. megatron's own
    # helper fills it with placeholder values that the load then overwrites, as it does for FSDP checkpoints.
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and not inner.state and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()


class Checkpointer:
    """Atomic save / latest-good load / keep-last-K for one run's checkpoint root (collective calls)."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, optimizer_format: str = "fully_reshardable"):
        self.root = Path(root)
        self.keep_last = keep_last
        self.optimizer_format = optimizer_format

    def save(self, step: int, model_chunks: list, optimizer: Any, meta: dict) -> Path:
        """Save a checkpoint for `step`; returns its final path. Every rank must call it."""
        from megatron.core import dist_checkpointing

        final = self.root / checkpoint_name(step)
        tmp = self.root / f".{checkpoint_name(step)}.tmp"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".iter_*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        state = _sharded_state(model_chunks, optimizer, self.optimizer_format, is_loading=False)
        dist_checkpointing.save(state, str(tmp))
        torch.save(rng_state(), tmp / f"rng_{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            (tmp / META).write_text(json.dumps({**meta, "step": step}, indent=1, default=str))
            if final.exists():  # a re-save of the same step (e.g. stop request right after an interval save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        for _, path in complete_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path, model_chunks: list, optimizer: Any, same_layout: bool) -> dict:
        """Load model (and optimizer) state from `path`; RNG only if the parallel layout is unchanged."""
        from megatron.core import dist_checkpointing

        meta = read_meta(path)
        if optimizer is not None:
            _materialize_optimizer_state(optimizer)
        state = _sharded_state(model_chunks, optimizer, meta.get("optimizer_format", self.optimizer_format), True)
        loaded = dist_checkpointing.load(state, str(path))
        for i, chunk in enumerate(model_chunks):
            chunk.load_state_dict(loaded["model" if len(model_chunks) == 1 else f"model{i}"])
        if optimizer is not None:
            # fp32 main parameters are views of the model parameters: copy into them without autograd
            with torch.no_grad():
                optimizer.load_state_dict(loaded["optimizer"])
            megatron_cpu.unshare_adam_steps(optimizer)
        rng_file = path / f"rng_{_rank()}.pt"
        if same_layout and rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))
        return meta
