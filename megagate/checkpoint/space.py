"""How big the next checkpoint will be, and a refusal in one line when the disk cannot hold it (before a byte is
written): the previous checkpoint's size from its manifest, else the model's parameters plus Adam's state."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from megagate.checkpoint.manifest import read_manifest
from megagate.checkpoint.naming import complete_checkpoints, latest
from megagate.distributed.utils import broadcast_object, get_rank, is_distributed
from megagate.errors import MegagateError

SPACE_MARGIN, SPACE_SLACK = 1.05, 1 << 20  # a save needs estimate * margin + slack bytes free
ADAM_BYTES_PER_PARAM = 12  # fp32 main parameter + two fp32 moments, saved by the fully/dp-reshardable formats


def tensor_estimate(model_bytes: int, model_params: int, with_optimizer: bool) -> int:
    """Expected checkpoint bytes from the model's parameters (global: summed over model-parallel shards)."""
    return model_bytes + (ADAM_BYTES_PER_PARAM * model_params if with_optimizer else 0)


def _local_parameters(model_chunks: list) -> tuple[int, int]:
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    return sum(p.numel() * p.element_size() for p in params), sum(p.numel() for p in params)


def _data_parallel_size() -> int:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    return 1


def estimate_bytes(root: Path, model_chunks: list, optimizer: Any) -> tuple[int, str]:
    """(expected bytes of the next checkpoint under `root`, where the number comes from): the previous checkpoint's
    size from its manifest, else the model's parameters (plus Adam's state) summed over the job. Collective."""
    model_bytes, params = _local_parameters(model_chunks)
    totals = torch.tensor([model_bytes, params], dtype=torch.float64)
    if is_distributed():
        torch.distributed.all_reduce(totals)
    dp = _data_parallel_size()  # data-parallel replicas hold the same parameters
    estimate = tensor_estimate(int(totals[0]) // dp, int(totals[1]) // dp, optimizer is not None)
    source = "from the model and optimizer tensors"
    previous = latest(root)
    if previous is not None:
        try:
            manifest = read_manifest(previous)
            estimate = int(manifest.get("total_bytes") or sum(r["size"] for r in manifest["files"].values()))
            source = f"the size of {previous.name}"
        except MegagateError:
            pass
    return estimate, source


def check_free_space(root: Path, final: Path, model_chunks: list, optimizer: Any) -> None:
    """Refuse (on every rank, one line) a save of `final` that the disk under `root` cannot hold. Collective."""
    estimate, source = estimate_bytes(root, model_chunks, optimizer)
    message = None
    if get_rank() == 0:
        probe = root
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        needed = int(estimate * SPACE_MARGIN) + SPACE_SLACK
        if free < needed:
            kept = len(complete_checkpoints(root))
            hint = f"; the {kept} kept checkpoint(s) stay until it is written" if kept else ""
            message = (
                f"not enough free space for checkpoint {final}: it needs about {needed:,} bytes ({source}, "
                f"+5% and 1 MiB), {free:,} are free on {probe}{hint}"
            )
    message = broadcast_object(message)
    if message:
        raise MegagateError(message)
