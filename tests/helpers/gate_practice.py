"""Workers for tests/model/test_gate_practice.py: layout-independent initialisation of the gate variants seen in
practice at TP 1 and TP 2 in one gloo process pair."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state

from helpers.parallel_workers import _build, _unshard
from megagate.model import gate as gates
from megagate.model import init
from megagate.model.model_config import ParallelConfig
from megagate.model.presets import model_preset

SEED = 1234


def initialised(model, parallel: ParallelConfig) -> torch.nn.Module:
    """The tiny GPT of `model` under `parallel`, initialised layout-independently (megagate.model.init)."""
    gpt = _build(model, parallel)
    init.initialize([gpt], seed=SEED, std=model.init_method_std, num_layers=model.num_layers)
    return gpt


def init_worker(rank: int, world: int, variants: list[str]) -> dict[str, dict[str, Any]]:
    """Per preset: the largest |TP 2 - TP 1| over every initial parameter (TP 2's shards gathered), and whether both
    builds have the same parameter names."""
    report = {}
    for variant in variants:
        model = model_preset("tiny", gate=gates.preset(variant))
        ref = initialised(model, ParallelConfig())
        full = {n: p.detach().clone() for n, p in ref.named_parameters()}
        parallel_state.destroy_model_parallel()
        tp = initialised(model, ParallelConfig(tensor_model_parallel_size=world))
        group = parallel_state.get_tensor_model_parallel_group()
        gathered = {n: _unshard(n, p.detach(), p, group) for n, p in tp.named_parameters()}
        report[variant] = {
            "names": sorted(gathered) == sorted(full),
            "diff": max((gathered[n] - full[n]).abs().max().item() for n in gathered),
            "sharded": sorted(n for n, p in tp.named_parameters() if getattr(p, "tensor_model_parallel", False)),
        }
        parallel_state.destroy_model_parallel()
    return report
