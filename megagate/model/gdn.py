"""The Gated DeltaNet mixer: megatron-core's `GatedDeltaNet`, with a torch path where flash-linear-attention is absent.

megatron's module computes with fla's kernels (`chunk_gated_delta_rule`, `causal_conv1d`, `l2norm`) and refuses
to build without fla. Its own `deterministic_mode` branch already computes the delta rule
(`torch_chunk_gated_delta_rule`, transformers' Qwen3-Next reference) and the causal depthwise conv (`F.conv1d`) in
torch; only the q/k l2norm still calls fla. Without fla, `GatedDeltaNet` here therefore gives megatron's module a
config copy with `deterministic_mode=True` (that copy only: the rest of the model is untouched), fills fla's
missing `l2norm` name with `torch_l2norm` (the same formula: x · rsqrt(Σx² + 1e-6)), and passes the constructor's
fla check. With fla installed (GPU), megatron's kernels run unchanged.

`GDNOutputNorm` is the per-value-head RMSNorm before the output gate, with a plain weight `w` (initialised to ones)
even in a model whose other norms are zero-centred: so Qwen3-Next defines it (transformers' `Qwen3NextRMSNormGated`),
and so its weight leaves and enters a Hugging Face folder bit for bit. Its weight is replicated over tensor-parallel ranks
while each rank normalises only its own heads, so its gradient is summed over TP (megatron's finalize step sums
only sequence-parallel and q/k norms, and would leave the replicas drifting apart).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.ssm.gated_delta_net import common as gdn_common
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

FLA_AVAILABLE = gdn_common.HAVE_FLA


def torch_l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's `l2norm` in torch: x / sqrt(Σx² + eps) over `dim`, computed in fp32."""
    y = x.float()
    return (y * torch.rsqrt((y * y).sum(dim=dim, keepdim=True) + eps)).type_as(x)


if gdn_common.l2norm is None:
    gdn_common.l2norm = torch_l2norm  # the name fla would have provided; megatron looks it up at call time


def kernel_name() -> str:
    """Which delta-rule kernels the GDN layers run: "fla" (flash-linear-attention) or "torch"."""
    return "fla" if FLA_AVAILABLE else "torch"


@contextlib.contextmanager
def _constructor_without_fla() -> Iterator[None]:
    """megatron's constructor refuses to build without fla even when its torch branch will be used: lift that check
    for the construction only."""
    saved = gdn_common.HAVE_FLA
    gdn_common.HAVE_FLA = True
    try:
        yield
    finally:
        gdn_common.HAVE_FLA = saved


class GatedDeltaNet(MegatronGatedDeltaNet):
    """megatron's GatedDeltaNet, built as a TransformerLayer's mixer; the torch path where fla is absent."""

    def __init__(
        self, config: TransformerConfig, submodules: GatedDeltaNetSubmodules, pp_layer_offset: int | None = None, **kw
    ) -> None:
        # pp_layer_offset is what TransformerLayer offers attention modules; the GDN module has no use for it
        if FLA_AVAILABLE:
            super().__init__(config, submodules, **kw)
            return
        config = copy.copy(config)
        config.deterministic_mode = True  # megatron's torch branches (conv1d, chunked delta rule) in this module only
        with _constructor_without_fla():
            super().__init__(config, submodules, **kw)

    def reset_parameters(self) -> None:
        """megatron's values (dt_bias 1, A = U(A_init_range)) from the default generator: megatron draws them inside
        the model-parallel CUDA RNG fork, which on the CPU warns on every layer. megagate's layout-independent
        initialiser (megagate.model.init) overwrites them in every run anyway."""
        if not self.config.perform_initialization:
            return
        with torch.no_grad():
            if self.conv_init is not None:
                torch.nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(*self.A_init_range).log())


class GDNOutputNorm(torch.nn.Module):
    """RMSNorm over one value head with weight `w` (plain in every model), gradient summed over TP ranks."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] -> [..., head_dim], normalised in fp32 (Qwen3-Next's RMSNormGated before its gate)."""
        weight = self.weight
        if self.tp_size > 1:
            weight = copy_to_tensor_model_parallel_region(weight)  # identity forward, all-reduce of the gradient
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (weight.float() * y.type_as(x).float()).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def gdn_mixer_spec(backend: str) -> ModuleSpec:
    """The GDN mixer's spec: unfused input projection (the layer's own input norm runs before it), the output
    norm above, the output projection; TE linears under backend te, megatron's local ones otherwise."""
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

        column, row = TEColumnParallelLinear, TERowParallelLinear
    else:
        column, row = ColumnParallelLinear, RowParallelLinear
    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=column, out_norm=GDNOutputNorm, out_proj=row),
    )
