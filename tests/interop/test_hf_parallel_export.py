"""Exports do not depend on the training layout: a run trained with TP=2 x PP=2 (world 4) and a MoE run with EP=2
(world 2) export to the HF tensors of the same run trained as one process; an import starts a TP=2 run.

The trainer initialises layout-independently and its first step has learning rate 0 (linear warmup from 0), so the
checkpoint of step 1 holds the initial weights: those exports must be identical. After a real update (step 2) the
layouts differ by the order of their reductions only: a tight tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_runs as T

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
NEXT = ["model.norm_zero_centered=true", "model.rotary_percent=0.5"]  # G1 as Qwen3-Next holds it
TWO_STEPS = ["train.train_steps=2", "train.warmup_steps=1", "checkpoint.interval=1", "checkpoint.keep_last=2"]
MOE = [
    "model.preset=tiny-moe",
    "model.vocab_size=2048",
    "model.gate=baseline",
    "model.moe_aux_loss_coeff=0.0",
    "model.moe_z_loss_coeff=0.0",
]


def _hf(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from megagate.interop.hf_io import export_checkpoint

    export_checkpoint(checkpoint, out, log=lambda m: None)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _compare(single: Path, parallel: Path, tmp: Path, name: str) -> tuple[float, float]:
    """(max abs difference at step 1, at step 2) of the two runs' exports; step 1 must be exact."""
    diffs = []
    for step in (1, 2):
        a = _hf(single / "checkpoints" / f"iter_{step:07d}", tmp / f"{name}-single-{step}")
        b = _hf(parallel / "checkpoints" / f"iter_{step:07d}", tmp / f"{name}-parallel-{step}")
        assert sorted(a) == sorted(b) and len(a) >= 8
        diffs.append(max((a[k] - b[k]).abs().max().item() for k in a))
        if step == 1:
            for k in a:
                assert torch.equal(a[k], b[k]), (name, k)
    print(f"{name}: export max abs difference vs one process: step 1 {diffs[0]:.3g}, step 2 {diffs[1]:.3g}")
    assert 0 < diffs[1] < 1e-5 or diffs[1] == 0, diffs
    return diffs[0], diffs[1]


@pytest.fixture(scope="module")
def single_g1(tmp_path_factory, session_demo_dir) -> Path:
    """The G1 (Qwen3-Next-shaped) run trained as one process, 2 steps: the reference of the TP2xPP2 export and the
    source of the import (one trainer run for both tests)."""
    out = tmp_path_factory.mktemp("single-g1") / "run"
    T.run_train(out, session_demo_dir, *NEXT, *TWO_STEPS)
    return out


def test_tp2_pp2_export_equals_single_process(tmp_path, session_demo_dir, single_g1, megatron_world):
    T.run_train(
        tmp_path / "tp2pp2",
        session_demo_dir,
        *NEXT,
        *TWO_STEPS,
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        nproc=4,
    )
    _compare(single_g1, tmp_path / "tp2pp2", tmp_path, "TP2xPP2 qwen3_next")


def test_ep2_moe_export_equals_single_process(tmp_path, session_demo_dir, megatron_world):
    T.run_train(tmp_path / "ep1", session_demo_dir, *MOE, *TWO_STEPS)
    T.run_train(tmp_path / "ep2", session_demo_dir, *MOE, *TWO_STEPS, "parallel.expert_model_parallel_size=2", nproc=2)
    _compare(tmp_path / "ep1", tmp_path / "ep2", tmp_path, "EP2 qwen3_moe")


def test_import_starts_a_tp2_run(tmp_path, session_demo_dir, single_g1, megatron_world):
    """export -> import (with the demo data's config) -> `megagate train --config <import>/train_config.yaml` at
    TP=2, world 2: the run loads the imported weights (its step-1 checkpoint equals them exactly: lr 0 at step 1)
    and learns from there (its first loss is the trained model's)."""
    from megagate.interop.hf_io import export_checkpoint, import_hf

    export_checkpoint(single_g1, tmp_path / "hf", log=lambda m: None)
    import_hf(tmp_path / "hf", tmp_path / "imported", config=str(T.CONFIG), log=lambda m: None)
    args = [
        "--config",
        str(tmp_path / "imported" / "train_config.yaml"),
        *T.BASE,
        "train.train_steps=2",
        "train.warmup_steps=1",
        "checkpoint.interval=1",
        f"data.demo_dir={session_demo_dir}",
        f"output.dir={tmp_path / 'run'}",
        "parallel.tensor_model_parallel_size=2",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "megagate"]
    proc = subprocess.run(
        [*cmd, "train", *args],
        cwd=T.ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"initialised the model from {tmp_path / 'imported' / 'iter_0000000'}" in proc.stdout
    mine = T.checkpoint_tensors(tmp_path / "run" / "checkpoints" / "iter_0000001", tmp_path)  # lr 0 at step 1
    theirs = T.checkpoint_tensors(tmp_path / "imported" / "iter_0000000", tmp_path)
    source = T.checkpoint_tensors(single_g1 / "checkpoints" / "iter_0000002", tmp_path)
    keys = [k for k in theirs if "_extra_state" not in k]
    assert len(keys) >= 8 and set(keys) <= set(mine)
    for key in keys:
        assert torch.equal(mine[key], theirs[key]), key
        assert torch.equal(theirs[key], source[key]), key
    # the first loss is the trained model's, well below a fresh model's ~ln(2048) = 7.6
    assert T.losses(tmp_path / "run")[1] < T.losses(single_g1)[1] - 0.1
