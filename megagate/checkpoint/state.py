"""The sharded state dicts a checkpoint holds (model chunks, optimizer in the requested format) and megatron's
optimizer quirks around them: dp-reshardable padding zeroed (identical runs write identical bytes), a fresh
optimizer's state materialised before a load, the format a save really wrote."""

from __future__ import annotations

from typing import Any

import torch


def model_state(model_chunks: list) -> dict:
    """The chunks' sharded state dicts under "model" (one chunk) or "model0", "model1", ... (virtual stages)."""
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def sharded_state(model_chunks: list, optimizer: Any, optimizer_format: str, is_loading: bool) -> dict:
    """What dist_checkpointing saves or loads: the model chunks and (unless None) the optimizer in `optimizer_format`."""
    state = model_state(model_chunks)
    if optimizer is not None:
        # the chunks' dicts stay separate (their keys repeat, with different layer offsets); megatron finds the
        # parameters in the nested dict
        model_sd = dict(state)
        metadata = {"distrib_optim_sharding_type": optimizer_format}
        if not torch.cuda.is_available():
            # without CUDA, gather the fully-reshardable optimizer state over gloo onto DP rank 0
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
        if not is_loading:
            _zero_dp_reshardable_padding(state["optimizer"])
    return state


def _zero_dp_reshardable_padding(sharded: Any) -> None:
    """Zero the padding between parameters in dp-reshardable optimizer buckets, in place.

    megatron fills that padding with `torch.empty`, so two identical runs wrote different bytes (seen: 1.7e38 in
    exp_avg) and checkpoints could not be compared or deduplicated; the values are never read back as state."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(sharded, dict):
        flag = sharded.get("padding")
        if isinstance(flag, LocalNonpersistentObject) and flag.unwrap() is True:
            for value in sharded.values():
                if isinstance(value, ShardedTensor):
                    value.data.zero_()
            return
        for value in sharded.values():
            _zero_dp_reshardable_padding(value)
    elif isinstance(sharded, list):
        for value in sharded:
            _zero_dp_reshardable_padding(value)


def saved_optimizer_format(optimizer: Any, requested: str) -> str:
    """The format the optimizer state of a save is in (recorded in the checkpoint's metadata, read on resume).

    Only megatron's DistributedOptimizer has a DP-bucket layout (`dp_reshardable`); the plain optimizer's state is
    per parameter, sharded like the model, and a checkpoint without optimizer state constrains nothing: both are
    recorded as `fully_reshardable`, so a later resume under another layout is not refused for a format they lack.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if optimizer is None:
        return "fully_reshardable"
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return requested if any(isinstance(opt, DistributedOptimizer) for opt in parts) else "fully_reshardable"


def materialize_optimizer_state(optimizer: Any) -> None:
    """Give a fresh optimizer placeholder state to load into (megatron's own helper)."""
    # A fresh optimizer has no per-parameter state, and megatron's DistributedOptimizer (with torch's Adam, i.e.
    # without TE/apex) reads the Adam step from it while building the state dict to load into. megatron's own
    # helper fills it with placeholder values that the load then overwrites, as it does for FSDP checkpoints.
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and not inner.state and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()
