"""The optimizer checkpoint formats end to end on CPU (gloo): real trainer runs, real dist_checkpointing.

- the default, dp_reshardable (megatron's DistributedOptimizer buckets, one shard per rank, no gather on save),
  resumes under another data-parallel size, and refuses a TP change in one line that names fully_reshardable;
- the plain (non-distributed) optimizer's per-parameter state is recorded as fully_reshardable whatever was asked
  for, and resumes under TP=2.
The two resumed runs follow one trajectory: both must equal the uninterrupted run's losses.
"""

import json
from pathlib import Path

import pytest
import torch

from helpers import tiny_runs as T
from megagate.checkpoint import saved_optimizer_format


def _format(run: Path, step: int) -> str:
    return json.loads((run / "checkpoints" / f"iter_{step:07d}" / "megagate.json").read_text())["optimizer_format"]


@pytest.mark.slow
@pytest.mark.distributed
def test_optimizer_formats_resume_and_refuse(tmp_path, session_demo_dir):
    demo = session_demo_dir
    # dp_reshardable (the default) written by DP=2, resumed by DP=1
    dist = tmp_path / "dist"
    T.run_train(dist, demo, "train.use_distributed_optimizer=true", "train.exit_after_steps=6", nproc=2)
    assert _format(dist, 6) == "dp_reshardable"
    refused = T.run_train(dist, demo, "parallel.tensor_model_parallel_size=2", nproc=2, check=False)
    errors = [line for line in refused.stderr.splitlines() if "megagate train: error:" in line]
    assert refused.returncode != 0 and errors, refused.stderr[-3000:]
    assert "tp 1 -> 2" in errors[0] and "checkpoint.optimizer_format=fully_reshardable" in errors[0], errors
    resumed = T.run_train(dist, demo)
    assert "resharded from" in resumed.stdout and _format(dist, 12) == "dp_reshardable"

    # the plain optimizer asked for dp_reshardable: recorded as fully_reshardable, resumed by TP=2
    plain = tmp_path / "plain"
    opt = "train.use_distributed_optimizer=false"
    T.run_train(plain, demo, opt, "checkpoint.optimizer_format=dp_reshardable", "train.exit_after_steps=6")
    assert _format(plain, 6) == "fully_reshardable"
    T.run_train(plain, demo, opt, "parallel.tensor_model_parallel_size=2", nproc=2)

    a, b = T.losses(dist), T.losses(plain)
    assert sorted(a) == sorted(b) == list(range(1, 13)) and a[12] < a[1] - 0.3
    for step in a:  # a resumed optimizer that lost its Adam moments would part at step 7 by far more
        assert abs(a[step] - b[step]) < 2e-4, (step, a[step], b[step])


def test_only_the_distributed_optimizer_saves_dp_reshardable():
    """No optimizer state, or a plain optimizer's per-parameter state, constrains no layout: fully_reshardable."""
    plain = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    for requested in ("dp_reshardable", "fully_reshardable"):
        assert saved_optimizer_format(None, requested) == "fully_reshardable"
        assert saved_optimizer_format(plain, requested) == "fully_reshardable"
