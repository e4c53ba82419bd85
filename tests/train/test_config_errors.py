"""Bad training configs: one line naming the value, a non-zero exit, no traceback, nothing trained.

The table of one-line refusals of every command is tests/test_bad_inputs.py; here: the real process's exit code, and
the refusals that depend on the machine (Transformer Engine installed) or print a plan.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from megagate.cli import main
from megagate.model.kernels import transformer_engine_available

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "tiny_cpu.yaml")


@pytest.mark.skipif(transformer_engine_available(), reason="Transformer Engine is installed")
def test_fp8_without_te_refused(capsys):
    assert main(["train", "--config", CONFIG, "--dry-run", "train.precision=fp8"]) == 2
    assert "train.precision='fp8' needs Transformer Engine" in capsys.readouterr().err


def test_real_process_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megagate",
            "train",
            "--config",
            CONFIG,
            "train.seq_length=100000",
            f"output.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "train.seq_length (100000) exceeds model.max_sequence_length (128)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_monitor_typo_refused_before_anything_is_built(tmp_path):
    """A spike-monitor key typo stops a real launch at config reading: exit 2, one line, no run directory."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megagate",
            "train",
            "--config",
            CONFIG,
            "monitor.spike.treshold=3",
            f"output.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "megagate train: error: monitor.spike.treshold is not a known key; allowed: abs_ceiling, action, center_window, "
        "direction, early_min_history, early_rise, enabled, lr_backoff_factor, lr_backoff_steps, max_consecutive, "
        "max_rollbacks, metric_thresholds, metrics, min_history, rel_floor, rollback_skip_steps, threshold, transform, "
        "window; did you mean 'threshold'?"
    ]
    assert not (tmp_path / "run").exists()


def test_missing_config_file(capsys):
    assert main(["train", "--config", "/nonexistent.yaml"]) == 2
    assert "config file '/nonexistent.yaml' does not exist" in capsys.readouterr().err


def test_dry_run_prints_the_plan(capsys):
    assert (
        main(
            [
                "train",
                "--config",
                CONFIG,
                "--dry-run",
                "model.preset=15a2b-moe",
                "model.vocab_size=151936",
                "train.seq_length=4096",
                "model.max_sequence_length=4096",
                "parallel.expert_model_parallel_size=8",
                "train.global_batch_size=1024",
                "train.micro_batch_size=1",
                "--world-size",
                "64",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "MoE 128 experts top-8" in out
    assert "world 64 = TP 1 x PP 1 x CP 1 x DP 64; EP 8" in out
    assert "global 1024 = micro 1 x DP 64 x 16 micro-batches" in out
    assert "15,778,553,856 total" in out
