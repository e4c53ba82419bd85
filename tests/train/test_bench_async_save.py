"""benchmarks/bench_async_save.py runs end to end on a tiny model (one round of each kind) and prints its figures.

The figures themselves are the benchmark's to print (a loaded machine), not this test's to judge: it checks that
every timed save completed (a background one finalised into a checkpoint) and that the summary lines are there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import tiny_runs as T

pytestmark = pytest.mark.slow


def test_bench_async_save_runs_and_prints_the_ratio(session_demo_dir):
    bench = T.ROOT / "benchmarks" / "bench_async_save.py"
    args = ["--rounds", "1", "--steps-after", "1", "--hidden", "64", "--layers", "1"]
    done = subprocess.run(
        [sys.executable, str(bench), *args, "--data-dir", str(session_demo_dir)],
        cwd=T.ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "model: 1 layers, hidden 64" in out, out
    rows = re.findall(r"^\s+0\s+(sync|async)\s+([\d.]+)\s+\d+\s+\d+", out, re.M)
    assert sorted(kind for kind, _ in rows) == ["async", "sync"], out  # one timed save of each kind
    assert re.search(r"checkpoint size: \d+\.\d\d GiB", out), out
    summary = re.search(r"median stall per save: sync ([\d.]+) s, async ([\d.]+) s -> ratio sync/async [\d.]+x", out)
    assert summary and float(summary.group(1)) > 0 and float(summary.group(2)) > 0, out
