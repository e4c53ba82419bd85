"""Norm modules megatron's local (non-TE) backend lacks.

megatron's local norm (`WrappedTorchNorm`, torch's RMSNorm) refuses `layernorm_zero_centered_gamma`; Transformer
Engine's norms support it natively. `ZeroCenteredRMSNorm` is the local backend's zero-centred RMSNorm, computed as
Qwen3-Next computes it: `x * rsqrt(mean(x^2) + eps) * (1 + w)` in fp32, cast back to the input dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension with weight `1 + w`; `w` starts at zeros (the plain RMSNorm at init).

    Built like megatron's norms (`config`, `hidden_size`, `eps`); the weight is replicated over tensor-parallel
    ranks and, under sequence parallelism, marked `sequence_parallel` so megatron sums its gradient over TP.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=device))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., hidden], normalised in fp32."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered"
