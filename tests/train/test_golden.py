"""Golden losses: a short deterministic run of examples/tiny_cpu.yaml on the real demo text, step by step, against
tests/golden/tiny_cpu_losses.json.

The run is the example config as it is (G1 elementwise, 16 x 128 tokens per step as 4 micro-batches, LR 3e-3,
warm-up 6, cosine), shortened to GOLDEN_STEPS steps, with the final validation. Regenerate the file (after a change
that is *meant* to move the numbers; say why in the commit):

    .venv/bin/python tests/train/test_golden.py --write

Tolerance: fp32 on CPU is deterministic for one machine and thread count, but reductions (BLAS matmuls, the
gradient-norm and loss sums) may be ordered differently with another BLAS, CPU or thread count. `--write` measures
what a different summation order does (OMP_NUM_THREADS 1 -> 2: exactly 0 on the machine that wrote the file;
micro-batches 4 -> 2 or 8, the same global batch accumulated in another order: <= 6e-7) and what real
changes do (LR +10 %, one more warm-up step, another gate: >= 9e-3); the tolerance 1e-4 is ~170x the first and
1/90 of the second ("tolerance_reason" in the file has the numbers of the last regeneration).
The corpus is built from this machine's Python standard library and license texts: if its fingerprint differs from
the golden's, the comparison is meaningless and the test skips, naming the command that regenerates the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "tiny_cpu_losses.json"
CONFIG = "examples/tiny_cpu.yaml"
GOLDEN_STEPS = 30
OVERRIDES = [
    f"train.train_steps={GOLDEN_STEPS}",
    "logging.interval=1",
    "logging.tensorboard=false",
    "checkpoint.interval=0",
]
REGENERATE = ".venv/bin/python tests/train/test_golden.py --write"
DEMO_VOCAB, DEMO_BYTES = 2048, 1_500_000  # the example's demo data (DataSection defaults)


def run(out: Path, demo_dir: Path, *extra: str, threads: int = 1) -> dict[str, dict[str, float]]:
    """Train the golden run (plus `extra` overrides) in a fresh process; its train and validation losses."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "megagate",
        "train",
        "--config",
        CONFIG,
        *OVERRIDES,
        *extra,
        f"data.demo_dir={demo_dir}",
        f"output.dir={out}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {split: {str(r["step"]): r["loss"] for r in records if r["split"] == split} for split in ("train", "valid")}


def fingerprint(demo_dir: Path) -> str:
    """sha256 of the tokenised demo corpus (it depends on this machine's Python stdlib and license texts)."""
    from megagate.data.demo import prepare_demo_data

    _, prefix = prepare_demo_data(demo_dir, DEMO_VOCAB, DEMO_BYTES)
    digest = hashlib.sha256()
    for suffix in (".bin", ".idx"):
        digest.update(Path(prefix + suffix).read_bytes())
    return digest.hexdigest()


def max_difference(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> float:
    assert {s: sorted(v) for s, v in a.items()} == {s: sorted(v) for s, v in b.items()}, "different steps"
    return max(abs(a[split][step] - b[split][step]) for split in a for step in a[split])


@pytest.mark.slow
def test_tiny_cpu_losses_match_the_golden_file(tmp_path: Path, session_demo_dir: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    if fingerprint(session_demo_dir) != golden["corpus_sha256"]:
        pytest.skip(
            f"this machine's demo corpus differs from the golden file's (Python {golden['python']}): "
            f"regenerate with `{REGENERATE}`"
        )
    ours = run(tmp_path, session_demo_dir)
    assert sorted(ours["train"], key=int) == [str(s) for s in range(1, GOLDEN_STEPS + 1)]
    worst = max(
        (abs(ours[split][step] - golden[split][step]), split, step)
        for split in ("train", "valid")
        for step in golden[split]
    )
    assert worst[0] <= golden["tolerance"], (
        f"{worst[1]} loss at step {worst[2]}: {ours[worst[1]][worst[2]]!r} vs golden {golden[worst[1]][worst[2]]!r} "
        f"(|diff| {worst[0]:.3g} > tolerance {golden['tolerance']:g}); if the change is intended: `{REGENERATE}`"
    )


# Mathematically the same run, another floating-point summation order: what another BLAS or CPU changes.
REORDERINGS = {
    "OMP_NUM_THREADS 1 -> 2": ([], 2),
    "micro-batch 4 -> 2 (accumulation order)": (["train.micro_batch_size=2"], 1),
    "micro-batch 4 -> 8 (accumulation order)": (["train.micro_batch_size=8"], 1),
}
# Real behaviour changes, the smallest ones a trainer or model change could plausibly make.
CHANGES = {
    "train.lr 3e-3 -> 3.3e-3": ["train.lr=3.3e-3"],
    "train.warmup_steps 6 -> 7": ["train.warmup_steps=7"],
    "gate g1-elementwise -> g1-headwise": ["model.gate.preset=g1-headwise"],
    "gate g1-elementwise -> baseline": ["model.gate.preset=baseline"],
}
TOLERANCE = 1e-4


def write(demo_dir: Path) -> None:
    """Regenerate the golden file: the run with 1 thread, and the differences that justify the tolerance."""
    from importlib.metadata import version

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        golden = run(t / "golden", demo_dir)
        assert max_difference(golden, run(t / "again", demo_dir)) == 0.0, "two identical runs differ"
        reorder = {
            name: max_difference(golden, run(t / f"r{i}", demo_dir, *over, threads=threads))
            for i, (name, (over, threads)) in enumerate(REORDERINGS.items())
        }
        changes = {
            name: max_difference(golden, run(t / f"c{i}", demo_dir, *over))
            for i, (name, over) in enumerate(CHANGES.items())
        }
    noise, smallest = max(reorder.values()), min(changes.values())
    assert noise * 10 <= TOLERANCE <= smallest / 10, f"the tolerance no longer separates them: {reorder} {changes}"
    data = {
        "command": f"megagate train --config {CONFIG} {' '.join(OVERRIDES)} data.demo_dir=DEMO output.dir=OUT",
        "regenerate": REGENERATE,
        "tolerance": TOLERANCE,
        "tolerance_reason": (
            f"max |loss difference| over all steps, against this run: 0 for a second identical run; at most "
            f"{noise:.2g} for the same run with another summation order ("
            + ", ".join(f"{k}: {v:.2g}" for k, v in reorder.items())
            + f"); at least {smallest:.2g} for a real change ("
            + ", ".join(f"{k}: {v:.2g}" for k, v in changes.items())
            + f"). The tolerance is {TOLERANCE / noise if noise else math.inf:.0f}x the first and "
            f"1/{smallest / TOLERANCE:.0f} of the second."
        ),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": version("megatron-core"),
        "corpus_sha256": fingerprint(demo_dir),
        "train": golden["train"],
        "valid": golden["valid"],
    }
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {GOLDEN}: tolerance {TOLERANCE:g}; {data['tolerance_reason']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="regenerate tests/golden/tiny_cpu_losses.json")
    parser.add_argument("--write", action="store_true", required=True)
    parser.add_argument("--demo-dir", default=str(ROOT / "runs" / "demo-data"), help="where the demo corpus is cached")
    write(Path(parser.parse_args().demo_dir))
