"""MoE experts computed with torch's grouped GEMM, for the local (non-Transformer-Engine) backend.

megatron-core's local spec runs the experts as `SequentialMLP`: a Python loop of two GEMMs per local expert, which
is slow with many small experts. Its grouped alternatives need Transformer Engine (`TEGroupedMLP`) or, before 0.19,
the `grouped_gemm` package. `TorchGroupedMLP` computes all local experts with two calls of torch's grouped GEMM
(`torch.nn.functional.grouped_mm`, `torch._grouped_mm` in torch 2.9) instead.

Parameters: `TorchGroupedMLP` *is* a `SequentialMLP` (a subclass) and keeps its per-expert parameters
`local_experts.<i>.linear_fc{1,2}.weight` ([2·ffn/tp, h] and [h, ffn/tp], megatron's own `ColumnParallelLinear` /
`RowParallelLinear` holding them); only `forward` differs. So the names, shapes, order and megatron attributes
(`allreduce=False` under EP, so DDP reduces them over the expert-data-parallel group; `tensor_model_parallel`,
`partition_dim`) are exactly SequentialMLP's, and so are `sharded_state_dict` (a checkpoint of either loads into
the other, under any EP size), `state_dict()` (Hugging Face export), the planner's per-rank parameter table and the
trainer's initialisation. The cost is one `torch.stack` of the local weights per forward (and the matching split of
their gradients), a copy the size of the local expert weights — small next to the GEMMs at realistic token counts.

Experts have no communication of their own: megatron's token dispatcher gathers/scatters tokens over the EP and
expert-TP groups (`explicit_expert_comm` makes the expert linears purely local), so the grouped forward is the same
local math as SequentialMLP's per-expert `MLP.forward`: fc1, (Swi)GLU on the local [gate; up] halves, times the
routing probability, fc2.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Callable

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megagate.errors import ConfigError

logger = logging.getLogger(__name__)

_ALIGN_BYTES = 16  # torch's grouped GEMM wants every row stride a multiple of 16 bytes


def grouped_mm_function() -> Callable[..., torch.Tensor] | None:
    """torch's grouped GEMM (`F.grouped_mm` in newer torch, `torch._grouped_mm` in 2.9), or None if absent."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def _probe(device_type: str, dtype: torch.dtype) -> str | None:
    """None if grouped GEMM runs forward and backward on this device type and dtype, else why not (once each)."""
    fn = grouped_mm_function()
    if fn is None:
        return f"torch {torch.__version__} has no grouped GEMM (torch.nn.functional.grouped_mm / torch._grouped_mm)"
    try:  # with autograd on even when first asked under no_grad / inference_mode (evaluation)
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(4, 16, dtype=dtype, device=device_type, requires_grad=True)
            w = torch.ones(2, 16, 16, dtype=dtype, device=device_type, requires_grad=True)
            offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
            _ContiguousGrad.apply(fn(x, w, offs=offs)).float().sum().backward()
    except Exception as error:  # the kernel refuses this device/dtype: say which error, once
        return f"grouped GEMM fails on {device_type} {dtype}: {type(error).__name__}: {str(error).splitlines()[0]}"
    return None


def unsupported_reason(device_type: str, dtype: torch.dtype, dims: tuple[int, ...]) -> str | None:
    """Why the grouped GEMM cannot run these experts (None: it can): no kernel for the device/dtype, or a GEMM
    dimension (hidden, 2·ffn/tp, ffn/tp) whose rows are not a multiple of 16 bytes (torch's stride rule)."""
    size = torch.empty((), dtype=dtype).element_size()
    bad = [d for d in dims if (d * size) % _ALIGN_BYTES]
    if bad:
        return (
            f"grouped GEMM needs rows of a multiple of {_ALIGN_BYTES} bytes: dimension(s) {bad} x {size} bytes "
            f"({dtype}) are not; use widths divisible by {_ALIGN_BYTES // size}"
        )
    return _probe(device_type, dtype)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped GEMM's backward refuses the
    stride-0 (expanded) gradients that e.g. `.sum()` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, counts: list[int] | None):
    """[T, in] @ per-group [E, out, in]ᵀ -> [T, out]; rows of group e are offs[e-1]:offs[e].

    `counts` set: per-expert torch.mm fallback (the same math, for shapes/devices the grouped kernel refuses)."""
    if counts is not None:
        parts = torch.split(x, counts)
        return torch.cat([part @ w.t() for part, w in zip(parts, weight.unbind(0))], dim=0)
    return _ContiguousGrad.apply(grouped_mm_function()(x, weight.transpose(1, 2), offs=offs))


class TorchGroupedMLP(SequentialMLP):
    """megatron's MoE experts (SequentialMLP's parameters and checkpoint format) computed with torch's grouped GEMM.

    forward(permuted_local_hidden_states [T, h], tokens_per_expert [E_local], permuted_probs [T]) -> ([T, h], None),
    tokens sorted by local expert as megatron's token dispatcher hands them over; experts with zero tokens are fine.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules, pg_collection=None, name=None):
        for flag in ("fp8", "fp4"):
            if getattr(config, flag, None):
                raise ConfigError(
                    f"{flag} MoE experts need Transformer Engine's grouped linears (backend 'te'); torch grouped "
                    "experts run bf16/fp32 only"
                )
        if getattr(config, "delay_wgrad_compute", False):
            raise ConfigError("delay_wgrad_compute is not supported by torch grouped experts; use backend 'te'")
        if getattr(config, "use_te_activation_func", False):
            raise ConfigError("use_te_activation_func needs Transformer Engine; torch grouped experts use torch's")
        if grouped_mm_function() is None:
            raise ConfigError(
                f"moe_grouped_gemm with backend 'local' needs torch's grouped GEMM, absent in torch {torch.__version__}"
                "; set moe_grouped_gemm false"
            )
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        self._fallback_logged: set[str] = set()

    def _stacked(self, which: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[E_local, out, in] weights (and [E_local, out] biases) of linear_fc1 or linear_fc2 of every local expert."""
        linears = [getattr(expert, which) for expert in self.local_experts]
        weight = torch.stack([linear.weight for linear in linears])
        bias = getattr(linears[0], "bias", None)
        if bias is not None:
            bias = torch.stack([linear.bias for linear in linears])
        return weight, bias

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """MLP.forward's unfused activation: (Swi)GLU on the local [gate; up] halves, clamp and linear offset."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(x)
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if (val := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)

    def _fallback_counts(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, tokens_per_expert) -> list | None:
        """None: the grouped kernel runs; else the per-expert token counts for the per-expert fallback."""
        reason = unsupported_reason(x.device.type, x.dtype, (w1.shape[2], w1.shape[1], w2.shape[2]))
        if reason is None:
            return None
        if reason not in self._fallback_logged:  # say once per module why the experts are looped
            self._fallback_logged.add(reason)
            logger.warning("TorchGroupedMLP: per-expert GEMMs instead of grouped GEMM: %s", reason)
        return tokens_per_expert.tolist()

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """The local experts on their tokens (sorted by local expert), weighted by their routing probabilities."""
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: scale the input, then weight 1
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        if not torch.is_tensor(tokens_per_expert):
            tokens_per_expert = torch.tensor(tokens_per_expert)
        x = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # [T, h]
        w1, b1 = self._stacked("linear_fc1")  # [E, 2f/tp, h] (GLU) or [E, f/tp, h]
        w2, b2 = self._stacked("linear_fc2")  # [E, h, f/tp]
        counts = self._fallback_counts(x, w1, w2, tokens_per_expert)
        offs = torch.cumsum(tokens_per_expert.to(device=x.device), dim=0).to(torch.int32)  # end row of each expert
        expert_of_row = None
        if b1 is not None or b2 is not None:  # [T] local expert index of each row, for the per-expert biases
            expert_of_row = torch.repeat_interleave(
                torch.arange(len(self.local_experts), device=x.device), tokens_per_expert.to(x.device)
            )
        fc1 = _grouped_linear(x, w1, offs, counts)  # [T, 2f/tp]
        if b1 is not None:
            fc1 = fc1 + b1[expert_of_row]
        scaled = (self._activation(fc1) * probs.unsqueeze(-1)).to(fc1.dtype)  # [T, f/tp]
        out = _grouped_linear(scaled.contiguous(), w2, offs, counts)  # [T, h]: this rank's partial sum under ETP
        if b2 is not None:  # MLP adds an expert's fc2 bias weighted by the probability, not via bias-dropout-add
            out = out + b2[expert_of_row] * probs.unsqueeze(-1)
        return out.view(*hidden.shape[:-1], out.shape[-1]), None


def use_torch_grouped_experts(layer_spec: ModuleSpec, config: TransformerConfig) -> ModuleSpec:
    """`layer_spec` (a TransformerLayer spec) with megatron's SequentialMLP experts replaced by TorchGroupedMLP.

    megatron's local MoE spec is `partial(MoELayer, submodules=MoESubmodules(experts=partial(SequentialMLP, ...)))`;
    dense layers (and specs whose experts are not SequentialMLP) come back unchanged. `layer_spec` is not modified."""
    mlp = layer_spec.submodules.mlp
    moe_submodules = getattr(mlp, "keywords", {}).get("submodules") if isinstance(mlp, functools.partial) else None
    experts = getattr(moe_submodules, "experts", None)
    if not isinstance(experts, functools.partial) or experts.func is not SequentialMLP:
        return layer_spec
    del config  # the choice is the caller's (config.moe_grouped_gemm); the module reads the config when built
    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(layer_spec.submodules)
    grouped = functools.partial(TorchGroupedMLP, *experts.args, **experts.keywords)
    new_moe = dataclasses.replace(moe_submodules, experts=grouped)
    spec.submodules.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": new_moe})
    return spec
