"""The gate layout matrix: one attention layer per (gate preset, head layout, backend, dtype, TP size), run forward
and backward on the same weights, against the fp64 plain-torch reference (helpers.reference) and, for G1
elementwise, against megatron-core's own `attention_output_gate` layer built with the same core attention.

Head layouts share 8 query heads of width 8 (hidden 32) and differ in their KV groups, so under TP 2 they cover
every case megatron distinguishes: groups > TP (MHA 8, GQA 4), groups = TP (GQA 2), groups < TP (MQA 1).

Backends are the shapes a layer takes:
    local       megatron's local spec, megatron's DotProductAttention (the [b, np, sq, sk] softmax)
    sdpa        megatron's local spec, megagate's SDPA core attention (the default on CPU and without TE)
    fused-norm  TE's layer shape in torch: the input norm inside linear_qkv (NormColumnParallelLinear), SDPA
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import build_module

from helpers import reference
from megagate.model import gate as gates
from megagate.model import qkv_layout as layout
from megagate.model.build import transformer_config
from megagate.model.core_attention import SDPACoreAttention
from megagate.model.fused_norm import NormColumnParallelLinear, fuse_input_norm
from megagate.model.model_config import ParallelConfig
from megagate.model.presets import model_preset
from megagate.model.spec import gated_layer_spec

HEADS, HEAD_DIM, HIDDEN, SEQ, BATCH = 8, 8, 32, 6, 2
LAYOUTS = {"mha": 8, "gqa4": 4, "gqa2": 2, "mqa": 1}  # KV groups of the 8 query heads
BACKENDS = ("local", "sdpa", "fused-norm")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Gates that are no preset but whose code path no preset takes: a truncated gate input (input_fraction) at every
# position and sharing (the preset g1-input-half covers G1 head-specific only).
EXTRA_GATES: dict[str, dict[str, Any]] = {
    # (G4/G3 headwise would be cancelled by the QK RMSNorm that follows: a gradient of ~0 compares to nothing)
    "g4-elementwise-input-half": {"position": "g4", "input_fraction": 0.5},
    "g2-headwise-input-quarter": {"position": "g2", "granularity": "headwise", "input_fraction": 0.25},
    "g1-head-shared-input-half": {"sharing": "head_shared", "input_fraction": 0.5},
    "g5-input-half": {"position": "g5", "input_fraction": 0.5},
}
# the attention-level presets (a sandwich norm changes the layer's residual adds, not the attention; gate.init only
# changes the starting weights, which every cell here replaces: tests/model/test_gate_practice.py checks it)
VARIANTS = [
    name
    for name, fields in gates.PRESETS.items()
    if not fields.get("sandwich_norm") and fields.get("init", "normal") == "normal"
]

MATRIX = [*VARIANTS, *EXTRA_GATES]  # every cell's gate


def gate_of(variant: str) -> gates.GateConfig:
    """The GateConfig of a preset or of one of EXTRA_GATES."""
    if variant in EXTRA_GATES:
        return gates.GateConfig(**EXTRA_GATES[variant])
    return gates.preset(variant)


MEGATRON_GATE = "g1-elementwise"  # what megatron's attention_output_gate computes
# Tolerances against the fp64 reference, relative to the largest |value| of the compared tensor (measured on this
# matrix, see docs/gate_variants.md "What G1 equals"): fp32 rounding, and bf16's 8-bit mantissa through a dozen
# rounded ops. A wrong head, group or gate row moves values by O(1) of the scale.
TOLERANCE = {"fp32": 2e-6, "bf16": 4e-2}
NORM_W = "linear_qkv.layer_norm_weight"


def model_for(variant: str, groups: int):
    return model_preset(
        "tiny",
        gate=gate_of(variant),
        num_attention_heads=HEADS,
        num_query_groups=groups,
        head_dim=HEAD_DIM,
        hidden_size=HIDDEN,
    )


def _core(backend: str) -> type:
    return DotProductAttention if backend == "local" else SDPACoreAttention


def build_ours(variant: str, groups: int, backend: str, dtype: torch.dtype, tp: int = 1):
    model = model_for(variant, groups)
    config = transformer_config(model, ParallelConfig(tensor_model_parallel_size=tp), params_dtype=dtype)
    spec = gated_layer_spec(config, model.gate, tp_size=tp, core_attention="local" if backend == "local" else "sdpa")
    if backend == "fused-norm":
        spec = fuse_input_norm(spec)
    return build_module(spec.submodules.self_attention, config=config, layer_number=1), model, config


def build_megatron(groups: int, backend: str, dtype: torch.dtype, tp: int = 1):
    """megatron-core's own gated attention (`attention_output_gate=True`), with the same core attention and the same
    linear_qkv shape as ours for `backend`."""
    model = model_for(MEGATRON_GATE, groups)
    config = transformer_config(model, ParallelConfig(tensor_model_parallel_size=tp), params_dtype=dtype)
    config = dataclasses.replace(config, attention_output_gate=True)
    attention = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm").submodules.self_attention
    attention.submodules.core_attention = _core(backend)
    if backend == "fused-norm":
        attention.submodules.linear_qkv = NormColumnParallelLinear
    return build_module(attention, config=config, layer_number=1)


def reference_weights(variant: str, groups: int, backend: str, seed: int = 7) -> dict[str, torch.Tensor]:
    """fp64 leaf weights of the reference (plus the fused norm's weight for the fused-norm backend)."""
    w = reference.make_weights(gate_of(variant), HIDDEN, HEADS, groups, HEAD_DIM, seed=seed)
    if backend == "fused-norm":
        gen = torch.Generator().manual_seed(seed + 1)
        w["ln"] = (1 + 0.3 * torch.randn(HIDDEN, generator=gen, dtype=torch.float64)).requires_grad_()
    return w


def full_params(w: dict[str, torch.Tensor], variant: str, groups: int) -> dict[str, torch.Tensor]:
    """The module's parameter dict (full, unsharded) for reference weights."""
    params = reference.module_params(w, gate_of(variant), HEADS, groups)
    if "ln" in w:
        params[NORM_W] = w["ln"]
    return params


def inputs(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = 1.5 * torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64) + 0.3
    return x, torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)


def reference_run(variant: str, groups: int, backend: str, eps: float) -> dict[str, Any]:
    """fp64 output, input gradient and the gradient of every module parameter (full), named as the module."""
    w = reference_weights(variant, groups, backend)
    x, grad = inputs()
    x = x.clone().requires_grad_()
    h = x
    if "ln" in w:  # the fused norm of TE's layer shape, in front of the attention
        h = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w["ln"]
    out = reference.attention(h, w, gate_of(variant), HEADS, groups, eps)
    out.backward(grad)
    params = full_params(w, variant, groups)
    # module_params fuses q/k/v/gate rows with torch.cat (differentiable): the fused gradient is the cat of grads
    fused = reference.fuse_qkv({k: v.grad for k, v in w.items() if v.grad is not None}, gate_of(variant), HEADS, groups)
    grads = {}
    for name, p in params.items():
        if name == "linear_qkv.weight":
            grads[name] = fused
        elif name == "gate_weight":  # the per-head gate projection, reshaped from w["g"] (heads in order)
            grads[name] = w["g"].grad.reshape(p.shape)
        else:
            source = {id(v): v for v in w.values()}[id(p)]
            grads[name] = source.grad
    return {"out": out.detach(), "dx": x.grad, "grads": grads, "params": {k: v.detach() for k, v in params.items()}}


def shard(name: str, full: torch.Tensor, param: torch.nn.Parameter, rank: int, tp: int) -> torch.Tensor:
    """This TP rank's part of a full tensor, by megatron's parameter attributes."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(tp, dim=param.partition_dim)[rank]


def run_module(module, params: dict[str, torch.Tensor], x: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype):
    """Load params (cast to dtype), run forward and backward on x (cast): output, input gradient, parameter grads."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(params[name].to(dtype))
            p.grad = None
    x = x.detach().to(dtype).requires_grad_()
    out, bias = module(x, None)
    assert bias is None
    out.backward(grad.to(dtype))
    return out.detach(), x.grad, {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def worst(ours: torch.Tensor, expected: torch.Tensor) -> float:
    """max |ours - expected| relative to max(1e-3, max |expected|)."""
    scale = max(1e-3, expected.abs().max().item())
    return (ours.double() - expected.double()).abs().max().item() / scale


def megatron_params(ours: dict[str, torch.Tensor], groups: int, tp: int) -> dict[str, torch.Tensor]:
    """Our full G1-elementwise parameters in megatron's row layout (identical for this gate: a tested identity)."""
    theirs = dict(ours)
    theirs["linear_qkv.weight"] = layout.to_megatron_output_gate(ours["linear_qkv.weight"], HEADS, groups, HEAD_DIM)
    return theirs


def _expected_grad(name: str, param, grads: dict[str, torch.Tensor], group, rank: int, tp: int, ours: torch.Tensor):
    """(our gradient as megatron's optimizer sees it, the reference's part of it)."""
    if tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
        # each rank normalises its own heads: megatron sums these over TP (finalize_model_grads, qk_layernorm)
        ours = ours.clone()
        torch.distributed.all_reduce(ours, group=group)
    return ours, shard(name, grads[name], param, rank, tp)


def compare_cell(variant: str, groups: int, backend: str, dtype_name: str, ref: dict[str, Any], tp: int = 1):
    """Worst relative error of (output, input grad, each param grad) of our layer against the fp64 reference, and,
    for G1 elementwise, the largest |ours - megatron| with the same core attention (None elsewhere)."""
    from megatron.core import parallel_state

    dtype = DTYPES[dtype_name]
    rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    module, _, _ = build_ours(variant, groups, backend, dtype, tp)
    named = dict(module.named_parameters())
    local = {n: shard(n, ref["params"][n], p, rank, tp) for n, p in named.items()}
    x, grad = inputs()
    out, dx, grads = run_module(module, local, x, grad, dtype)
    errors = {"out": worst(out, ref["out"]), "dx": worst(dx, ref["dx"])}
    for name, p in named.items():
        got, expected = _expected_grad(name, p, ref["grads"], group, rank, tp, grads[name])
        errors[name] = worst(got, expected)
    exact = None
    if variant == MEGATRON_GATE:
        theirs = build_megatron(groups, backend, dtype, tp)
        their_full = megatron_params(ref["params"], groups, tp)
        their_named = dict(theirs.named_parameters())
        t_out, t_dx, t_grads = run_module(
            theirs, {n: shard(n, their_full[n], p, rank, tp) for n, p in their_named.items()}, x, grad, dtype
        )
        # the same rows in the same order (the G1-elementwise layouts coincide), so the shards compare directly
        diffs = [(out - t_out).abs().max(), (dx - t_dx).abs().max()]
        diffs += [(grads[n] - t_grads[n]).abs().max() for n in grads]
        exact = max(d.item() for d in diffs)
    return errors, exact


def tolerance(dtype_name: str, tensor: str) -> float:
    """The bound a cell's relative error must stay under (measured maxima in docs/gate_variants.md)."""
    if dtype_name == "fp32":
        return 3e-6
    if "layernorm" in tensor and "linear_qkv" not in tensor:
        return 8e-2  # q/k norm weights: a sum over every token and head of bf16 products (measured <= 4.6e-2)
    return 3e-2 if tensor in ("out", "dx") else 4e-2  # measured <= 1.4e-2 and <= 2.1e-2


def refused_under_tp(variant: str, groups: int, tp: int) -> bool:
    """Cells megagate refuses (megatron has no such gate): a gate row per KV group fused into linear_qkv when fewer
    groups than TP ranks share it — the group's row count (npg·hn + 2·hn + 1, headwise) is odd, so TP cannot split
    the projection evenly, which megatron's replicated-group path requires; and a truncated-input G2/G3 gate, whose
    own per-KV-group projection rows TP cannot split when ranks share a group."""
    gate = gate_of(variant)
    if groups < tp and gate.on_kv_heads and gate.sharing == "head_specific" and not gate.fused_rows:
        return True  # a parameter per KV group (gate_weight of a truncated-input gate) cannot follow a shared group
    return groups < tp and gate.on_kv_heads and gate.fused_rows and gate.granularity == "headwise"


def matrix_worker(rank: int, world: int, variants: list[str]) -> dict[Any, Any]:
    """Every TP-2 cell in one process pair: per cell its errors, or the refusal's message."""
    from megatron.core import parallel_state

    from megagate.distributed.parallel import initialize_model_parallel
    from megagate.errors import ConfigError

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=world), seed=5)
    results: dict[Any, Any] = {}
    try:
        for variant in variants:
            for lay, groups in LAYOUTS.items():
                for backend in BACKENDS:
                    ref = reference_run(variant, groups, backend, 1e-6)
                    for dtype_name in DTYPES:
                        try:
                            results[(variant, lay, backend, dtype_name)] = compare_cell(
                                variant, groups, backend, dtype_name, ref, tp=world
                            )
                        except ConfigError as exc:
                            results[(variant, lay, backend, dtype_name)] = str(exc)
    finally:
        parallel_state.destroy_model_parallel()
    return results
