"""The optimizer update of a step from megatron's own pieces, with the gradient norm computed once.

megatron's `optimizer.step()` prepares the gradients, computes their global norm, clips by it and updates. The
trainer needs the norm before the update (callbacks judge the step by it), so it runs the two halves itself:

    found_inf, norm = prepare(optimizer)   prepare_grads() and get_grad_norm(): one norm, one reduction
    ... callbacks decide ...
    applied = apply(optimizer, norm)       clip_grad_by_total_norm_fp32 by that norm, step_with_ready_grads()

which is ChainedOptimizer.step without its second norm. With Transformer Engine's multi-tensor kernels the norm
stays a device tensor (no host synchronisation); without them megatron returns a float. Parameters in one of
megatron's separate gradient-norm groups (multi-token prediction) take megatron's whole step instead.

`skip_single_rank_gathers` drops, at data-parallel size 1, the parameter all-gather a DistributedOptimizer issues
after every update: on a one-rank group it copies the buffer onto itself (megatron's `_defer_param_sync` switch,
the one its chained optimizer uses to postpone the same gather).
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
    if not groups or any(g.intra_distributed_optimizer_instance_size != 1 for g in groups):
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
