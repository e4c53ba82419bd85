"""Synchronising CUDA calls per training step on one GPU (skipped without CUDA), counted with
torch.cuda.set_sync_debug_mode around every step (helpers.step_reads): none but the host reads the trainer makes
(at logging steps with the spike monitor off, every step with a deciding action), plus megatron's own read of the
gradient norm when Transformer Engine's multi-tensor kernels are missing."""

from __future__ import annotations

import pytest
import torch

from helpers import distributed, step_reads

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RUNS = {
    "off": ["train.precision=bf16", "monitor.spike.enabled=false"],
    "skip": ["train.precision=bf16", "monitor.spike.action=skip"],
}


def test_synchronisations_per_step_are_the_reads(tmp_path):
    from megagate.model.kernels import transformer_engine_available

    result = distributed.run(
        step_reads.worker, 1, tmp_path, RUNS, str(tmp_path / "runs"), str(tmp_path / "demo-data"), backend="nccl"
    )[0]
    # without TE, megatron's get_grad_norm_fp32 reads the norm with .item(): one synchronisation per step
    hidden = 0 if transformer_engine_available() else 1
    for name, run in result.items():
        reads, syncs = dict(run["reads"]), dict(run["syncs"])
        assert sorted(reads) == list(range(1, 11)), name
        for step in range(2, 11):  # step 1 sets up lazily (optimizer state, library handles)
            assert syncs[step] == reads[step] + hidden, (name, step, syncs[step], reads[step])
    assert [n for _, n in result["skip"]["reads"]] == [1] * 10
    assert [n for _, n in result["off"]["reads"]] == [0, 0, 0, 1, 0, 0, 0, 1, 0, 1]
