"""checkpoint.init_from: a fresh run from another run's weights (context extension, continued pre-training), with
the shipped recipe examples/context_extension_cpu.yaml."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import forked
from helpers import tiny_runs as T

pytestmark = pytest.mark.slow
RECIPE = T.ROOT / "examples" / "context_extension_cpu.yaml"


@pytest.fixture(scope="module")
def source(reference_run: Path) -> Path:
    """The short run: 12 steps at 64 tokens (conftest's reference run)."""
    return reference_run


def extend(out: Path, demo_dir: Path, source: Path, *overrides: str, check: bool = True):
    """The shipped recipe (smaller: 2 steps at 128 tokens) from `source`'s weights."""
    args = [
        "--config",
        str(RECIPE),
        f"checkpoint.init_from={source}",
        f"output.dir={out}",
        f"data.demo_dir={demo_dir}",
        "model.max_sequence_length=128",
        "train.seq_length=128",
        "train.train_steps=2",
        "train.warmup_steps=1",
        "logging.tensorboard=false",
        "logging.interval=1",
        *overrides,
    ]
    proc = forked.run_cli(["train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_extension_starts_from_the_source_weights(source, tmp_path, session_demo_dir):
    """With a vanishing LR the extended run's weights are the source's (to 1e-9): loaded, not initialised; the
    optimizer, schedule and data start fresh (step 1, consumed samples from 0), at the new length and RoPE base."""
    out = tmp_path / "ext"
    proc = extend(out, session_demo_dir, source, "train.lr=1e-12", "train.min_lr=0")
    assert f"initialised the model from {source / 'checkpoints' / 'iter_0000012'}" in proc.stdout
    meta = json.loads((out / "checkpoints" / "iter_0000002" / "megagate.json").read_text())
    assert meta["step"] == 2 and meta["consumed_samples"] == 2 * 4  # a fresh position: 2 steps of 4 samples
    assert meta["config"]["model"]["rotary_base"] == 1000000 and meta["data_order"]["train.seq_length"] == 128
    mine = T.checkpoint_tensors(out / "checkpoints" / "iter_0000002", tmp_path)
    theirs = T.checkpoint_tensors(source / "checkpoints" / "iter_0000012", tmp_path)
    assert mine.keys() == theirs.keys() and len(mine) >= 9
    for key in mine:
        assert torch.allclose(mine[key], theirs[key], rtol=0, atol=1e-9), key
    # the learned weights, not an initialisation: the first loss is well below a fresh model's ~ln(2048) = 7.6
    first = T.losses(out)[1]
    assert first < T.losses(source)[1] - 0.2, (first, T.losses(source)[1])


def test_extension_of_another_architecture_is_one_line(source, tmp_path, session_demo_dir):
    proc = extend(tmp_path / "ext", session_demo_dir, source, "model.gate=baseline", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and "cannot initialise the model from" in lines[0]
    assert "model.gate.position 'g1' -> 'none'" in lines[0]


def test_missing_source_is_one_line(tmp_path, session_demo_dir):
    proc = extend(tmp_path / "ext", session_demo_dir, tmp_path / "nothing-here", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "checkpoint.init_from=" in lines[0], proc.stderr[-3000:]
