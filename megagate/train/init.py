"""Layout-independent weight initialisation: the same seed gives the same full model for any TP / PP / EP sizes.

Each parameter's *full* tensor is drawn from a generator seeded by (seed, its global name) — the name with the
global layer number and the global expert index — and every rank keeps its own shard. Runs with different
parallel layouts therefore start from identical weights, so their loss curves can be compared step by step, and a
checkpoint written under one layout means the same model under another.

Rules follow megatron's initialisation: normal(0, σ) for weights, σ/√(2L) for the output projections of each
sublayer (`linear_proj`, `linear_fc2`), ones for norm weights, zeros for biases and input-independent gates.
"""

from __future__ import annotations

import math
import re
import zlib

import torch

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"^(.*local_experts\.)(\d+)(\..*)$")


def _global_name(name: str, chunk: torch.nn.Module, expert_offset: int) -> str:
    if name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
        return "embedding.word_embeddings.weight"  # the last stage's copy of a tied embedding (PP > 1)
    match = _LAYER.match(name)
    if match:
        layer = chunk.decoder.layers[int(match.group(2))]
        name = f"{match.group(1)}{layer.layer_number - 1}{match.group(3)}"
    match = _EXPERT.match(name)
    if match:
        name = f"{match.group(1)}{int(match.group(2)) + expert_offset}{match.group(3)}"
    return name


def _full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        shape[param.partition_dim] *= tp_size
    return tuple(shape)


def _shard(full: torch.Tensor, name: str, param: torch.Tensor, rank: int, size: int, glu: bool) -> torch.Tensor:
    """This rank's part of a full tensor, following megatron's tensor-parallel attributes."""
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    if glu and name.endswith("linear_fc1.weight"):  # SwiGLU fc1 = [gate; up], each sharded separately
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]])
    return full.chunk(size, dim=param.partition_dim)[rank]


def _value(name: str, shape: tuple[int, ...], seed: int, std: float, num_layers: int) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("bias", "gate_param"):
        return torch.zeros(shape)
    if len(shape) == 1 or leaf == "sdpa_norm_weight":  # norm weights
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    scale = std / math.sqrt(2.0 * num_layers) if re.search(r"(linear_proj|linear_fc2)\.weight$", name) else std
    return torch.randn(shape, generator=generator) * scale


@torch.no_grad()
def initialize(model_chunks: list[torch.nn.Module], seed: int, std: float, num_layers: int, glu: bool = True) -> int:
    """Overwrite every parameter with its layout-independent value; returns the number of tensors set."""
    from megatron.core import parallel_state

    tp = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    etp = (parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size())
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    count = 0
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            expert_offset = 0
            if ".local_experts." in name:
                local = len(chunk.decoder.layers[int(_LAYER.match(name).group(2))].mlp.experts.local_experts)
                expert_offset = ep_rank * local
            # expert weights are sharded over the expert-tensor-parallel group, the others over TP
            rank, size = etp if ".experts." in name else tp
            global_name = _global_name(name, chunk, expert_offset)
            full = _value(global_name, _full_shape(param, size), seed, std, num_layers)
            param.copy_(_shard(full, name, param, rank, size, glu).to(param.dtype))
            count += 1
    return count
