"""Qwen3-Next's Gated DeltaNet layers and shared experts <-> megagate tensors (pure reindexing, bit-identical).

A Gated DeltaNet layer (megatron's `GatedDeltaNet`, TP = 1):

    decoder.layers.N.self_attention.in_proj.weight    model.layers.N.linear_attn.in_proj_qkvz.weight and in_proj_ba
        rows [q; k; v; z; beta; alpha], each        rows per key head g: [q_g; k_g; v_g; z_g] (qkvz), [b_g; a_g] (ba),
        section head-major                          the value heads of g (r = value heads / key heads) together
    decoder.layers.N.self_attention.conv1d.weight     model.layers.N.linear_attn.conv1d.weight (channels q, k, v)
    decoder.layers.N.self_attention.{A_log,dt_bias}   model.layers.N.linear_attn.{A_log,dt_bias}
    decoder.layers.N.self_attention.out_norm.weight   model.layers.N.linear_attn.norm.weight (plain w, as in HF)
    decoder.layers.N.self_attention.out_proj.weight   model.layers.N.linear_attn.out_proj.weight

A shared expert (megatron's `SharedExpertMLP` with its gate):

    decoder.layers.N.mlp.shared_experts.linear_fc1    model.layers.N.mlp.shared_expert.{gate,up}_proj ([gate; up])
    decoder.layers.N.mlp.shared_experts.linear_fc2    model.layers.N.mlp.shared_expert.down_proj
    decoder.layers.N.mlp.shared_experts.gate_weight   model.layers.N.mlp.shared_expert_gate.weight
"""

from __future__ import annotations

import torch
from torch import Tensor

from megagate.model.model_config import ModelConfig

Shape = tuple[int, ...]
MG, HF = "self_attention.", "linear_attn."


def _sizes(model: ModelConfig) -> tuple[int, int, int, int, int]:
    """(key heads, value heads per key head, key head dim, value head dim, hidden)."""
    nk, nv = model.linear_num_key_heads, model.linear_num_value_heads
    return nk, nv // nk, model.linear_key_head_dim, model.linear_value_head_dim, model.hidden_size


def megatron_gdn_shapes(model: ModelConfig) -> dict[str, Shape]:
    """The GDN mixer's tensors in a layer (keys after `decoder.layers.N.`)."""
    nk, r, dk, dv, h = _sizes(model)
    qk, v, nv = nk * dk, nk * r * dv, nk * r
    return {
        MG + "in_proj.weight": (2 * qk + 2 * v + 2 * nv, h),
        MG + "conv1d.weight": (2 * qk + v, 1, model.linear_conv_kernel_dim),
        MG + "A_log": (nv,),
        MG + "dt_bias": (nv,),
        MG + "out_norm.weight": (dv,),
        MG + "out_proj.weight": (h, v),
    }


def gdn_direct_pairs() -> list[tuple[str, str]]:
    """(megagate, HF) keys within a layer of the GDN tensors copied unchanged."""
    names = ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight")
    return [(MG + n, HF + n) for n in names] + [(MG + "out_norm.weight", HF + "norm.weight")]


def hf_gdn_projection_shapes(model: ModelConfig) -> dict[str, Shape]:
    """HF's two input projections in a layer (keys after `model.layers.N.`)."""
    nk, r, dk, dv, h = _sizes(model)
    return {HF + "in_proj_qkvz.weight": (nk * (2 * dk + 2 * r * dv), h), HF + "in_proj_ba.weight": (nk * 2 * r, h)}


def in_proj_to_hf(model: ModelConfig, w: Tensor) -> tuple[Tensor, Tensor]:
    """megatron in_proj [q; k; v; z; b; a] -> HF (in_proj_qkvz, in_proj_ba), grouped per key head."""
    nk, r, dk, dv, h = _sizes(model)
    q, k, v, z, b, a = w.split([nk * dk, nk * dk, nk * r * dv, nk * r * dv, nk * r, nk * r], dim=0)
    qkvz = torch.cat([q.view(nk, dk, h), k.view(nk, dk, h), v.view(nk, r * dv, h), z.view(nk, r * dv, h)], dim=1)
    ba = torch.cat([b.view(nk, r, h), a.view(nk, r, h)], dim=1)
    return qkvz.reshape(-1, h).contiguous(), ba.reshape(-1, h).contiguous()


def in_proj_from_hf(model: ModelConfig, qkvz: Tensor, ba: Tensor) -> Tensor:
    """HF (in_proj_qkvz, in_proj_ba) -> megatron in_proj [q; k; v; z; b; a] (the inverse of `in_proj_to_hf`)."""
    nk, r, dk, dv, h = _sizes(model)
    q, k, v, z = qkvz.view(nk, 2 * dk + 2 * r * dv, h).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.view(nk, 2 * r, h).split([r, r], dim=1)
    return torch.cat([t.reshape(-1, h) for t in (q, k, v, z, b, a)], dim=0).contiguous()


def megatron_shared_expert_shapes(model: ModelConfig) -> dict[str, Shape]:
    """A MoE layer's shared expert tensors (keys after `decoder.layers.N.`); none without a shared expert."""
    size, h = model.moe_shared_expert_intermediate_size, model.hidden_size
    if not size:
        return {}
    shapes = {"mlp.shared_experts.linear_fc1.weight": (2 * size, h), "mlp.shared_experts.linear_fc2.weight": (h, size)}
    if model.moe_shared_expert_gate:
        shapes["mlp.shared_experts.gate_weight"] = (1, h)
    return shapes


def shared_expert_direct_pairs(model: ModelConfig) -> list[tuple[str, str]]:
    """(megagate, HF) keys within a layer of the shared expert's tensors copied unchanged."""
    if not model.moe_shared_expert_intermediate_size:
        return []
    pairs = [("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight")]
    if model.moe_shared_expert_gate:
        pairs.append(("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight"))
    return pairs
