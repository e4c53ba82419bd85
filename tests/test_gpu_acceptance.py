"""tools/gpu_acceptance.{sh,py}: the one-shot GPU acceptance script, exercised on CPU (--smoke) and refusing bad
arguments; the real run needs a GPU machine (issue 10's device check)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_smoke_run_writes_every_part(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "tools/gpu_acceptance.py", "--out", str(out), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_acceptance.json").read_text())
    assert not list(out.glob("*.tmp"))
    assert result["smoke"] is True and "finished" in result
    assert result["environment"]["megatron_core"].startswith("0.19")
    train = result["training"]
    assert train["rc"] == 0 and train["steps"] == 4 and train["median_tokens_per_s"] > 0
    bench = result["benchmark"]
    assert set(bench["cases"]) == {"baseline/sdpa", "baseline/local", "g1/sdpa", "g1/local"}
    for case in bench["cases"].values():
        assert len(case["times_s"]) == 2 and case["step_s"] > 0 and case["tflops"] > 0
    # each ratio is the quotient of the medians it names
    cases = bench["cases"]
    ratio = bench["ratios"]["g1_over_baseline_step_time/sdpa"]
    assert ratio == pytest.approx(cases["g1/sdpa"]["step_s"] / cases["baseline/sdpa"]["step_s"], rel=1e-3)


@pytest.mark.parametrize(
    "args, message",
    [(["--layers", "0"], "--layers 0: must be >= 1"), (["--seq", "-4"], "--seq -4: must be >= 1")],
)
def test_bad_arguments_are_one_line(tmp_path, args, message):
    proc = subprocess.run(
        [sys.executable, "tools/gpu_acceptance.py", "--out", str(tmp_path), "--smoke", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"gpu_acceptance: error: {message}"
    assert not (tmp_path / "gpu_acceptance.json").exists()


def test_shell_wrapper_without_megatron_or_wheel_says_so(tmp_path):
    """On a machine with neither megatron-core nor the carried wheel, one line and exit 2 (python3 here lacks it)."""
    bare = subprocess.run(["python3", "-c", "import megatron.core"], capture_output=True)
    if bare.returncode == 0:
        pytest.skip("the system python3 has megatron-core")
    work = tmp_path / "tree"
    (work / "tools").mkdir(parents=True)
    (work / "tools" / "gpu_acceptance.sh").write_text((ROOT / "tools" / "gpu_acceptance.sh").read_text())
    proc = subprocess.run(
        ["bash", "tools/gpu_acceptance.sh", str(tmp_path / "out")],
        cwd=work,
        env={**os.environ, "PYTHON": "python3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "no .whl/megatron_core-*.whl was carried" in proc.stderr
