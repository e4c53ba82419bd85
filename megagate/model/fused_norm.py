"""The layer's input norm fused into `linear_qkv`, as Transformer Engine's spec fuses it, and the gate input it needs.

megatron's TE layer spec builds `linear_qkv` as `TELayerNormColumnParallelLinear` (TE's `LayerNormLinear`: norm, then
the column-parallel GEMM) and leaves `input_layernorm` an `IdentityOp`; the `hidden_states` reaching the attention
are then the raw residual. Gates that project the layer input themselves (head-shared gates, G5) must project the
*normed* input, as they do with the local spec's separate norm. `normed_input` recomputes that norm with the fused
module's own parameters (the same function, the same parameters, so their gradients add up in one place).

Why recompute rather than ask TE for its norm output: megatron's wrapper hard-codes `return_layernorm_output=False`
(megatron-core 0.19.2, extensions/transformer_engine.py), so the output cannot be requested without replacing
megatron's module; and under sequence parallelism TE returns the norm output either for this rank's chunk or
gathered, while the gate path needs it in the layout of its own projection. The norm is one elementwise pass over
[sq, b, h] (no GEMM), paid only by the gates that project the input; the fused GEMMs stay TE's.

Attributes read (TE's `LayerNormLinear` names, which `NormColumnParallelLinear` below also has, so detection is one
path): `layer_norm_weight`, `layer_norm_bias` (None for RMSNorm), `eps`, `normalization` ("RMSNorm" | "LayerNorm"),
`zero_centered_gamma` (weight applied as 1 + w).

`NormColumnParallelLinear` is the torch-native equivalent on megatron's local `ColumnParallelLinear`, and
`fuse_input_norm(layer_spec)` turns a local layer spec into the fused shape (input_layernorm -> IdentityOp,
linear_qkv -> NormColumnParallelLinear), so the fused shape runs, and is tested, without TE.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from megagate.errors import ConfigError

NORMALIZATIONS = ("RMSNorm", "LayerNorm")


def apply_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    normalization: str,
    eps: float,
    zero_centered_gamma: bool,
) -> Tensor:
    """RMSNorm / LayerNorm over the last dim of x [..., h], computed in fp32 (as TE's kernels and megagate's
    ZeroCenteredRMSNorm do) and returned in x's dtype; the weight is applied as 1 + w when zero-centred."""
    if normalization not in NORMALIZATIONS:
        raise ConfigError(f"normalization={normalization!r} is not one of {', '.join(NORMALIZATIONS)}")
    y = x.float()
    gamma = weight.float() + 1.0 if zero_centered_gamma else weight.float()
    if normalization == "RMSNorm":
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * gamma
    else:
        y = torch.nn.functional.layer_norm(y, y.shape[-1:], gamma, None if bias is None else bias.float(), eps)
    return y.to(x.dtype)


def has_fused_norm(linear: torch.nn.Module) -> bool:
    """Whether `linear` normalises its input before its GEMM (TE's LayerNormLinear, NormColumnParallelLinear)."""
    return getattr(linear, "layer_norm_weight", None) is not None


def normed_input(linear: torch.nn.Module, hidden_states: Tensor) -> Tensor:
    """The input `linear`'s GEMM sees: its fused norm of hidden_states [sq(/tp), b, h] (same parameters), or
    hidden_states itself when `linear` has no norm (the layer normalised it already)."""
    if not has_fused_norm(linear):
        return hidden_states
    return apply_norm(
        hidden_states,
        linear.layer_norm_weight,
        getattr(linear, "layer_norm_bias", None),
        normalization=linear.normalization,
        eps=linear.eps,
        zero_centered_gamma=bool(linear.zero_centered_gamma),
    )


class NormColumnParallelLinear(ColumnParallelLinear):
    """megatron's local ColumnParallelLinear with the input norm in front: `linear(norm(x))`, TE's LayerNormLinear
    in torch. The norm follows the config (normalization, layernorm_epsilon, layernorm_zero_centered_gamma), as
    TELayerNormColumnParallelLinear's does; its parameters carry TE's names (`layer_norm_weight`,
    `layer_norm_bias`), so checkpoints, megagate.model.init and megagate.interop see the TE names.

    Under sequence parallelism the input is this rank's sequence chunk: the norm is per token, so it runs on the
    chunk and ColumnParallelLinear gathers the normed tensor; the norm's gradient is then a partial sum over TP ranks,
    so its parameters are marked `sequence_parallel` for megatron to sum."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        if config.normalization not in NORMALIZATIONS:
            raise ConfigError(
                f"normalization={config.normalization!r} is not one of {', '.join(NORMALIZATIONS)} for a fused norm"
            )
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        fill = torch.zeros if self.zero_centered_gamma else torch.ones  # the identity at initialisation
        self.layer_norm_weight = torch.nn.Parameter(fill(input_size, dtype=config.params_dtype, device=device))
        self.layer_norm_bias = None
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype, device=device))
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = config.sequence_parallel

    def forward(self, input_: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """[sq(/tp), b, h] -> ([sq, b, out_p], bias): the norm, then megatron's column-parallel GEMM."""
        return super().forward(normed_input(self, input_), *args, **kwargs)

    def extra_repr(self) -> str:
        zc = ", zero_centered" if self.zero_centered_gamma else ""
        return f"{self.normalization}(eps={self.eps}{zc}) -> in={self.input_size}, out={self.output_size}"


def fuse_input_norm(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a local TransformerLayer spec in TE's shape: input_layernorm -> IdentityOp, linear_qkv ->
    NormColumnParallelLinear (the norm kind comes from the config, as with TE)."""
    spec = copy.deepcopy(layer_spec)
    attention = spec.submodules.self_attention
    attention.submodules = copy.copy(attention.submodules)
    attention.submodules.linear_qkv = NormColumnParallelLinear
    spec.submodules.input_layernorm = IdentityOp
    return spec


__all__ = ["NormColumnParallelLinear", "apply_norm", "fuse_input_norm", "has_fused_norm", "normed_input"]
