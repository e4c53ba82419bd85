"""The language-model loss of a tensor-parallel group of one rank, without megatron's vocab-parallel collectives.

megatron's `vocab_parallel_cross_entropy` reduces the logits' maximum, the target logit and the softmax sum over
the tensor-parallel group: three all-reduces per micro-batch, each a real collective call even on a one-rank group.
With one rank the whole vocabulary is local and the loss is torch's cross-entropy of the same float32 logits: the
same values and gradients (softmax minus the one-hot target), computed by torch's fused kernel.
`use_local_cross_entropy` installs it as the model's `compute_language_model_loss` where megatron would run the
unfused vocab-parallel path (TP = 1, no cross-entropy fusion); megatron's fused kernels are left as they are.

`ZLoss` (train.z_loss_coeff, installed by `add_z_loss` over either loss) adds PaLM's z-loss: the log-sum-exp of the
logits over the whole vocabulary (`vocab_parallel_logsumexp`: across the tensor-parallel shards), squared.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def local_cross_entropy(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-token loss [b, s] of `labels` [b, s] under `logits` [s, b, v] (megatron's compute_language_model_loss)."""
    s, b, v = logits.shape
    losses = F.cross_entropy(logits.float().reshape(s * b, v), labels.t().reshape(s * b), reduction="none")
    return losses.view(s, b).t().contiguous()


def use_local_cross_entropy(model: Any) -> bool:
    """Give a megatron language model the local loss when its tensor-parallel group has one rank and megatron would take
    its unfused vocab-parallel path; True when installed."""
    group = getattr(model, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) != 1 or model.config.cross_entropy_loss_fusion:
        return False
    model.compute_language_model_loss = local_cross_entropy  # the instance's, in place of megatron's method
    return True


def vocab_parallel_logsumexp(logits: torch.Tensor, group: Any) -> torch.Tensor:
    """logsumexp over the vocabulary of `logits` [s, b, v/tp] whose vocabulary is split over `group`: [s, b] float32.

    The row maximum is all-reduced (MAX) and detached: it only shifts the exponent, so no gradient flows through
    it. The sums of exponentials are added with megatron's `reduce_from_tensor_model_parallel_region` (all-reduce
    forward, identity backward: every rank holds the same loss and back-propagates it into its own shard)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    row_max = logits.max(dim=-1).values.detach()  # [s, b]
    tp = torch.distributed.get_world_size(group) if group is not None else 1
    if tp > 1:
        torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(logits - row_max.unsqueeze(-1)).sum(dim=-1)  # [s, b]
    if tp > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, group=group)
    return row_max + torch.log(sum_exp)


class ZLoss:
    """A model's language-model loss with PaLM's z-loss (Chowdhery et al. 2022, arXiv:2204.02311, sec. 5:
    `coeff * log(Z)^2`, Z the softmax normaliser) computed beside it.

    Installed as the model's `compute_language_model_loss`, it returns the cross-entropy [b, s] exactly as the
    wrapped loss does (so the logged loss stays the cross-entropy) and keeps this forward's per-token term
    `coeff * lse^2` [b, s], with its graph, in `pending` until the trainer's loss function takes it, masks it,
    averages it and adds it to the loss it back-propagates. The log-sum-exp is taken before the cross-entropy runs
    (megatron's vocab-parallel kernel may work on the logits in place)."""

    def __init__(self, loss_fn: Any, coeff: float, group: Any) -> None:
        self.loss_fn, self.coeff, self.group = loss_fn, float(coeff), group
        self.pending: torch.Tensor | None = None

    def __call__(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        lse = vocab_parallel_logsumexp(logits, self.group)  # [s, b]
        self.pending = self.coeff * lse.square().t()  # [b, s]
        return self.loss_fn(labels, logits)

    def take(self) -> torch.Tensor | None:
        """The per-token z-loss [b, s] of the latest forward (once; None after)."""
        pending, self.pending = self.pending, None
        return pending


def add_z_loss(model: Any, coeff: float) -> ZLoss:
    """Wrap the language-model loss of a megatron HybridModel or GPTModel (last pipeline stage) in a `ZLoss` of `coeff` > 0, over
    the model's tensor-parallel group (the local cross-entropy of a one-rank group, or megatron's own)."""
    group = getattr(model, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    z_loss = ZLoss(model.compute_language_model_loss, coeff, group)
    model.compute_language_model_loss = z_loss
    model.z_loss = z_loss
    return z_loss


def z_loss_of(model: Any) -> ZLoss | None:
    """The `ZLoss` of a model chunk or of its wrappers (DDP, Float16Module: `.module`), None without one."""
    while model is not None:
        found = getattr(model, "__dict__", {}).get("z_loss")
        if found is not None:
            return found
        model = getattr(model, "module", None)
    return None
