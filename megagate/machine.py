"""`Machine`: what the machine a run is on offers (a GPU, Transformer Engine, DeepEP, apex's kernels), as the perf rules, the
machine checks and the run set-up need it.

`Machine.detect()` is this machine, probed once per process; `Machine.target(cfg)` is the GPU node a config is
written for, judged anywhere (a submission, a dry-run). Not the planner's GPU table (`megagate.plan.devices`, the
memory and FLOP/s of named GPUs).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megagate.run_config import TrainConfig


@dataclass(frozen=True)
class Machine:
    """What a run's machine offers. `None`: not known (a config judged away from it)."""

    gpu: bool
    te: bool  # Transformer Engine imports
    capability: tuple[int, int] | None = None  # CUDA compute capability
    deep_ep: bool | None = None  # DeepEP (the flex dispatcher's backend) imports
    apex: bool | None = None  # apex's fused_weight_gradient_mlp_cuda (gradient-accumulation fusion) imports
    softmax_kernels: bool | None = None  # megatron's fused softmax kernels (apex's CUDA extensions) import

    @classmethod
    def detect(cls) -> Machine:
        """This machine (probed once per process)."""
        return _detected()

    @classmethod
    def _probe(cls) -> Machine:
        import torch

        from megagate import extensions
        from megagate.model.kernels import transformer_engine_available

        gpu = torch.cuda.is_available()
        return cls(
            gpu=gpu,
            te=gpu and transformer_engine_available(),
            capability=tuple(torch.cuda.get_device_capability()) if gpu else None,
            deep_ep=importlib.util.find_spec("deep_ep") is not None,
            apex=extensions.available(extensions.GRADIENT_ACCUMULATION),
            softmax_kernels=extensions.available(extensions.FUSED_SOFTMAX),
        )

    @classmethod
    def target(cls, cfg: TrainConfig) -> Machine:
        """The GPU node a config is written for, judged anywhere: Transformer Engine unless backend local."""
        return cls(gpu=True, te=cfg.train.backend != "local")


@functools.cache
def _detected() -> Machine:
    return Machine._probe()
