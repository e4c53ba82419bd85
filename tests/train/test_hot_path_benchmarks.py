"""The hot path's two benchmarks run as shipped (short settings): benchmarks/count_step_work.py's counts are the
ones the hot path promises (load-independent), benchmarks/bench_loop_overhead.py prints its paired ratio with
either clock. Subprocesses, as a user runs them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_count_step_work_counts_one_norm_and_no_per_step_read(session_demo_dir: Path):
    out = _run(
        ["benchmarks/count_step_work.py", "--shapes", "tiny", "--steps", "4", "--warmup", "2", "--interval", "4"]
        + ["--data-dir", str(session_demo_dir)]
    )
    rows = {m[1].strip(): m[2].split() for m in re.finditer(r"^([a-zA-Z_ ]+?)\s{2,}([-\d. ]+)$", out, re.M)}
    megagate = {k: float(v[0]) for k, v in rows.items() if v[0] != "-"}
    # megatron measures one norm per parameter tensor (19 in the tiny model): once per step, not twice (38)
    assert megagate["vector norms"] == 19.0, out
    # at DP = 1 only megatron's own one-rank reduce-scatter and norm all-reduce remain (before: 18.9 per step)
    assert megagate["collectives"] == 2.0, out
    # one read of the trainer in the 4 counted steps (3-6; 10 steps in all: the tiny config warms up for 6): the
    # logging step's (interval 4); printed with one decimal
    assert megagate["trainer host reads"] == pytest.approx(0.25, abs=0.051), out
    assert megagate["copy_"] <= 1.0 and 0 < megagate["aten ops"] < 1.1 * float(rows["aten ops"][1]), out


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_bench_loop_overhead_prints_the_paired_ratio(clock: str, session_demo_dir: Path):
    out = _run(
        ["benchmarks/bench_loop_overhead.py", "--shapes", "tiny", "--rounds", "1", "--windows", "2", "--warmup", "0"]
        + ["--interval", "4", "--clock", clock, "--data-dir", str(session_demo_dir)]
    )
    row = re.search(r"^tiny\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) \(([\d.]+)\.\.([\d.]+)\)$", out, re.M)
    assert row is not None, out
    ours, plain, ratio = (float(row[i]) for i in (1, 2, 3))
    assert ours > 0 and plain > 0 and ratio == pytest.approx(ours / plain, rel=0.01), out


def test_bench_monitor_overhead_prints_its_ratios(session_demo_dir: Path):
    """benchmarks/bench_monitor_overhead.py as shipped, one round of its three arms (monitor off, defaults, every
    probe on at each logging step): each arm's step time and the two paired ratios, consistent with each other."""
    out = _run(
        ["benchmarks/bench_monitor_overhead.py", "--rounds", "1", "--windows", "2", "--warmup", "0", "--interval", "4"]
        + ["--probe-every", "4", "--data-dir", str(session_demo_dir)]
    )
    times = {m[1]: float(m[2]) for m in re.finditer(r"^(off|default|all)\s+([\d.]+) ms/step$", out, re.M)}
    ratios = {m[1]: float(m[2]) for m in re.finditer(r"^(default / off|all / default): ([\d.]+) \(", out, re.M)}
    assert sorted(times) == ["all", "default", "off"] and all(t > 0 for t in times.values()), out
    assert ratios["default / off"] == pytest.approx(times["default"] / times["off"], rel=0.01), out
    assert ratios["all / default"] == pytest.approx(times["all"] / times["default"], rel=0.01), out
