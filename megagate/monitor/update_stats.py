"""Per-layer relative update size, a spike precursor: RMS(update) / RMS(weights) = ||p_after - p_before|| / ||p_before||
over each transformer layer's parameters (the RMS ratio: the element counts cancel), and over the rest of the model
(embedding, output layer, final norm) as `other`. Large runs watch it per layer because it rises before loss spikes
(the update of Adam is ~lr-sized per element whatever the gradient, so the ratio says how fast a layer's weights turn).

Measured from the weights themselves, before and after one optimizer step: whatever the optimizer (Adam's
moments, weight decay, clipping, a skipped update = 0). A snapshot costs one copy of this rank's parameters, kept
from pre_optim_step to post_step of the measured step only.

Parallelism: sums of squares per layer, indexed by the global layer number, are summed over the model-parallel
group (TP x PP): a tensor-parallel parameter's shards add up; a parameter every TP rank holds whole (norms, biases
of row-parallel layers) counts once (TP rank 0's). Data-parallel replicas hold identical weights after the step, so
no DP reduction. With megatron DDP's `overlap_param_gather` the weights are gathered during the next forward, not
by the step: `supported` says so and the caller does not measure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

OTHER = "other"


def supported(chunks: Sequence[torch.nn.Module]) -> bool:
    """False under DDP's overlap_param_gather (the weights after the step are not gathered yet)."""
    return not any(getattr(getattr(c, "ddp_config", None), "overlap_param_gather", False) for c in chunks)


def layer_map(chunks: Sequence[torch.nn.Module]) -> dict[int, int]:
    """id(parameter) -> global 0-based layer (-1 for parameters outside the decoder layers)."""
    from megagate.monitor.diagnostics import _decoder_layers

    out: dict[int, int] = {}
    for chunk in chunks:
        for layer in _decoder_layers(chunk):
            index = int(layer.layer_number) - 1
            for p in layer.parameters():
                out[id(p)] = index
        for p in chunk.parameters():
            out.setdefault(id(p), -1)
    return out


class UpdateRatio:
    """`snapshot(chunks)` before the optimizer step, `measure(chunks)` after it: layer -> ||update|| / ||weights||."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._before: dict[int, torch.Tensor] | None = None

    def snapshot(self, chunks: Sequence[torch.nn.Module]) -> None:
        self._before = {id(p): p.detach().clone() for c in chunks for p in c.parameters()}

    def measure(self, chunks: Sequence[torch.nn.Module], group: Any = None, tp_rank: int = 0) -> dict[str, float]:
        """{"0": ratio, ..., "other": ratio}: the global layers' ratios (a layer without weights is left out)."""
        if self._before is None:
            raise RuntimeError("UpdateRatio.measure without a snapshot")
        layers = layer_map(chunks)
        sums = torch.zeros(self.num_layers + 1, 2, dtype=torch.float64)  # [update², weights²]; row -1: other
        for chunk in chunks:
            for p in chunk.parameters():
                if tp_rank and not getattr(p, "tensor_model_parallel", False):
                    continue  # replicated over TP: counted on TP rank 0 only
                before = self._before[id(p)]
                row = layers[id(p)]
                sums[row, 0] += float((p.detach().double() - before.double()).square().sum())
                sums[row, 1] += float(before.double().square().sum())
        self._before = None
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(sums, group=group)
        names = [str(i) for i in range(self.num_layers)] + [OTHER]
        return {n: math.sqrt(u / w) for n, (u, w) in zip(names, sums.tolist()) if w > 0}


def model_parallel_group() -> tuple[Any, int]:
    """(megatron's model-parallel group or None for one rank, this rank's TP rank); (None, 0) without megatron."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None, 0
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 0
    group = parallel_state.get_model_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    return (group if dist.get_world_size(group) > 1 else None), tp_rank
