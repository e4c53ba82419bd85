"""The optimizer update of a step from megatron's own pieces, with the gradient norm computed once.

megatron's `optimizer.step()` prepares the gradients, computes their global norm, clips by it and updates. The
trainer needs the norm before the update (callbacks judge the step by it), so it runs the two halves itself:

    found_inf, norm = prepare(optimizer)   prepare_grads() and get_grad_norm(): one norm, one reduction
    ... callbacks decide ...
    applied = apply(optimizer, norm)       clip_grad_by_total_norm_fp32 by that norm, step_with_ready_grads()

which is ChainedOptimizer.step without its second norm. With Transformer Engine's multi-tensor kernels the norm
stays a device tensor (no host synchronisation); without them megatron returns a float. Parameters in one of
megatron's separate gradient-norm groups (multi-token prediction) take megatron's whole step instead.

Two copies of the DistributedOptimizer that move nothing are dropped where megatron's own switches or a checked
aliasing allow it:
  * `skip_single_rank_gathers`: at data-parallel size 1, the parameter all-gather after every update, which on a
    one-rank group copies the buffer onto itself (megatron's `_defer_param_sync` switch, the one its chained
    optimizer uses to postpone the same gather);
  * `skip_self_copies`: with float32 parameters the optimizer's main shards are views of the model's parameter
    buffer, so "copy main params to model params" copies every shard onto itself; where every shard is checked to
    be the very memory it would be copied to, the copy is skipped (checked again after every checkpoint load).
"""

from __future__ import annotations

from typing import Any

import torch


def _parts(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _active(optimizer: Any) -> bool:
    return not getattr(optimizer, "is_stub_optimizer", False) and bool(optimizer.get_parameters())


def has_separate_norm_groups(optimizer: Any) -> bool:
    """True when some parameter is clipped by its own group's norm (megatron's multi-token prediction)."""
    from megatron.core.optimizer.optimizer import _get_param_grad_norm_group

    return any(_get_param_grad_norm_group(p) is not None for part in _parts(optimizer) for p in part.get_parameters())


def has_loss_scaler(optimizer: Any) -> bool:
    """True when the optimizer scales the loss (fp16, or a loss scale set): its scale_loss is not a product by 1."""
    return any(getattr(part, "grad_scaler", None) is not None for part in _parts(optimizer))


@torch.no_grad()
def prepare(optimizer: Any) -> tuple[bool, torch.Tensor | float]:
    """(non-finite gradients found by a loss scaler, the global gradient norm before clipping)."""
    found_inf = bool(optimizer.prepare_grads())
    return found_inf, optimizer.get_grad_norm()


def _use_decoupled_grad(part: Any) -> bool:
    params = part.get_parameters()
    cfg = part.config
    return cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or (
        cfg.use_precision_aware_optimizer and bool(params) and getattr(params[0], "__fsdp_param__", False)
    )


@torch.no_grad()
def apply(optimizer: Any, grad_norm: torch.Tensor | float) -> bool:
    """Clip the prepared gradients by `grad_norm` and update; True when the update was applied."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for part in _parts(optimizer):
        if _active(part) and part.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(
                part.get_parameters(),
                max_norm=part.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=_use_decoupled_grad(part),
            )
    return bool(optimizer.step_with_ready_grads())


class OptimizerStep:
    """A run's optimizer update in two halves (`prepare`, then `apply`), megatron's whole step where it must."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.whole_step = has_separate_norm_groups(optimizer)

    def prepare(self) -> tuple[bool, torch.Tensor | float]:
        return prepare(self.optimizer)

    def apply(self, grad_norm: torch.Tensor | float) -> bool:
        if self.whole_step:
            applied, _, _ = self.optimizer.step()  # prepares and measures again, clipping each group by its norm
            return bool(applied)
        return apply(self.optimizer, grad_norm)


def skip_single_rank_gathers(optimizer: Any, ddp: list) -> bool:
    """At data-parallel size 1, stop the DistributedOptimizer's after-update parameter all-gather (a one-rank
    collective: the updated shard is the whole buffer already). True when it was stopped."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    groups = [g for chunk in ddp for g in (*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups)]
    # (megatron sets the instance size only with the DistributedOptimizer: without it there is no gather to stop)
    if not groups or any(getattr(g, "intra_distributed_optimizer_instance_size", None) != 1 for g in groups):
        return False
    for chunk in ddp:
        cfg = chunk.ddp_config
        # quantized parameters are re-cast after the gather; an overlapped gather runs in the forward's hooks
        if cfg.overlap_param_gather or cfg.fp8_param_gather or cfg.fp4_param_gather:
            return False
        if cfg.reuse_grad_buf_for_mxfp8_param_ag or cfg.use_megatron_fsdp:
            return False
    parts = [p for p in _parts(optimizer) if isinstance(p, DistributedOptimizer)]
    for part in parts:
        part._defer_param_sync = True
    return bool(parts)


def _self_copy_targets(part: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(main shard, the buffer range megatron copies it to) of every float32 parameter; None where megatron's
    copy does more than copy float32 shards (half-precision or quantized parameters, FSDP, precision-aware)."""
    cfg, ddp = part.config, part.ddp_config
    if getattr(part, "is_stub_optimizer", False) or cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        return None
    if ddp.use_megatron_fsdp or ddp.fp8_param_gather or ddp.fp4_param_gather or cfg.reuse_grad_buf_for_mxfp8_param_ag:
        return None
    if any(group for group in part.model_float16_groups):
        return None
    pairs = []
    for shard_group, model_group in zip(part.shard_fp32_groups, part.model_fp32_groups):
        for shard, param in zip(shard_group, model_group):
            world = part._get_model_param_range_map(param)["gbuf_world_in_bucket"]
            gbuf, _, bucket = part.model_param_gbuf_map[param]
            target = part.buffers[gbuf].buckets[bucket].param_data.view(-1)[world.start : world.end]
            pairs.append((shard, target))
    return pairs


def skip_self_copies(optimizer: Any) -> int:
    """Skip the main-to-model parameter copy of each DistributedOptimizer whose float32 shards all alias their
    targets (same address, size and dtype); give the copy back to one where they no longer do. The number of
    optimizers whose copy is skipped."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    skipped = 0
    for part in _parts(optimizer):
        if not isinstance(part, DistributedOptimizer):
            continue
        pairs = _self_copy_targets(part)
        aliased = pairs is not None and all(
            a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype for a, b in pairs
        )
        if aliased:
            part._copy_main_params_to_model_params = _no_copy  # the instance's: megatron's method stays for others
            skipped += 1
        elif "_copy_main_params_to_model_params" in vars(part):
            del part._copy_main_params_to_model_params
    return skipped


def _no_copy() -> None:
    """Every main shard is the model's own memory: nothing to copy."""
