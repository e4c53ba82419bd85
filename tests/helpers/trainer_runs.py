"""Helpers for the real-trainer Slurm tests: the shared run settings, reading metrics and checkpoint tensors.

(A uniquely named module, like slurm_harness.py, so it does not clash with other folders' helpers.)
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch

from helpers import forked
from helpers.slurm_harness import REPO
from helpers.tiny_runs import STRAGGLER, no_stragglers

CONFIG = REPO / "examples" / "tiny_cpu.yaml"
STEPS = 12
CHECKPOINT_INTERVAL = 3


def overrides(demo_dir: Path, out: Path, tp: int = 2) -> list[str]:
    """The one training setup every run here shares (a TP=2 x DP=2 run and a single-process run start alike)."""
    return [
        f"output.dir={out}",
        f"data.demo_dir={demo_dir}",
        f"train.train_steps={STEPS}",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.seq_length=64",
        "train.eval_interval=0",
        "logging.interval=1",
        "logging.tensorboard=false",
        f"checkpoint.interval={CHECKPOINT_INTERVAL}",
        f"parallel.tensor_model_parallel_size={tp}",
        *STRAGGLER,  # and no straggler may be reported (train_local checks; the Slurm tests check their runs too)
    ]


def local_env() -> dict[str, str]:
    """The environment for runs outside Slurm: no leaked rank or Slurm variables, the working tree's megagate."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # as the batch script sets it: the same CPU kernels, the same rounding
    return env


def train_local(demo_dir: Path, out: Path, nproc: int) -> float:
    """The shared run outside Slurm, its ranks forked from the preloaded server (helpers.forked, with the variables
    torchrun gives its workers: tests/train/test_hang_watchdog.py finds torchrun's own ranks bit-identical to them):
    one process at TP=1, or `nproc` ranks at TP=2, checked for stragglers. Returns its wall time."""
    t0 = time.monotonic()
    argv = ["train", "--config", str(CONFIG), *overrides(demo_dir, out, tp=2 if nproc > 1 else 1)]
    proc = forked.run_cli(argv, env=local_env(), nproc=nproc, timeout=300, stderr_to_stdout=True)
    out.with_suffix(".log").write_text(proc.stdout)
    assert proc.returncode == 0, (
        f"megagate train ({nproc} process(es)) exited {proc.returncode}:\n{proc.stdout[-4000:]}"
    )
    if nproc > 1:
        no_stragglers(out)
    return time.monotonic() - t0


def train_records(out: Path) -> list[dict]:
    """metrics.jsonl's train lines in the order written (a resumed run appends: steps may repeat)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if r.get("split") == "train"]


def launches(out: Path, resumed_at: list[int]) -> list[list[tuple[int, float]]]:
    """(step, loss) lines of each launch of a run that resumed after the steps `resumed_at` (one per relaunch).

    Launch i + 1 starts with step resumed_at[i] + 1 and, but for the last, ends where the next one resumed (a
    killed launch's steps after its last checkpoint are trained again, and the resumed launch's lines replace its
    own). Split from the end: the last launch wrote the last STEPS - resumed_at[-1] lines, and so on back.
    """
    lines = [(r["step"], r["loss"]) for r in train_records(out)]
    found: list[list[tuple[int, float]]] = []
    for start in reversed(resumed_at):
        cut = max(i for i, (step, _) in enumerate(lines) if step == start + 1)
        found.insert(0, lines[cut:])
        lines = lines[:cut]
    return [lines, *found]


def losses(out: Path) -> dict[int, float]:
    """step -> loss of an uninterrupted run (each step exactly once)."""
    recs = train_records(out)
    got = {r["step"]: r["loss"] for r in recs}
    assert sorted(got) == list(range(1, STEPS + 1)) and len(recs) == STEPS, [r["step"] for r in recs]
    return got


def wait_lines(out: Path, count: int, timeout: float = 150) -> int:
    """Wait until the run has written `count` train lines (all launches together); returns the last step logged."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = train_records(out)
        if len(recs) >= count:
            return recs[-1]["step"]
        time.sleep(0.05)
    raise AssertionError(f"{out} did not write {count} train lines in {timeout} s ({len(train_records(out))})")


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a megatron torch_dist checkpoint, loaded whole onto the CPU in this one process.

    Model weights (`embedding.*`, `decoder.*`, `output_layer.*`) and the fully-reshardable optimizer state
    (`optimizer.state.{param,exp_avg,exp_avg_sq}.*`) are saved as global tensors, so runs with the same model
    compare key by key whatever their parallel layout. Byte entries (extra state, common state) are skipped.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata()
    state = {
        k: torch.zeros(v.size, dtype=v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def final_checkpoint(out: Path) -> Path:
    from megagate.checkpoint import latest

    path = latest(out / "checkpoints")
    assert path is not None and path.name == f"iter_{STEPS:07d}", f"{out}: final checkpoint {path}"
    return path


def rank_pids(marker: str, rank: int) -> list[int]:
    """PIDs of this host's trainer processes whose command line contains `marker` and whose SLURM_PROCID is rank."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if b"megagate" not in cmdline or marker.encode() not in b" ".join(cmdline):
                continue
            env = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"SLURM_PROCID") == str(rank).encode() and b"SLURM_STEP_ID" in env:
            found.append(int(entry.name))
    return found


def kill_rank(marker: str, rank: int) -> int:
    """SIGKILL the one trainer process of `rank` (fails unless exactly one matches)."""
    pids = rank_pids(marker, rank)
    assert len(pids) == 1, f"rank {rank} of {marker}: pids {pids}"
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]
