"""benchmarks/bench_plan_accuracy.py: its six configurations load and plan (with a profile file, as each round
does), a failing subprocess is named with its stderr's tail, and (slow) one round end to end on this machine."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.plan_profiles import cpu_profile
from megagate.plan import profile as profile_mod

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench_plan_accuracy.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_plan_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_configuration_plans(bench, tmp_path) -> None:
    path = tmp_path / "profile.json"
    profile_mod.save(cpu_profile(), str(path))
    steps = {name: bench.predict(name, str(path), steps=20) for name in bench.CONFIGS}
    assert all(0 < s < 60 for s in steps.values()), steps
    # the overrides reach the plan: sequence 256 at micro-batch 2 is the tokens of 128 at 4 in twice the
    # micro-batches (twice the per-micro-batch host work) with quadratic attention; G1 adds its gate to the baseline
    assert steps["dense G1 s256 mbs2"] > steps["dense G1 s128 mbs4"] > steps["dense baseline s128 mbs4"]
    ranks, over = bench.overrides("dense G1 s128 mbs4 TP2", 20, "out")
    assert ranks == 2 and "parallel.tensor_model_parallel_size=2" in over and "output.dir=out" in over


def test_a_failing_subprocess_names_its_error(bench) -> None:
    code = "import sys; print('one\\ntwo\\nthree\\nthe reason', file=sys.stderr); sys.exit(3)"
    with pytest.raises(bench.Failed, match=r"exited 3: two \| three \| the reason$"):
        bench.run_quietly([sys.executable, "-c", code], 1)


def test_held_out_only_prints_the_second_table() -> None:
    """`--held-out-only`: the held-out table's rows with their release, its median and worst, no CPU rounds."""
    cmd = [sys.executable, str(BENCH), "--held-out-only"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "benchmarks/held_out_runs.yaml" in proc.stdout and "published_runs.yaml" not in proc.stdout
    assert "bridge-26.08-qwen3-30b-gb200-mxfp8" in proc.stdout and "26.08" in proc.stdout
    assert "held-out: 22 runs, median |error|" in proc.stdout and "round 1" not in proc.stdout


@pytest.mark.slow
def test_one_round_end_to_end() -> None:
    """A calibration (small budget), one real `megagate train` and its plan: the row and the summary print."""
    cmd = [sys.executable, str(BENCH), "--rounds", "1", "--steps", "8", "--warmup", "2", "--budget-s", "20"]
    cmd += ["--configs", "dense baseline s128 mbs4"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "round 1: calibrated in" in out and "dense baseline s128 mbs4   predicted" in out, out
    assert "of 1 configurations within 20 %" in out, out
