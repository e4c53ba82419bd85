"""`megagate demo` end to end with a few steps: real trainer subprocesses, metrics, TensorBoard, the PNG, the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megagate.monitor import runfiles

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("baseline", "g1-elementwise")


def demo(out: Path, *extra: str) -> subprocess.CompletedProcess:
    # the demo data cache is the repo's (built once, a few seconds; shared with other runs)
    cmd = [
        sys.executable,
        "-m",
        "megagate",
        "demo",
        "--out",
        str(out),
        "--steps",
        "12",
        "--data-dir",
        str(REPO / "runs" / "demo-data"),
        *extra,
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_demo_end_to_end(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "demo"
    result = demo(out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    for variant in VARIANTS:
        run_dir = out / variant
        train = runfiles.train_metrics(runfiles.read_jsonl(run_dir / "metrics.jsonl"))
        assert len(train) >= 5 and train[-1]["loss"] < train[0]["loss"], (variant, [r["loss"] for r in train])
        assert runfiles.valid_metrics(runfiles.read_jsonl(run_dir / "metrics.jsonl")), variant
        assert (runfiles.read_json(run_dir / "summary.json") or {}).get("steps") == 12
        events = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
        assert events, f"no TensorBoard event file under {run_dir}"
        acc = EventAccumulator(str(run_dir / "tensorboard"))
        acc.Reload()
        assert "train/loss" in acc.Tags()["scalars"]
        assert len(acc.Scalars("train/loss")) == len(train)
        # the streamed console carries the variant's prefix
        assert f"[{variant:>14}] step" in result.stdout

    png = out / "loss_curves.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(out.glob(".loss_curves*")), "temporary plot file left behind"

    table = result.stdout[result.stdout.index("variant ") :]
    rows = [line.split()[0] for line in table.splitlines()[2:4]]
    assert rows == list(VARIANTS), table

    # a second run reuses both finished runs instead of training again
    again = demo(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("reusing it") == 2 and "] step " not in again.stdout
    # a different length refuses to mix runs (one-line error, exit 2)
    other = demo(out, "--variants", "baseline", "--steps", "13")
    assert other.returncode == 2 and "pass --fresh" in other.stderr and "Traceback" not in other.stderr
