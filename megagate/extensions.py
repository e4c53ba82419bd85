"""Optional compiled CUDA extensions that megatron-core uses where they import, and a probe for each.

megatron-core 0.19.2 imports these by module name at the moment a fused path runs, not when a model is built, so a
GPU machine without them would fail inside the first forward or backward (a ModuleNotFoundError) unless the setting
that reaches them is off. `megagate.machine.Machine.detect()` probes them once per process and `resolve_perf` decides the
settings from the answer, saying why a GPU default is off.

* fused softmax (`perf.masked_softmax_fusion`): megatron's `FusedScaleMaskSoftmax` (the softmax of its local core
  attention, `perf.core_attention=local`) imports `scaled_masked_softmax_cuda` in `is_kernel_available` whenever
  the fusion is on, the scores are fp16/bf16, 16 < sk <= 4096, sq, sk and b·np are multiples of 4; the causal path
  then imports `scaled_upper_triang_masked_softmax_cuda`, a padding mask `scaled_masked_softmax_cuda`, no mask
  `scaled_softmax_cuda`. apex builds all three (`--cuda_ext`), as NGC's PyTorch containers ship it.
* gradient-accumulation fusion (`perf.gradient_accumulation_fusion`): megatron's linear layers import apex's
  `fused_weight_gradient_mlp_cuda` in their backward.
"""

from __future__ import annotations

import importlib.util

FUSED_SOFTMAX = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda")
GRADIENT_ACCUMULATION = ("fused_weight_gradient_mlp_cuda",)


def available(modules: tuple[str, ...]) -> bool:
    """Whether every one of these top-level modules can be imported here (found, not imported)."""
    return all(importlib.util.find_spec(name) is not None for name in modules)
