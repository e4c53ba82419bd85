"""The language-model loss of a tensor-parallel group of one rank, without megatron's vocab-parallel collectives.

megatron's `vocab_parallel_cross_entropy` reduces the logits' maximum, the target logit and the softmax sum over
the tensor-parallel group: three all-reduces per micro-batch, each a real collective call even on a one-rank group.
With one rank the whole vocabulary is local and the loss is torch's cross-entropy of the same float32 logits: the
same values and gradients (softmax minus the one-hot target), computed by torch's fused kernel.
`use_local_cross_entropy` installs it as the model's `compute_language_model_loss` where megatron would run the
unfused vocab-parallel path (TP = 1, no cross-entropy fusion); megatron's fused kernels are left as they are.
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
    """Give a megatron GPTModel the local loss when its tensor-parallel group has one rank and megatron would take
    its unfused vocab-parallel path; True when installed."""
    group = getattr(model, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(group) != 1 or model.config.cross_entropy_loss_fusion:
        return False
    model.compute_language_model_loss = local_cross_entropy  # the instance's, in place of megatron's method
    return True
