"""Helpers for trainer tests: run `megagate train` (one process or several ranks), read metrics and checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from helpers import forked

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"
BASE = [
    "train.seq_length=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.train_steps=12",
    "train.warmup_steps=2",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.interval=1",
    "checkpoint.interval=0",
    "logging.tensorboard=false",
]


# Multi-process runs compare their ranks in windows of 4 steps (the default, 20, never ends a window in these short
# runs) and must report no straggler: no false positives (tests/train/test_stragglers.py has the true one, a rank
# 1.5x slower against the default margin 0.25). The margin here is a rank twice as slow: `make test` runs two test
# modules at once on two cores, so a rank of one module's job can really lose a quarter of its CPU to the other's.
STRAGGLER = ["straggler.interval=4", "straggler.windows=2", "straggler.margin=1.0"]


def no_stragglers(out: Path) -> None:
    """Fail if the run at `out` reported a straggler (health.jsonl)."""
    from megagate.health import channel

    reports = channel.read_events(out, "straggler")
    assert reports == [], f"{out}: straggler reported in a run without a slow rank: {reports}"


def run_train(
    out: Path,
    demo_dir: Path,
    *overrides: str,
    nproc: int = 1,
    check: bool = True,
    timeout: int = 600,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Run `megagate train` on the tiny config in forked children of the preloaded server (helpers.forked): one
    process, or nproc ranks with torchrun's variables (gloo), which must report no straggler; `env` adds variables.
    fresh=True starts a new interpreter instead (`python -m megagate`, torchrun for nproc > 1): for tests whose
    subject is what a fresh process prints at start-up (the notices megatron writes while it is imported)."""
    window = STRAGGLER if nproc > 1 else []
    args = ["--config", str(CONFIG), *BASE, *window, f"data.demo_dir={demo_dir}", f"output.dir={out}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if fresh:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
        cmd = [sys.executable, *launcher, "-m", "megagate", "train", *args]
        env = {k: v for k, v in env.items() if k not in forked.DIST_VARS}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        proc = forked.run_cli(["train", *args], env=env, nproc=nproc, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"megagate train {' '.join(args)} ({nproc} process(es)) failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    if check and nproc > 1:
        no_stragglers(out)
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """step -> train loss from metrics.jsonl."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == "train":
            out[record["step"]] = record["loss"]
    return out


def checkpoint_tensors(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a dist_checkpointing checkpoint (full, unsharded), read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(target))
    state = torch.load(target, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.startswith("optimizer")}


def foreign_console_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """What a run printed that megagate did not: every stderr line (a clean run writes nothing there; megagate's
    warnings and errors do) and the native libraries' stdout lines (gloo's connection counts)."""
    return proc.stderr.splitlines() + [line for line in proc.stdout.splitlines() if line.startswith("[Gloo]")]
