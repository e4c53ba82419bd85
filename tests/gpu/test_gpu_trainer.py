"""The trainer on one GPU in bf16 (skipped without CUDA): loss falls, checkpoints resume exactly."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def _train(out: Path, *overrides: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "megagate",
        "train",
        "--config",
        str(ROOT / "examples" / "tiny_cpu.yaml"),
        "train.precision=bf16",
        "train.backend=local",
        "train.train_steps=20",
        "train.eval_interval=0",
        "logging.interval=1",
        f"output.dir={out}",
        f"data.demo_dir={out.parent / 'demo-data'}",
        *overrides,
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=600)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def test_bf16_training_and_exact_resume(tmp_path):
    _train(tmp_path / "full")
    _train(tmp_path / "resumed", "train.exit_after_steps=10")
    _train(tmp_path / "resumed")
    full, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "resumed")
    assert full[20] < full[1] - 0.1
    assert all(abs(full[s] - resumed[s]) < 1e-4 for s in full)  # cuBLAS may reorder sums; bf16 loss
