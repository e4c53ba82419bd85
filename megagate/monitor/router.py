"""MoE router health while training: tokens per expert per MoE layer over a window of steps, dead experts, the
spread of the load imbalance across layers, and the router's entropy.

A forward hook on every megatron router (`TopKRouter`, output (probs, routing_map [tokens, experts])) adds
routing_map.sum(0) into a device tensor: no host read, nothing but a column sum per micro-batch. It counts only when
the router is in training mode with gradients enabled, megatron's own condition for its expert-bias token counts
(`TopKRouter._apply_expert_bias`): evaluation forwards do not count. The entropy of softmax(router logits), over the
experts and divided by log(experts) (1 = uniform, 0 = one expert), is measured on the micro-batches of the steps
the caller marks (`entropy_next = True`, the logging steps): the logits are recomputed from the router's input
with its own `gating`, one small [tokens, hidden] x [hidden, experts] product.

`take(group)` sums the counts over all ranks (one all-reduce over the world: each layer's TP / CP / DP / EP ranks
route disjoint tokens, and the pipeline stages that do not hold a layer add zeros) and resets the window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

ENTROPY, TOKENS = -2, -1  # the last two columns of a layer's row: entropy sum, tokens it was measured on


def routers(chunks: Sequence[torch.nn.Module]) -> list[tuple[int, torch.nn.Module]]:
    """(global 0-based layer, router) of every MoE layer in this rank's model chunks."""
    out = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if name.endswith("mlp.router") and hasattr(module, "gating"):
                out.append((int(module.layer_number) - 1, module))
    return out


class RouterCounts:
    """Tokens per expert of every MoE layer since the last `take`, and the router entropy of the marked steps."""

    def __init__(self, chunks: Sequence[torch.nn.Module], num_layers: int, num_experts: int) -> None:
        self.num_experts = num_experts
        self.entropy_next = False
        found = routers(chunks)
        device = next(iter(found))[1].weight.device if found else torch.device("cpu")
        self.layers = sorted({layer for layer, _ in found})
        self._sums = torch.zeros(num_layers, num_experts + 2, dtype=torch.float64, device=device)
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in found]

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple, output: tuple) -> None:
            if not (module.training and torch.is_grad_enabled()):
                return
            routing_map = output[1]
            row = self._sums[layer]
            row[: self.num_experts] += routing_map.sum(dim=0).to(row.dtype)
            if self.entropy_next:
                with torch.no_grad():
                    logits = module.gating(args[0].detach()).float().reshape(-1, self.num_experts)
                    logp = torch.log_softmax(logits, dim=-1)
                    entropy = -(logp.exp() * logp).sum(dim=-1) / math.log(self.num_experts)
                row[ENTROPY] += entropy.sum().to(row.dtype)
                row[TOKENS] += entropy.numel()

        return hook

    def take(self, group: Any = None) -> torch.Tensor:
        """[num_layers, experts + 2] on the CPU, summed over `group` (None: this rank only); the window restarts."""
        sums = self._sums.clone()
        self._sums.zero_()
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(sums, group=group)
        return sums.cpu()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def health(sums: torch.Tensor, layers: Sequence[int]) -> dict[str, Any]:
    """Per MoE layer: max/mean tokens per expert (1 = perfectly balanced), dead experts (0 tokens), entropy; across
    layers: the largest and the spread (population std) of max/mean, the dead experts in all layers."""
    per_layer: dict[str, dict[str, float | int | None]] = {}
    for layer in layers:
        row = sums[layer]
        counts = row[:ENTROPY]
        mean = float(counts.mean())
        measured = float(row[TOKENS])
        per_layer[str(layer)] = {
            "tokens": int(counts.sum()),
            "max_over_mean": float(counts.max()) / mean if mean > 0 else None,
            "dead": int((counts == 0).sum()),
            "entropy": float(row[ENTROPY]) / measured if measured else None,
        }
    ratios = [v["max_over_mean"] for v in per_layer.values() if v["max_over_mean"] is not None]
    mean_ratio = sum(ratios) / len(ratios) if ratios else None
    return {
        "layers": per_layer,
        "max_over_mean": max(ratios) if ratios else None,
        "spread": math.sqrt(sum((r - mean_ratio) ** 2 for r in ratios) / len(ratios)) if ratios else None,
        "dead": sum(v["dead"] for v in per_layer.values()),
    }


def scalars(stats: dict[str, Any], prefix: str = "router") -> dict[str, float]:
    """TensorBoard tags -> values of `health`'s result (None values left out)."""
    out = {f"{prefix}/{k}": float(stats[k]) for k in ("max_over_mean", "spread", "dead") if stats[k] is not None}
    for layer, values in stats["layers"].items():
        for key in ("max_over_mean", "dead", "entropy"):
            if values[key] is not None:
                out[f"{prefix}/layer_{int(layer):02d}/{key}"] = float(values[key])
    return out
