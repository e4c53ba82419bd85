"""benchmarks/bench_preprocess_shards.py runs end to end on a small corpus (no Slurm: the sharded run on this machine)
and prints its figures; the figures are the benchmark's to judge, not this test's."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_bench_preprocess_shards_prints_its_figures():
    bench = ROOT / "benchmarks" / "bench_preprocess_shards.py"
    args = ["--mb", "0.3", "--workers", "1", "--vocab", "512", "--no-slurm"]
    done = subprocess.run([sys.executable, str(bench), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"corpus: \d Parquet files, [\d.]+ MB on disk; BPE 512", out), out
    assert re.search(r"one process, 1 workers: [\d.]+ s \([\d,]+ tokens/s", out), out
    assert "merged bytes equal the one process's: True" in out
    m = re.search(r"merge: ([\d.]+) GB/s, plain copy: ([\d.]+) GB/s of [\d.]+ MB \(([\d.]+)x the copy\)", out)
    assert m and float(m.group(2)) > 0, out
