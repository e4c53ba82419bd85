"""Muon (megatron-core 0.19's `TensorParallelMuon`, from NVIDIA's emerging-optimizers) on megagate's fused attention.

Muon orthogonalises each weight matrix's momentum. A fused `linear_qkv` is several matrices stacked by rows, so
megatron splits it before orthogonalising (`muon_split_qkv`): it views the gradient per query group and splits each
group's rows by `qkv_split_shapes`, then orthogonalises the q rows of all groups as one matrix, the k rows as
another, and so on. megatron derives those shapes from the *model's* config ([q, k, v], or [q, gate, k, v] with
`attention_output_gate`), which is not megagate's layout for most gates: its G1 gate is switched on per attention
module, and G1 headwise, G2–G4 fuse other rows ([q | q-side gate | k | v | kv-side gate] per group, widths hn or 1).
With a row count that happens to divide, megatron would split at the wrong rows without a word.

`tag_fused_qkv` therefore sets, after megatron built its optimizer, every attention module's own segment sizes (from
its `QkvLayout`, the layout the forward splits by) on its linear_qkv weight *and* on the optimizer's fp32 copy of it
(`main_param`, which megatron's mixed-precision optimizer creates without those attributes): the optimizer reads
them at every step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def split_shapes(attention: torch.nn.Module) -> list[int]:
    """The rows of one query group of this attention module's fused linear_qkv, segment by segment."""
    return [rows for _, rows in attention.qkv_layout.group_segments()]


def tag_fused_qkv(model_chunks: Iterable[torch.nn.Module]) -> int:
    """Give every gated attention's linear_qkv weight (and its optimizer copy) its own Muon split; returns how many
    weights were tagged. Call after `get_megatron_optimizer` (which sets megatron's guess first)."""
    from megagate.model.attention import GatedSelfAttention

    tagged = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            if not isinstance(module, GatedSelfAttention):
                continue
            weight = module.linear_qkv.weight
            shapes = split_shapes(module)
            for target in (weight, getattr(weight, "main_param", None)):
                if target is not None:
                    target.is_qkv = True
                    target.qkv_split_shapes = list(shapes)
            tagged += 1
    return tagged


def muon_config_kwargs(t: Any) -> dict[str, Any]:
    """megatron OptimizerConfig fields for `train.optimizer: muon` (TrainSection `t`)."""
    return dict(
        optimizer="muon",
        muon_momentum=t.muon_momentum,
        muon_split_qkv=True,
        muon_tp_mode=t.muon_tp_mode,
        muon_num_ns_steps=t.muon_ns_steps,
        muon_fp32_matmul_prec=t.muon_matmul_precision,
        muon_scalar_optimizer="adam",  # embeddings, norms, gate vectors: AdamW with train.adam_*
    )
